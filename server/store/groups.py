"""Tensor-parallel hand-offs (a `shard` on a push or a pull) are a group: each pushing rank's part is an entry of its
own (under an internal key no caller can name), checked against that rank's view of the contract; the hand-off is
whole once every pushing rank has committed. The first pull fixes the pulling TP size and cuts one entry per pulling
rank (reshard.py); each is claimed, leased and confirmed on its own, exactly as a whole hand-off is, and the
group is gone once every pulling rank has confirmed. Any rank's push failing, or any part expiring, frees the group.

A pull made while the push is under way does not wait for it: where each pulling rank needs exactly what one
pushing rank sends, the group streams through (`stream_through`: no cut at all); otherwise the cut is made as the
push arrives (`cut_as_pushed`), tensor by tensor, each as soon as every pushing rank holding it has all of it.

`TensorParallel` does this on the store's holdings (holdings.py), under its lock; the arithmetic of heads is
handoff_client/protocol/shards.py, the cut itself server/store/reshard.py.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from handoff_client.protocol.contract import Contract
from handoff_client.protocol.errors import HandoffExists, ShardMismatch
from handoff_client.protocol.shards import WHOLE, Shard, ShardContract

from . import reshard
from .entries import Entry, HandoffKey, Stage, StoredChunk, by_tensor, run_interrupts
from .ledger import Reservation

if TYPE_CHECKING:
    from .holdings import Holdings

logger = logging.getLogger(__name__)

CutWork = Callable[[], None]
"""Copying begun under the store's lock, to be done outside it (it takes the lock itself to hand its result over)."""


@dataclass(eq=False)
class Group:
    """A hand-off pushed, or pulled, by tensor-parallel ranks: its pushing ranks' entries until the first pull, then
    its pulling ranks' entries until each has confirmed."""

    key: HandoffKey
    contract: Contract
    position: int
    push_size: int
    created: float
    pushed: dict[int, Entry] = field(default_factory=dict)
    push_digests: dict[int, str] = field(default_factory=dict)  # each rank's, from its commit: a retry is known
    pull_size: int = 0  # fixed by the first pull
    pulled: dict[int, Entry] = field(default_factory=dict)
    # Streamed through: each pulling rank claims its pushing rank's own part and streams it as it arrives (`pulled`
    # is then `pushed` itself), because at this TP size every rank pulls exactly what it pushes.
    live: bool = False
    # Cut as pushed: the pulling ranks' parts exist, uncommitted, and each tensor is cut into them as soon as every
    # pushing rank that holds it has all of it; they commit once every pushing rank has (`finish_cut`).
    feeding: bool = False
    plans: list[reshard.ShardPlan] = field(default_factory=list)
    holders: dict[str, list[tuple[Entry, int]]] = field(default_factory=dict)  # per tensor: (pushed part, index)
    built: set[str] = field(default_factory=set)  # tensors cut, or being cut
    building: int = 0  # cuts of tensors under way, outside the lock
    confirmed: set[int] = field(default_factory=set)
    cutting: bool = False
    reservation: Reservation | None = None  # the cut's copies, and the pushed frames its parts reuse
    ended: str | None = None

    @property
    def complete(self) -> bool:
        return len(self.pushed) == self.push_size and all(e.committed for e in self.pushed.values())

    @property
    def receiving(self) -> bool:
        """Still being pushed, as status counts it: not whole yet, whether or not its ranks already stream through or
        are cut as it arrives."""
        return not self.complete and (not self.pull_size or self.live or self.feeding)


def part_key(key: HandoffKey, side: str, shard: Shard) -> HandoffKey:
    """The internal key of one rank's part: the unit separator cannot appear in a caller's (printable) id."""
    model, handoff_id = key
    return model, f"{handoff_id}\x1f{side}:{shard.rank}/{shard.size}"


class TensorParallel:
    """The store's handling of tensor-parallel groups, on its holdings. Every method runs with the lock held, except
    the cut work (`CutWork`) that `cut_as_pushed` and `begin_cut` hand back: the caller does it after letting go of
    the lock, and the work takes the lock again itself to hand its result over."""

    def __init__(self, holdings: Holdings) -> None:
        self.h = holdings

    def sharding_checks(self, key: HandoffKey, group: Group | None, shard: Shard, position: int) -> str | None:
        """Under the lock: refuse a push whose TP size differs from the hand-off's other ranks'; the digest a
        retried push must repeat, when its rank's part has already been cut for pulling (else None)."""
        model, handoff_id = key
        if group is None:
            if not shard.whole and key in self.h.entries:
                raise ShardMismatch(model, handoff_id, "pushed", 1, shard.size)
            return None
        if group.push_size != shard.size:
            raise ShardMismatch(model, handoff_id, "pushed", group.push_size, shard.size)
        if group.position != position:
            raise HandoffExists(model, handoff_id, f"was pushed at position {group.position}, not {position}")
        if group.live:  # no cut: a rank's repeat meets its part, or (once confirmed) the digest it had
            return group.push_digests.get(shard.rank, "") if shard.rank in group.confirmed else None
        if group.feeding:  # a committed rank's frames are being cut: its repeat is checked by digest
            return group.push_digests.get(shard.rank)
        if group.pull_size or group.cutting:
            return group.push_digests.get(shard.rank, "")
        return None

    def stream_through(self, group: Group, size: int) -> bool:
        """Under the lock, at a pull of a group still being pushed: go live if pulling rank r at `size` needs exactly
        what pushing rank r sends (equal TP sizes, every tensor split by heads the TP size divides: no replicated
        heads, no tensor that only rank 0 pushes). Then no cut is needed, now or later, and each pulling rank streams
        its part while it arrives, as a whole hand-off's pull does; the end of every stream waits for the last
        pushing rank's commit, so no rank's decoder holds a hand-off that is not whole."""
        if group.pull_size or group.cutting or group.complete or size != group.push_size:
            return False
        if not _each_rank_pulls_what_it_pushes(group.contract, size):
            return False
        group.pull_size, group.live, group.pulled = size, True, group.pushed
        logger.info("hand-off %s/%s streams through to %d pulling ranks as it is pushed", *group.key, size)
        return True

    def adopt(self, entry: Entry) -> Group:
        """Under the lock: a whole hand-off becomes a group of one pushing rank, for a sharded pull to cut."""
        group = Group(entry.key, entry.contract, entry.position, 1, entry.created, pushed={0: entry},
                      push_digests={0: entry.digest} if entry.committed else {},
                      reservation=self.h.ledger.reservation())  # fmt: skip
        entry.group = group
        self.h.groups[entry.key] = group
        return group

    def adopt_as_pushed(self, entry: Entry, size: int, work: list[CutWork]) -> Group | None:
        """Under the lock: a whole push still under way becomes a group of one pushing rank cut for `size` pulling
        ranks as it arrives (`cut_as_pushed`); None, and nothing changed, when the cut cannot begin now."""
        group = self.adopt(entry)
        if self.cut_as_pushed(group, size, work):
            return group
        del self.h.groups[entry.key]
        entry.group = None
        return None

    def whole_at_last(self, group: Group) -> list[str]:
        """Under the lock, as a rank commits: a live group's pulling ranks may end their streams once all have; a
        group cut as pushed commits its pulling ranks' parts once every tensor is cut (the tensors still to cut are
        returned, for the committing thread to cut outside the lock)."""
        if group.live and group.complete:
            for entry in group.pushed.values():
                entry.changed.notify_all()
        if group.feeding and group.complete:
            ready = self.ready_to_cut(group)
            self.finish_cut(group)
            return ready
        return []

    def cut_as_pushed(self, group: Group, size: int, work: list[CutWork]) -> bool:
        """Under the lock, at a pull of a group still being pushed that cannot stream
        through: make the pulling ranks' parts now and cut each tensor into them as soon as every pushing rank holding
        it has all of it, so decode ranks start on the first layers while the prefill ranks still push the last.
        Each stream's end still waits for the last pushing rank's commit. The tensors already whole are added to
        `work`, to cut outside the lock. False, changing nothing, while a pushing rank has not begun (its view decides
        where heads come from) or when the copies would not fit now."""
        if group.pull_size or group.cutting or group.complete or len(group.pushed) != group.push_size:
            return False
        extra = self.cut_bytes(group, size)
        if not self.h.ledger.fits(extra):
            return False
        group.reservation.charge(extra)
        for entry in group.pushed.values():  # from now on a part's chunks are kept by tensor only, for the cut to
            entry.by_tensor = by_tensor(entry.arrived, len(entry.contract.carried))  # free each tensor's as it goes
            entry.arrived, entry.ordered = [], []
        group.plans = _plans(group, size)
        for rank, view in _pushed(group).items():
            for index, carried in enumerate(view[0].carried):
                group.holders.setdefault(carried.name, []).append((group.pushed[rank], index))
        ttl = min(entry.ttl for entry in group.pushed.values())
        for rank, plan in enumerate(group.plans):
            self.new_part(group, Shard(rank, size), plan.view, ttl)
        group.pull_size, group.feeding = size, True
        self.h.events.resharded(group.key[0], extra)
        logger.info("hand-off %s/%s is cut for %d pulling ranks as it is pushed", *group.key, size)
        ready = self.ready_to_cut(group)
        if ready:
            work.append(functools.partial(self.cut_tensors, group, ready))
        return True

    def ready_to_cut(self, group: Group) -> list[str]:
        """Under the lock: the tensors every pushing rank holding them now has whole and that nobody is cutting yet,
        marked as being cut (the caller cuts them with `cut_tensors`, outside the lock)."""
        if not group.feeding or group.ended is not None:
            return []
        ready = [
            name
            for name, holders in group.holders.items()
            if name not in group.built and all(entry.spans[index].complete for entry, index in holders)
        ]
        if ready:
            group.built.update(ready)
            group.building += 1
        return ready

    def cut_tensors(self, group: Group, names: list[str]) -> None:
        """Outside the lock: cut these tensors into the pulling ranks' parts and hand them to their streams."""
        try:
            built = [reshard.build_tensor(group.plans, name) for name in names]
        except BaseException:
            with self.h.lock:
                group.building -= 1
                interrupts = self.h.end_group(group, "aborted") if group.ended is None else []
            run_interrupts(interrupts)
            raise
        with self.h.lock:
            group.building -= 1
            if group.ended is not None:
                return  # cancelled, or a rank failed, meanwhile: its parts are gone
            for per_rank in built:
                for rank, chunks in enumerate(per_rank):
                    if chunks:
                        part = group.pulled[rank]
                        part.arrived += chunks
                        part.changed.notify_all()
            self.finish_cut(group)

    def finish_cut(self, group: Group) -> None:
        """Under the lock: once every pushing rank has committed and every tensor is cut, the pulling ranks' parts
        commit (their streams may end) and the pushed parts go; their frames live on in the parts that reuse them."""
        if not group.feeding or group.ended is not None or not group.complete or group.building:
            return
        if len(group.built) != len(group.holders):
            return  # the committing thread cuts what is left, then comes back here
        now = self.h.clock()
        committed_at = max(entry.committed_at for entry in group.pushed.values())
        for part in group.pulled.values():
            part.ordered = sorted(part.arrived, key=lambda c: (c.index, c.offset))
            part.commit(reshard.digest_of(part.ordered), now, committed_at)
            self.h.schedule(part)
        self.hand_over_pushed(group, group.plans)
        group.feeding, group.holders, group.plans = False, {}, []
        self.h.changed.notify_all()

    def new_part(self, group: Group, shard: Shard, view: ShardContract, ttl: float) -> Entry:
        """Under the lock: a pulling rank's part of the group, filled by the cut, in the store under its own key."""
        part = Entry(part_key(group.key, "pull", shard), view, group.position, ttl, threading.Condition(self.h.lock),
                     stage=Stage.FILLING, created=group.created, group=group, rank=shard.rank)  # fmt: skip
        self.h.add(part)
        group.pulled[shard.rank] = part
        return part

    def hand_over_pushed(self, group: Group, plans: list[reshard.ShardPlan]) -> None:
        """Under the lock, once the cut is whole: the pushed parts go. What the pulling ranks' parts reuse of their
        frames stays reserved, by the group; what the cut copied (and so freed) is charged no more."""
        reused = {id(chunks) for plan in plans for chunks in plan.reuse.values()}
        for entry in list(group.pushed.values()):
            kept = sum(c.nbytes for c, chunks in zip(entry.contract.carried, entry.by_tensor) if id(chunks) in reused)
            self.h.free(entry, "cut")  # (its reservation released first: the group's charge then fits)
            group.reservation.charge(kept)
        group.pushed = {}

    def begin_cut(self, group: Group, size: int) -> CutWork | None:
        """Under the lock, at the first pull of a group whose every pushing rank has committed: reserve the copies
        for `size` pulling ranks' parts and return the work that makes them (outside the lock); None, changing
        nothing, when the copies would not fit in `max_bytes` now."""
        plans = _plans(group, size)
        extra = sum(p.new_bytes for p in plans)
        if not self.h.ledger.fits(extra):
            return None
        group.cutting = True
        group.reservation.charge(extra)  # reserved before the copies are made
        for entry in group.pushed.values():  # the cut owns the chunks (by tensor) and frees each tensor's once built
            entry.arrived, entry.ordered = [], []
        return functools.partial(self._cut, group, size, plans, extra)

    def _cut(self, group: Group, size: int, plans: list[reshard.ShardPlan], extra: int) -> None:
        """Outside the lock: cut the group's pushed parts into `size` pulling ranks' parts; then, under it, the parts
        join the store and the pushed parts go."""
        h = self.h
        try:
            built = reshard.build_all(plans)
        except BaseException:
            with h.lock:
                group.cutting = False
                interrupts = h.end_group(group, "aborted") if group.ended is None else []  # (partly released)
            run_interrupts(interrupts)
            raise
        with h.lock:
            group.cutting = False
            if group.ended is not None:
                return  # cancelled or lost meanwhile: the next look finds it gone
            now = h.clock()
            ttl = min(entry.ttl for entry in group.pushed.values())
            committed_at = max(entry.committed_at for entry in group.pushed.values())  # each rank's wait counts from it
            for rank, (plan, (chunks, digest)) in enumerate(zip(plans, built)):
                part = self.new_part(group, Shard(rank, size), plan.view, ttl)
                part.ordered = chunks
                part.commit(digest, now, committed_at)
                h.schedule(part)
            group.pull_size = size
            self.hand_over_pushed(group, plans)
            h.changed.notify_all()
            h.events.resharded(group.key[0], extra)
        logger.info("hand-off %s/%s cut for %d pulling ranks (%d bytes copied)", *group.key, size, extra)

    def cut_bytes(self, group: Group, size: int) -> int:
        """What cutting the group for `size` pulling ranks would copy (and so reserve)."""
        return sum(p.new_bytes for p in _plans(group, size))


@functools.lru_cache(maxsize=256)
def _each_rank_pulls_what_it_pushes(contract: Contract, size: int) -> bool:
    """Whether, at TP size `size` on both sides, every rank's pulling view is its pushing view (a pull waiting on a
    group asks again at every wake, and the answer depends on nothing else)."""
    for rank in range(size):
        shard = Shard(rank, size)
        if (
            ShardContract.of(contract, shard, pushing=True).carried
            != ShardContract.of(contract, shard, pushing=False).carried
        ):
            return False
    return True


def _pushed(group: Group) -> reshard.Pushed:
    """The pushed parts as the cut reads them: each rank's view of the contract (a whole push's is rank 0 of 1), and
    its chunks by tensor (none yet for a part still being pushed and not cut as it arrives: enough to size a cut)."""
    pushed: dict[int, tuple[ShardContract, list[list[StoredChunk]]]] = {}
    for rank, entry in group.pushed.items():
        view = entry.contract
        if not isinstance(view, ShardContract):
            view = ShardContract.of(view, WHOLE, pushing=True)
        pushed[rank] = (view, entry.by_tensor or [[] for _ in view.carried])
    return pushed


def _plans(group: Group, size: int) -> list[reshard.ShardPlan]:
    pushed = _pushed(group)
    return [reshard.plan(group.contract, pushed, Shard(rank, size)) for rank in range(size)]
