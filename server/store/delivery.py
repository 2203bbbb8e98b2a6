"""The decode side of the store: a claim granted (waiting for the push to begin, or the cut to be made), its
chunks fed to its stream as they are there, its stream's end (leased until confirmed, or returned at once when
broken), and the confirm that lets the hand-off go.

What is decided here: one claimant at a time, each claim numbered once for the store's life, so only the current
claim can confirm; a claim made while the push is under way streams the chunks as they arrive but ends only after
the commit; a tensor-parallel pull is one rank's part (server/store/groups.py makes the parts). Runs on the store's
holdings (server/store/holdings.py), under its lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from handoff_client.protocol.errors import (
    AlreadyClaimed,
    CapacityExhausted,
    Draining,
    HandoffCancelled,
    HandoffGone,
    PushAborted,
    ShardMismatch,
    StaleClaim,
    UnknownHandoff,
    WaitTimedOut,
)
from handoff_client.protocol.shards import WHOLE, Shard, ShardContract

from .entries import (
    FEED_BATCH,
    WAIT_SLICE,
    Claim,
    Entry,
    HandoffKey,
    Hold,
    Interrupt,
    StoredChunk,
    run_interrupts_later,
)
from .groups import CutWork, TensorParallel, part_key
from .holdings import GONE_WORDS, Holdings, check_id

logger = logging.getLogger("handoff_broker.store")


class Delivery:
    """Claims on what the store holds."""

    def __init__(self, holdings: Holdings, tp: TensorParallel, closed: threading.Event) -> None:
        self.h = holdings
        self.tp = tp
        self.closed = closed  # the store is closing: waiting claims end

    def claim(
        self,
        model: str,
        handoff_id: str,
        wait: float,
        is_active: Callable[[], bool] = lambda: True,
        interrupt: Interrupt | None = None,
        supersedes: int = 0,
        shard: Shard = WHOLE,
    ) -> Claim:
        """Claim a hand-off, waiting up to `wait` seconds for its push to begin; a claim made while the push is under
        way streams its chunks as they arrive (`feed`). `supersedes` names the caller's own earlier claim, which
        this one replaces if it still stands. With a `shard`, or of a tensor-parallel push, the claim is on one
        pulling rank's part: at once while every pushing rank is under way (groups.py: `stream_through`, or
        `cut_as_pushed`), else once every pushing rank has committed."""
        h = self.h
        contract = h.contract(model)
        check_id(model, handoff_id)
        if not shard.whole:
            ShardContract.of(contract, shard, pushing=False)  # a shard that cannot be cut is refused before any wait
        key = (model, handoff_id)
        started = h.clock()
        work: list[CutWork] = []  # cut work a look began, done outside the lock before the next look (or the return)
        try:
            while True:
                while work:
                    work.pop(0)()
                with h.lock:
                    look = self._look(key, shard, supersedes, interrupt, work)
                    if isinstance(look, Claim):
                        return look
                    if not look:
                        self._wait(key, shard, started, wait, is_active)
        finally:
            for cut in work:
                cut()  # a look that began a cut and then raised: the cut still owes its ranks their tensors

    def _look(
        self, key: HandoffKey, shard: Shard, supersedes: int, interrupt: Interrupt | None, work: list[CutWork]
    ) -> Claim | bool:
        """Under the lock, one look at what the id holds: the claim, a refusal (raised), True to look again at once
        (a cut was begun: its work, if any, is in `work`), or False: nothing to claim yet."""
        h = self.h
        model, handoff_id = key
        group = h.groups.get(key)
        entry = h.entries.get(key)
        held_here = group is not None or entry is not None
        if group is None and not shard.whole and entry is not None and entry.committed:
            if entry.claimed:
                raise ShardMismatch(model, handoff_id, "pulled", 1, shard.size)
            group = self.tp.adopt(entry)
        elif group is None and not shard.whole and entry is not None and not entry.claimed:
            group = self.tp.adopt_as_pushed(entry, shard.size, work)  # a whole push under way, cut as it arrives
        if group is not None:
            if group.pull_size and group.pull_size != shard.size:
                raise ShardMismatch(model, handoff_id, "pulled", group.pull_size, shard.size)
            if group.pull_size or self.tp.stream_through(group, shard.size):
                if shard.rank in group.confirmed:  # (its part waits in the group for the other ranks)
                    raise HandoffGone(model, handoff_id, f"was already delivered to {shard} and confirmed")
                entry = group.pulled.get(shard.rank)  # None: streamed through, its pushing rank not begun
            elif group.complete and not group.cutting:
                cut = self.tp.begin_cut(group, shard.size)
                if cut is not None:
                    work.append(cut)
                    return True
                entry = None  # short of room for the cut: wait for it
            elif self.tp.cut_as_pushed(group, shard.size, work):
                return True
            else:
                entry = None  # the push, or the cut, is under way
        elif not shard.whole:
            entry = None  # a whole push under way, pulled whole meanwhile or short of room: cut at its commit
        if h.draining and not held_here:
            raise Draining()  # not here, and never will be: ask another broker
        if entry is not None and entry.hold is not None and supersedes and entry.hold.generation == supersedes:
            logger.info("claim %d on %s/%s superseded by its own retry", supersedes, model, handoff_id)
            run_interrupts_later(h.unclaim(entry))
        if entry is not None and not entry.claimed:
            return self.grant(entry, key, interrupt)
        if entry is not None:
            raise AlreadyClaimed(model, handoff_id, "" if shard.whole else str(shard))
        tomb = h.tombstones.get(key)
        if group is None and tomb is not None and tomb.how == "cancelled":
            raise HandoffCancelled(model, handoff_id)
        if group is None and tomb is not None and tomb.how == "aborted":
            why = f" ({tomb.why})" if tomb.why else ""
            raise PushAborted(model, handoff_id, f"failed before it was committed{why} and nothing of it is held; "
                                                 "it may be pushed again, or recomputed")  # fmt: skip
        if group is None and tomb is not None:
            raise HandoffGone(model, handoff_id, GONE_WORDS[tomb.how])
        return False

    def _wait(self, key: HandoffKey, shard: Shard, started: float, wait: float, is_active: Callable[[], bool]) -> None:
        """Under the lock: wait a slice for the next look, or end the claim's wait (its time is up, its caller gone,
        the store closing): CAPACITY_EXHAUSTED when a cut is what it waited for, else WAIT_TIMED_OUT."""
        h = self.h
        model, handoff_id = key
        waited = h.clock() - started
        if waited >= wait or not is_active() or self.closed.is_set():
            group = h.groups.get(key)
            if group is not None and group.complete and not group.cutting and not group.pull_size:
                extra = self.tp.cut_bytes(group, shard.size)
                raise CapacityExhausted(model, extra, h.ledger.free_bytes, h.config.max_bytes)
            raise WaitTimedOut(model, handoff_id, waited)
        h.changed.wait(min(wait - waited, WAIT_SLICE))

    def grant(self, entry: Entry, key: HandoffKey, interrupt: Interrupt | None) -> Claim:
        """Under the lock: the claim on an unclaimed entry (a whole hand-off, or one pulling rank's part)."""
        h = self.h
        model, handoff_id = key
        first_wait = h.clock() - entry.committed_at if entry.committed and not entry.last_generation else None
        h.events.claimed(model, first_wait)
        hold = entry.grant(next(h.claim_ids), interrupt, h.clock())
        h.schedule(entry)
        chunks = len(entry.ordered) if entry.committed else 0
        return Claim(
            model, handoff_id, hold.generation, entry.position, entry.contract.fingerprint, entry.nbytes, chunks, entry
        )

    def feed(self, claim: Claim, start: int, wait: float) -> tuple[list[StoredChunk], str | None]:
        """The claim's chunks from the `start`-th on, waiting up to `wait` s for more if the push is under way, and
        the hand-off's digest once every chunk has been fed and the push has committed."""
        h = self.h
        entry = claim.entry
        started = h.clock()
        with h.lock:
            while True:
                hold = self._check_claim(claim)
                source = entry.arrived if hold.live else entry.ordered
                hold.activity = h.clock()
                if start < len(source):
                    return source[start : start + FEED_BATCH], None
                if entry.committed and (entry.group is None or not entry.group.live or entry.group.complete):
                    return [], entry.digest  # (a live group's rank ends only once every rank has committed)
                waited = h.clock() - started
                if waited >= wait:
                    raise WaitTimedOut(claim.model, claim.handoff_id, waited)
                entry.changed.wait(min(wait - waited, WAIT_SLICE))

    def note_streamed(self, claim: Claim) -> None:
        """The claim's stream handed one more chunk to its reader: a steady reader, however slow, is not stalled.
        (One float stored, without the lock: the sweeper reads it under the lock and sees this moment or the one
        before.)"""
        hold = claim.entry.hold
        if hold is not None and hold.generation == claim.generation:
            hold.activity = self.h.clock()

    def _check_claim(self, claim: Claim) -> Hold:
        """Under the lock: the claim's hold, if it still holds its hand-off."""
        entry = claim.entry
        if entry.ended in ("aborted", "replaced", "abandoned"):
            raise PushAborted(claim.model, claim.handoff_id)
        if entry.ended == "cancelled":
            raise HandoffCancelled(claim.model, claim.handoff_id)
        if not entry.holds(claim.generation):
            raise StaleClaim(claim.model, claim.handoff_id, claim.generation, "was revoked: its stream stalled")
        assert entry.hold is not None
        return entry.hold

    def release(self, claim: Claim, sent_all: bool) -> None:
        """The claim's stream has ended: whole (the lease starts) or broken (the hand-off is free again at once)."""
        h = self.h
        with h.lock:
            entry = claim.entry
            if not entry.holds(claim.generation):
                return
            if sent_all:
                entry.streamed_whole(h.clock() + h.config.lease)
                h.schedule(entry)
            else:
                h.unclaim(entry)

    def confirm(self, model: str, handoff_id: str, generation: int, shard: Shard = WHOLE) -> None:
        """The decode worker has the hand-off (or its rank's part) whole: forget it. Idempotent for the same
        generation."""
        h = self.h
        h.contract(model)
        key = (model, handoff_id)
        with h.lock:
            group = h.groups.get(key)
            if group is not None and group.pull_size and group.pull_size != shard.size:
                raise ShardMismatch(model, handoff_id, "pulled", group.pull_size, shard.size)
            keys = [key]
            if (group is not None and group.pull_size) or not shard.whole:
                keys = [part_key(key, "pull", shard)]  # a rank's part cut for pulling ...
                if group is None or group.live:
                    keys.append(part_key(key, "push", shard))  # ... or, streamed through, its pushing rank's own
            entry = next((h.entries[k] for k in keys if k in h.entries), None)
            if entry is not None:
                if not entry.committed or entry.hold is None:
                    raise StaleClaim(model, handoff_id, generation, "has lapsed; the hand-off went back to the pool")
                if entry.hold.generation != generation:
                    raise StaleClaim(model, handoff_id, generation, f"is superseded by claim {entry.hold.generation}")
                run_interrupts_later(h.free(entry, "confirmed"))  # (a stream the decoder stopped reading is ended)
                if entry.group is None or entry.group.ended == "confirmed":  # a sharded one: when its last rank has
                    h.events.confirmed(model, h.clock() - entry.created)
                return
            tomb = next((h.tombstones[k] for k in keys if k in h.tombstones), None)
            if tomb is None:
                raise UnknownHandoff(model, handoff_id)
            if tomb.how == "confirmed" and tomb.generation == generation:
                return
            if tomb.how == "confirmed":
                raise StaleClaim(model, handoff_id, generation, f"is superseded by claim {tomb.generation}")
            raise HandoffGone(model, handoff_id, GONE_WORDS[tomb.how])
