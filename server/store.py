"""Where hand-offs live between their push and their pull: a state machine with bounded memory.

    push header ─► RECEIVING ──commit──► READY ──claim──► CLAIMED ──confirm──► gone (confirmed)
                     │  │                 │  ▲               │
                     │  └─claim (pipelined: chunks stream as they arrive; commit then completes the claim)
                     │ abort, idle        │  └──release──────┤ stream broke, stalled past the lease,
                     ▼                    ▼                  │ or streamed but unconfirmed past the lease
                 (nothing)           gone (expired)          ▼
                                     cancel, from any state: gone (cancelled)

What it guarantees:
- A hand-off is complete for pullers only after every chunk and the whole have passed the contract's checks
  (`commit`). A puller may claim it while it is still RECEIVING and get its chunks as they arrive, but the end of
  its stream, with the digest, comes only after the commit; if the push fails instead, the puller gets PushAborted.
  An aborted push frees its bytes at once and leaves no trace.
- One claimant at a time; each claim has a number unique for the store's life, and only the current claim can
  confirm. A claim whose stream broke returns at once; one whose stream stops moving, or that streamed whole but
  was never confirmed, returns after `lease` seconds.
- Resident bytes (reserved by a push at its header: the contract's size at the header's position, which counts
  only the rows the position filled of each tensor whose rows are positions) never exceed `max_bytes`, nor the
  chunks stored `max_chunks`: every charge is a reservation in the ledger (server/ledger.py), which asserts both.
- A READY hand-off nobody claims expires after its ttl; a push that sends nothing for `idle_timeout` is aborted.
  What is gone leaves a tombstone for `tombstone_ttl`, so late callers hear *expired*, *cancelled* or
  *confirmed* rather than *unknown*, and a push retried after its hand-off was delivered is recognised.

Tensor-parallel hand-offs (a `shard` on a push or a pull) are groups of such entries: server/groups.py.

Plain Python: no gRPC in here. Streams are reached through `interrupt` callables (the service passes each call's
cancel), always called outside the lock. Every method is thread-safe; a PushSession belongs to one stream.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from handoff_client._contract import Contract, TensorSpans
from handoff_client._errors import (
    AlreadyClaimed,
    CallCancelled,
    CapacityExhausted,
    Draining,
    FingerprintMismatch,
    HandoffCancelled,
    HandoffExists,
    HandoffGone,
    MalformedRequest,
    PushAborted,
    ShardMismatch,
    StaleClaim,
    UnknownHandoff,
    UnknownModel,
    WaitTimedOut,
)
from handoff_client._shards import WHOLE, Shard, ShardContract, view

from .entries import (
    CHUNK_FLOOR,
    FEED_BATCH,
    MAX_HANDOFF_ID,
    MAX_TOMBSTONES,
    WAIT_SLICE,
    Claim,
    Entry,
    HandoffKey,
    Interrupt,
    StoreConfig,
    StoreEvents,
    StoreStats,
    StoredChunk,
    Tombstone,
    Unobserved,
    by_tensor,
    run_interrupts,
    run_interrupts_later,
)
from .groups import Group, TensorParallelGroups, part_key
from .ledger import Ledger
from .pushes import PushSession, _NewPush, _RepeatPush

__all__ = ["Claim", "HandoffKey", "Store", "StoreConfig", "StoreEvents", "StoreStats"]

logger = logging.getLogger(__name__)


class Store(TensorParallelGroups):
    """Every hand-off the broker holds, by (model, handoff_id)."""

    def __init__(
        self,
        contracts: Mapping[str, Contract],
        config: StoreConfig,
        clock: Callable[[], float] = time.monotonic,
        events: StoreEvents | None = None,
    ) -> None:
        self.contracts = dict(contracts)
        self.config = config
        self.events: StoreEvents = events or Unobserved()
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an entry appeared, was released or freed; bytes freed
        self._entries: dict[HandoffKey, Entry] = {}
        self._groups: dict[HandoffKey, Group] = {}
        self._tombstones: OrderedDict[HandoffKey, Tombstone] = OrderedDict()
        self._ledger = Ledger(config.max_bytes, config.max_chunks)
        self._claim_ids = itertools.count(1)  # claims are numbered once for the store's life, across every id and rank
        self._pushes_begun = 0  # so the sweeper sees a hand-off that came and went between two of its rounds
        self._arrivals = itertools.count(1)  # push headers, in the order they came
        self._draining = False
        self._closed = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.on_idle: Callable[[], None] | None = None
        """Called by the sweeper once the store has held nothing for `trim_after` seconds since it last held
        something: the broker then hands back the memory it kept for the next hand-offs. Not at once on emptying,
        which under steady traffic happens between every two hand-offs and would fault every page in again."""

    # -- life of the store --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the sweeper that expires, returns lapsed leases, aborts idle pushes and forgets old tombstones."""
        self._sweeper = threading.Thread(target=self._sweep_forever, name="handoff-sweeper", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._changed.notify_all()
        if self._sweeper is not None:
            self._sweeper.join()

    def drain(self) -> None:
        """Take no new pushes, and no pulls of hand-offs not held; what is in flight, and pulls of what is held,
        go on (so a draining broker of a fleet hands over what it holds before it exits)."""
        with self._lock:
            self._draining = True
            self._changed.notify_all()

    def settled(self, timeout: float) -> bool:
        """Wait up to `timeout` s until the store is empty: pushes under way finished, hand-offs held pulled."""
        deadline = self._clock() + timeout
        with self._lock:
            while self._entries:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return False
                self._changed.wait(min(remaining, WAIT_SLICE))
            return True

    def contract(self, model: str) -> Contract:
        try:
            return self.contracts[model]
        except KeyError:
            raise UnknownModel(model, sorted(self.contracts)) from None

    def stats(self) -> StoreStats:
        with self._lock:
            entries = [e for e in self._entries.values() if e.group is None]
            groups = list(self._groups.values())
            claimed = [not g.receiving and any(e.claimed for e in g.pulled.values()) for g in groups]
            return StoreStats(
                receiving=sum(not e.committed for e in entries) + sum(g.receiving for g in groups),
                ready=sum(e.committed and not e.claimed for e in entries)
                + sum(not g.receiving and not c for g, c in zip(groups, claimed)),
                claimed=sum(e.committed and e.claimed for e in entries) + sum(claimed),
                resident_bytes=self._ledger.bytes,
                max_bytes=self.config.max_bytes,
                tombstones=len(self._tombstones),
                oldest_seconds=max((self._clock() - e.created for e in self._entries.values()), default=0.0),
                draining=self._draining,
            )

    # -- prefill side -------------------------------------------------------------------------------------------------

    def begin_push(
        self,
        model: str,
        handoff_id: str,
        position: int,
        fingerprint: str,
        *,
        wait: float,
        ttl: float = 0.0,
        no_wait: bool = False,
        interrupt: Interrupt | None = None,
        is_active: Callable[[], bool] = lambda: True,
        resumable: bool = False,
        resume: bool = False,
        shard: Shard = WHOLE,
    ) -> PushSession:
        """Open a push: the header's checks, then the hand-off's size at `position` reserved (only the rows the
        position filled of a tensor whose rows are positions: `Contract.at`), waiting up to `wait` s for room unless
        `no_wait`. With a `shard` of a TP size above 1, one rank's part: its view's size reserved.

        A push of an id already held is checked against it byte for byte instead (a blind retry); a push of an id
        still RECEIVING replaces that push (its stream is presumed dead: the retry came first) — unless that push's
        header came after this one's: an older push, woken late from its wait for room, never replaces its retry.
        A caller that is gone (`is_active`) while it waits for room takes none.
        """
        whole = self.contract(model)
        _check_id(model, handoff_id)
        if not (math.isfinite(ttl) and 0.0 <= ttl):
            raise MalformedRequest(f"ttl_seconds must be a finite number of seconds >= 0, got {ttl!r}", model)
        if fingerprint != whole.fingerprint:
            raise FingerprintMismatch(model, whole.fingerprint, fingerprint)
        filled = whole.at(position)  # (PositionOutOfRange when position >= ctx)
        contract = view(filled, shard, pushing=True)
        user_key = (model, handoff_id)
        key = user_key if shard.whole else part_key(user_key, "push", shard)
        if resume:
            return self._resume(contract, key, user_key, position, interrupt)
        deadline = self._clock() + (0.0 if no_wait else wait)
        arrival = next(self._arrivals)
        interrupts: list[Interrupt] = []
        try:
            with self._lock:
                while True:
                    group = self._groups.get(user_key)
                    if self._draining and group is None:
                        raise Draining()  # a rank joining a sharded push under way is let in: it is in flight
                    repeat = self._sharding_checks(user_key, group, shard, position)
                    if repeat is not None:
                        return _RepeatPush(self, contract, key, delivered_digest=repeat)
                    held = self._entries.get(key)
                    if held is not None and held.committed:
                        if held.position != position:
                            raise HandoffExists(
                                model, handoff_id, f"was pushed at position {held.position}, not {position}"
                            )
                        return _RepeatPush(self, contract, key, held=held)
                    tomb = self._tombstones.get(user_key)
                    if tomb is not None and tomb.how == "cancelled":
                        raise HandoffGone(model, handoff_id, "was cancelled; push it under a new id")
                    if tomb is not None and tomb.how == "confirmed":
                        if not tomb.digest:  # a tensor-parallel hand-off: its parts' digests went with it
                            raise HandoffGone(model, handoff_id, _gone_words("confirmed"))
                        if tomb.position not in (-1, position):  # the same bytes at another position differ
                            raise HandoffExists(
                                model, handoff_id, f"was delivered at position {tomb.position}, not {position}"
                            )
                        return _RepeatPush(self, contract, key, delivered_digest=tomb.digest)
                    if held is not None and group is not None and group.feeding:
                        # Its chunks are being cut for decode ranks already: the hand-off starts over, every rank.
                        logger.info("push of %s/%s replaces a rank's push being cut: every rank must push again",
                                    model, handoff_id)  # fmt: skip
                        interrupts += self._end_group(group, "aborted")
                        continue
                    if held is not None and held.arrival > arrival:
                        raise HandoffExists(model, handoff_id, "is being pushed by a newer stream, which this older one "
                                                               "does not replace")  # fmt: skip
                    if held is not None:  # a push of this id in flight: this one replaces it
                        logger.info("push of %s/%s replaces one still in flight", model, handoff_id)
                        interrupts += self._free(held, "replaced")
                        continue
                    free = self._ledger.free_bytes
                    if contract.nbytes <= free:
                        break
                    remaining = deadline - self._clock()
                    if remaining <= 0 or contract.nbytes > self.config.max_bytes:
                        raise CapacityExhausted(model, contract.nbytes, free, self.config.max_bytes)
                    if not is_active():
                        raise CallCancelled(
                            f"{model}: the push of `{handoff_id}` was abandoned while it waited for room"
                        )
                    self._changed.wait(min(remaining, WAIT_SLICE))
                ttl = self.config.ttl if ttl <= 0 else min(ttl, self.config.ttl)
                entry = Entry(key, contract, position, ttl, None, threading.Condition(self._lock))
                entry.spans = [TensorSpans(model, c) for c in contract.carried]
                entry.resumable = resumable
                session = _NewPush(self, contract, key, entry)
                entry.push = session
                entry.created = entry.push_activity = self._clock()
                entry.arrival = arrival
                entry.push_interrupt = interrupt
                entry.reservation = self._ledger.reservation()
                entry.reservation.charge(entry.nbytes)
                if not shard.whole:
                    if group is None:
                        group = self._groups[user_key] = Group(user_key, filled, position, shard.size, entry.created,
                                                               reservation=self._ledger.reservation())  # fmt: skip
                    group.pushed[shard.rank] = entry
                    entry.group, entry.rank = group, shard.rank
                self._entries[key] = entry
                self._pushes_begun += 1
                self._tombstones.pop(key, None)
                self._changed.notify_all()  # pullers waiting for this id may claim it now
                return session
        finally:
            run_interrupts(interrupts)

    def _resume(
        self, contract: Contract, key: HandoffKey, user_key: HandoffKey, position: int, interrupt: Interrupt | None
    ) -> PushSession:
        """Continue a broken resumable push (or one rank's part of one): a new session on the same entry, its bytes
        and checks so far."""
        model, handoff_id = user_key
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.committed or not entry.resumable:
                if self._draining:
                    raise Draining()  # nothing here to finish: push it whole to another broker
                raise UnknownHandoff(model, handoff_id)  # nothing to resume (gone, or done): push it whole
            # (While draining, a kept push is a push in flight: it may finish, and be pulled.)
            if entry.position != position:
                raise HandoffExists(model, handoff_id, f"was pushed at position {entry.position}, not {position}")
            stale = [entry.push_interrupt] if entry.push is not None and entry.push_interrupt else []
            # The previous stream, if the broker still thinks it alive, is dead to the pusher: it no longer owns the
            # entry.
            session = _NewPush(self, contract, key, entry, resumed=True)
            entry.push = session
            entry.push_interrupt = interrupt
            entry.suspended_until = None
            entry.push_activity = self._clock()
        run_interrupts(stale)
        logger.info("push of %s/%s resumed with %d bytes held", model, handoff_id, sum(x.received for x in entry.spans))
        return session

    def _suspend(self, session: _NewPush) -> None:
        """The push's stream broke: keep a resumable push, unseen, for the resume window; free any other at once."""
        with self._lock:
            entry = self._entries.get(session.key)
            if entry is None or entry.push is not session:
                return
            entry.push_interrupt = None  # the stream is already gone
            if not entry.resumable:
                self._free(entry, "aborted")
                return
            entry.push = None
            entry.suspended_until = self._clock() + self.config.resume_window

    def progress(
        self, model: str, handoff_id: str, shard: Shard = WHOLE
    ) -> tuple[bool, int, list[tuple[str, list[tuple[int, int]]]]]:
        """(committed, position, each tensor's name and received ranges) of a push the broker holds, whole or in
        part; with a `shard`, of that rank's part of a sharded push (ranges within the rank's own arrays)."""
        self.contract(model)
        key = (model, handoff_id) if shard.whole else part_key((model, handoff_id), "push", shard)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise UnknownHandoff(model, handoff_id)
            ranges = [(c.name, spans.ranges()) for c, spans in zip(entry.contract.carried, entry.spans)]
            return entry.committed, entry.position, ranges

    def _append(self, session: _NewPush, chunk: StoredChunk) -> None:
        with self._lock:
            entry = self._owned(session)  # first: a stream a resume replaced must not mark bytes it will not keep
            if not entry.reservation.take_chunk():
                raise CapacityExhausted(
                    entry.key[0], 1, 0, self.config.max_chunks, what=f"chunks (send chunks of {CHUNK_FLOOR}+ bytes)"
                )
            spans = entry.spans[chunk.index]
            spans.add(chunk.offset, chunk.length)
            entry.received.append((chunk.index, chunk.offset, chunk.length, chunk.crc))
            entry.push_activity = self._clock()
            group = entry.group
            if group is not None and group.feeding:  # cut as it arrives: kept by tensor, for the cut
                entry.by_tensor[chunk.index].append(chunk)
                ready = self._ready_to_cut(group) if spans.complete else []
            else:
                entry.arrived.append(chunk)
                ready = []
                if entry.claimed:
                    entry.changed.notify_all()
        if ready:
            self._cut_tensors(group, ready)

    def _commit(self, session: _NewPush, digest: str) -> None:
        with self._lock:
            entry = self._owned(session)
            group = entry.group
            if group is None or not group.feeding:  # (a part being cut as it arrives keeps its chunks by tensor)
                entry.ordered = sorted(entry.arrived, key=lambda c: (c.index, c.offset))
                entry.by_tensor = by_tensor(entry.ordered, len(entry.contract.carried))
                entry.starts = [[c.offset for c in run] for run in entry.by_tensor]
            entry.digest = digest
            entry.committed = True
            entry.committed_at = self._clock()
            entry.push = None
            entry.push_interrupt = None
            entry.expires_at = self._clock() + entry.ttl
            entry.changed.notify_all()
            self._changed.notify_all()
            ready = []
            if group is not None:
                group.push_digests[entry.rank] = digest
                if group.complete:  # visible now: every rank's ttl runs from here, not from its own commit
                    for part in group.pushed.values():
                        part.expires_at = entry.expires_at
                ready = self._whole_at_last(group)
        if ready:
            self._cut_tensors(group, ready)

    def _abort(self, session: _NewPush) -> None:
        with self._lock:
            entry = self._entries.get(session.key)
            if entry is not None and entry.push is session:
                entry.push_interrupt = None  # the push's own handler is failing it: its call ends with its own status
                self._free(entry, "aborted")

    def _owned(self, session: _NewPush) -> Entry:
        """Under the lock: the session's entry, if it is still its own (not cancelled, not replaced by a retry)."""
        entry = self._entries.get(session.key)
        if entry is None or entry.push is not session:
            model, handoff_id = session.key
            mine = session.entry
            if mine.group is not None:
                model, handoff_id = mine.group.key
                if mine.ended == "abandoned":
                    raise PushAborted(model, handoff_id, "was abandoned: another rank's push of it failed or lapsed; "
                                                         "push every rank again")  # fmt: skip
            tomb = self._tombstones.get((model, handoff_id))
            if tomb is not None and tomb.how == "cancelled":
                raise HandoffCancelled(model, handoff_id)
            raise HandoffExists(model, handoff_id, "was pushed again by a newer stream, which replaces this one")
        return entry

    # -- decode side --------------------------------------------------------------------------------------------------

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
        pulling rank's part: at once while every pushing rank is under way (groups.py: `_stream_through`, or
        `_cut_as_pushed`), else once every pushing rank has committed."""
        contract = self.contract(model)
        _check_id(model, handoff_id)
        if not shard.whole:
            ShardContract.of(contract, shard, pushing=False)  # a shard that cannot be cut is refused before any wait
        key = (model, handoff_id)
        started = self._clock()
        with self._lock:
            while True:
                group = self._groups.get(key)
                entry = self._entries.get(key)
                held_here = group is not None or entry is not None
                if group is None and not shard.whole and entry is not None and entry.committed:
                    if entry.claimed:
                        raise ShardMismatch(model, handoff_id, "pulled", 1, shard.size)
                    group = self._adopt(entry)
                elif group is None and not shard.whole and entry is not None and not entry.claimed:
                    group = self._adopt_as_pushed(entry, shard.size)  # a whole push under way, cut as it arrives
                short_of_room = False
                if group is not None:
                    if group.pull_size and group.pull_size != shard.size:
                        raise ShardMismatch(model, handoff_id, "pulled", group.pull_size, shard.size)
                    if group.pull_size or self._stream_through(group, shard.size):
                        if shard.rank in group.confirmed:  # (its part waits in the group for the other ranks)
                            raise HandoffGone(model, handoff_id, f"was already delivered to {shard} and confirmed")
                        entry = group.pulled.get(shard.rank)  # None: streamed through, its pushing rank not begun
                    elif group.complete and not group.cutting:
                        if self._cut(group, shard.size):
                            continue
                        short_of_room = True
                        entry = None
                    elif self._cut_as_pushed(group, shard.size):
                        continue
                    else:
                        entry = None  # the push, or the cut, is under way
                elif not shard.whole:
                    entry = None  # a whole push under way, pulled whole meanwhile or short of room: cut at its commit
                if self._draining and not held_here:
                    raise Draining()  # not here, and never will be: ask another broker
                if entry is not None and entry.claimed and supersedes and entry.generation == supersedes:
                    logger.info("claim %d on %s/%s superseded by its own retry", supersedes, model, handoff_id)
                    run_interrupts_later(self._unclaim(entry))
                if entry is not None and not entry.claimed:
                    return self._grant(entry, key, interrupt)
                if entry is not None:
                    raise AlreadyClaimed(model, handoff_id, "" if shard.whole else str(shard))
                tomb = self._tombstones.get(key)
                if group is None and tomb is not None and tomb.how == "cancelled":
                    raise HandoffCancelled(model, handoff_id)
                if group is None and tomb is not None:
                    raise HandoffGone(model, handoff_id, _gone_words(tomb.how))
                waited = self._clock() - started
                if waited >= wait or not is_active() or self._closed.is_set():
                    if short_of_room and group is not None:
                        extra = self._cut_bytes(group, shard.size)
                        free = self._ledger.free_bytes
                        raise CapacityExhausted(model, extra, free, self.config.max_bytes)
                    raise WaitTimedOut(model, handoff_id, waited)
                self._changed.wait(min(wait - waited, WAIT_SLICE))

    def _grant(self, entry: Entry, key: HandoffKey, interrupt: Interrupt | None) -> Claim:
        """Under the lock: the claim on an unclaimed entry (a whole hand-off, or one pulling rank's part)."""
        model, handoff_id = key
        first_wait = self._clock() - entry.committed_at if entry.committed and not entry.generation else None
        self.events.claimed(model, first_wait)
        entry.generation = next(self._claim_ids)  # unique for the store's life: a zombie's confirm cannot match
        entry.claimed = entry.streaming = True
        entry.live = not entry.committed
        entry.pull_activity = self._clock()
        entry.pull_interrupt = interrupt
        chunks = len(entry.ordered) if entry.committed else 0
        return Claim(
            model, handoff_id, entry.generation, entry.position, entry.contract.fingerprint, entry.nbytes, chunks, entry
        )

    def feed(self, claim: Claim, start: int, wait: float) -> tuple[list[StoredChunk], str | None]:
        """The claim's chunks from the `start`-th on, waiting up to `wait` s for more if the push is under way, and
        the hand-off's digest once every chunk has been fed and the push has committed."""
        entry = claim.entry
        started = self._clock()
        with self._lock:
            while True:
                self._check_claim(claim)
                source = entry.arrived if entry.live else entry.ordered
                entry.pull_activity = self._clock()
                if start < len(source):
                    return source[start : start + FEED_BATCH], None
                if entry.committed and (entry.group is None or not entry.group.live or entry.group.complete):
                    return [], entry.digest  # (a live group's rank ends only once every rank has committed)
                waited = self._clock() - started
                if waited >= wait:
                    raise WaitTimedOut(claim.model, claim.handoff_id, waited)
                entry.changed.wait(min(wait - waited, WAIT_SLICE))

    def note_streamed(self, claim: Claim) -> None:
        """The claim's stream handed one more chunk to its reader: a steady reader, however slow, is not stalled.
        (One float stored, without the lock: the sweeper reads it under the lock and sees this moment or the one
        before.)"""
        claim.entry.pull_activity = self._clock()

    def _check_claim(self, claim: Claim) -> None:
        """Under the lock: the claim still holds its hand-off."""
        entry = claim.entry
        if entry.ended in ("aborted", "replaced", "abandoned"):
            raise PushAborted(claim.model, claim.handoff_id)
        if entry.ended == "cancelled":
            raise HandoffCancelled(claim.model, claim.handoff_id)
        if entry.ended is not None or not entry.claimed or entry.generation != claim.generation:
            raise StaleClaim(claim.model, claim.handoff_id, claim.generation, "was revoked: its stream stalled")

    def release(self, claim: Claim, sent_all: bool) -> None:
        """The claim's stream has ended: whole (the lease starts) or broken (the hand-off is free again at once)."""
        with self._lock:
            entry = claim.entry
            if entry.ended is not None or not entry.claimed or entry.generation != claim.generation:
                return
            entry.streaming = False
            entry.pull_interrupt = None
            if sent_all:
                entry.lease_until = self._clock() + self.config.lease
            else:
                self._unclaim(entry)

    def confirm(self, model: str, handoff_id: str, generation: int, shard: Shard = WHOLE) -> None:
        """The decode worker has the hand-off (or its rank's part) whole: forget it. Idempotent for the same
        generation."""
        self.contract(model)
        key = (model, handoff_id)
        with self._lock:
            group = self._groups.get(key)
            if group is not None and group.pull_size and group.pull_size != shard.size:
                raise ShardMismatch(model, handoff_id, "pulled", group.pull_size, shard.size)
            keys = [key]
            if (group is not None and group.pull_size) or not shard.whole:
                keys = [part_key(key, "pull", shard)]  # a rank's part cut for pulling ...
                if group is None or group.live:
                    keys.append(part_key(key, "push", shard))  # ... or, streamed through, its pushing rank's own
            entry = next((self._entries[k] for k in keys if k in self._entries), None)
            if entry is not None:
                if not entry.committed or not entry.claimed:
                    raise StaleClaim(model, handoff_id, generation, "has lapsed; the hand-off went back to the pool")
                if entry.generation != generation:
                    raise StaleClaim(model, handoff_id, generation, f"is superseded by claim {entry.generation}")
                run_interrupts_later(self._free(entry, "confirmed"))  # (a stream the decoder stopped reading is ended)
                if entry.group is None or entry.group.ended == "confirmed":  # a sharded one: when its last rank has
                    self.events.confirmed(model, self._clock() - entry.created)
                return
            tomb = next((self._tombstones[k] for k in keys if k in self._tombstones), None)
            if tomb is None:
                raise UnknownHandoff(model, handoff_id)
            if tomb.how == "confirmed" and tomb.generation == generation:
                return
            if tomb.how == "confirmed":
                raise StaleClaim(model, handoff_id, generation, f"is superseded by claim {tomb.generation}")
            raise HandoffGone(model, handoff_id, _gone_words(tomb.how))

    def cancel(self, model: str, handoff_id: str) -> bool:
        """Free the hand-off in whatever phase it is; its pusher and puller in flight are interrupted."""
        self.contract(model)
        _check_id(model, handoff_id)
        key = (model, handoff_id)
        with self._lock:
            entry, group = self._entries.get(key), self._groups.get(key)
            if entry is None and group is None:
                if key not in self._tombstones:
                    self._bury(key, "cancelled", 0, "")  # a push that comes later is refused too
                return False
            interrupts = self._end_group(group, "cancelled") if group is not None else []
            if entry is not None and self._entries.get(key) is entry:
                interrupts += self._free(entry, "cancelled")
            self.events.cancelled(model)
        run_interrupts(interrupts)
        return True

    # -- housekeeping -------------------------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Expire unclaimed hand-offs, return lapsed claims, abort idle pushes, forget old tombstones."""
        now = self._clock()
        interrupts: list[Interrupt] = []
        with self._lock:
            for entry in list(self._entries.values()):
                if self._entries.get(entry.key) is not entry:
                    continue  # freed with its group earlier in this sweep
                model, handoff_id = entry.group.key if entry.group is not None else entry.key
                pushing = not entry.committed and not entry.cut_part  # (a part being cut times out with its push)
                if pushing and entry.push is None and now >= (entry.suspended_until or now):
                    logger.info("broken push of %s/%s not resumed in time: freed", model, handoff_id)
                    interrupts += self._free(entry, "aborted")
                elif pushing and now - entry.created >= self.config.push_deadline:
                    logger.info("push of %s/%s still unfinished after %ss: aborted", model, handoff_id,
                                self.config.push_deadline)  # fmt: skip
                    interrupts += self._free(entry, "aborted")
                elif pushing and now - entry.push_activity >= self.config.idle_timeout:
                    logger.info(
                        "push of %s/%s sent nothing for %ss: aborted", model, handoff_id, self.config.idle_timeout
                    )
                    interrupts += self._free(entry, "aborted")
                elif entry.claimed and entry.streaming and now - entry.pull_activity >= self.config.lease:
                    logger.info("claim %d on %s/%s stalled: revoked", entry.generation, model, handoff_id)
                    interrupts += self._unclaim(entry)
                elif entry.claimed and not entry.streaming and now >= entry.lease_until:
                    logger.info("claim %d on %s/%s lapsed unconfirmed", entry.generation, model, handoff_id)
                    interrupts += self._unclaim(entry)
                elif entry.committed and not entry.claimed and now >= entry.expires_at and _may_expire(entry):
                    logger.info("hand-off %s/%s expired unclaimed (%d bytes freed)", model, handoff_id, entry.nbytes)
                    interrupts += self._free(entry, "expired")
                    self.events.expired(model)
            while self._tombstones:
                key, tomb = next(iter(self._tombstones.items()))
                if tomb.until > now and len(self._tombstones) <= MAX_TOMBSTONES:
                    break
                del self._tombstones[key]
        run_interrupts(interrupts)

    def _sweep_forever(self) -> None:
        empty_since: float | None = None  # when the store was last seen holding nothing, with no push since
        idle_done = True  # nothing held since start (or since the last on_idle): nothing to hand back
        pushes_seen = 0
        while not self._closed.wait(self.config.sweep_interval):
            try:
                self.sweep()
                if self._entries or self._pushes_begun != pushes_seen:
                    pushes_seen = self._pushes_begun
                    empty_since, idle_done = None, False
                elif not idle_done:
                    now = self._clock()
                    empty_since = now if empty_since is None else empty_since
                    if now - empty_since >= self.config.trim_after:
                        idle_done = True
                        if self.on_idle is not None:
                            self.on_idle()
            except Exception:  # a sweeper that dies would let memory grow unbounded: log and go on
                logger.exception("sweep failed")

    # -- under the lock -----------------------------------------------------------------------------------------------

    def _unclaim(self, entry: Entry) -> list[Interrupt]:
        """The claim ends without a confirm: the hand-off is free for the next puller."""
        interrupts = [entry.pull_interrupt] if entry.streaming and entry.pull_interrupt else []
        self.events.lease_returned(entry.key[0])
        entry.claimed = entry.streaming = entry.live = False
        entry.pull_interrupt = None
        if entry.committed:
            entry.expires_at = self._clock() + entry.ttl
        entry.changed.notify_all()
        self._changed.notify_all()
        return interrupts

    def _free(self, entry: Entry, how: str) -> list[Interrupt]:
        """The entry leaves the store; the streams still on it are returned for interrupting."""
        del self._entries[entry.key]
        if entry.reservation is not None:
            entry.reservation.release()
        entry.ended = how
        if how in ("expired", "cancelled", "confirmed"):
            self._bury(entry.key, how, entry.generation, entry.digest, entry.position)
        # A pusher still sending is cut off; a pipelined puller waiting in `feed` hears why from there, so only a
        # cancel, or a confirm made before the stream's end was read, also interrupts the puller (which may be
        # blocked on flow control, out of feed's reach, holding a thread and the chunks it was sending).
        interrupts = (
            [entry.push_interrupt] if entry.push_interrupt and how in ("aborted", "replaced", "cancelled") else []
        )
        if how in ("cancelled", "confirmed") and entry.streaming and entry.pull_interrupt:
            interrupts.append(entry.pull_interrupt)
        entry.push_interrupt = entry.pull_interrupt = None
        entry.arrived, entry.ordered, entry.by_tensor = [], [], []
        entry.changed.notify_all()
        self._changed.notify_all()
        group = entry.group
        if group is not None and group.ended is None:
            if how in ("aborted", "expired", "cancelled"):
                interrupts += self._end_group(group, how)
            elif how == "confirmed" and group.pulled.get(entry.rank) is entry:
                group.confirmed.add(entry.rank)
                if len(group.confirmed) == group.pull_size:
                    interrupts += self._end_group(group, "confirmed", entry.generation)
        return interrupts

    def _bury(self, key: HandoffKey, how: str, generation: int, digest: str, position: int = -1) -> None:
        self._tombstones.pop(key, None)
        until = self._clock() + self.config.tombstone_ttl
        self._tombstones[key] = Tombstone(how, generation, digest, until, position)


def _may_expire(entry: Entry) -> bool:
    """Whether an unclaimed entry's ttl runs: a rank's part waits while every rank of its push has begun and one
    is still pushing (that push's idle timeout and deadline bound the wait); its ttl runs again from the last
    commit (`_commit`), and meanwhile if a rank never began at all."""
    group = entry.group
    return group is None or group.complete or len(group.pushed) < group.push_size


def _gone_words(how: str) -> str:
    return {
        "expired": "expired before any decode worker claimed it",
        "cancelled": "was cancelled",
        "confirmed": "was already delivered to a decode worker and confirmed",
    }[how]


def _check_id(model: str, handoff_id: str) -> None:
    if not handoff_id or len(handoff_id) > MAX_HANDOFF_ID or not handoff_id.isprintable():
        raise MalformedRequest(
            f"a handoff_id must be 1..{MAX_HANDOFF_ID} printable characters, got {handoff_id[:64]!r}", model
        )
