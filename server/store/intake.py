"""The prefill side of the store: a push's header admitted (or met as a repeat, or refused), its chunks recorded,
its commit, its break (suspended when resumable) and its resume.

What is decided here: an id held or delivered is pushed again only as a byte-identical repeat; an id still being
pushed is replaced by the newer push (its stream is presumed dead), never by an older one woken late; a push
reserves its whole size at its header, waiting for room only while its caller is there; a broken resumable push
is kept unseen for the resume window. Runs on the store's holdings (server/store/holdings.py), under its lock.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable

from handoff_client.protocol.contract import Contract
from handoff_client.protocol.errors import (
    CallCancelled,
    CapacityExhausted,
    Draining,
    FingerprintMismatch,
    HandoffCancelled,
    HandoffError,
    HandoffExists,
    HandoffGone,
    MalformedRequest,
    PushAborted,
    UnknownHandoff,
)
from handoff_client.protocol.shards import WHOLE, Shard, view
from handoff_client.protocol.spans import TensorSpans

from .entries import CHUNK_FLOOR, WAIT_SLICE, Entry, HandoffKey, Interrupt, StoredChunk, by_tensor, run_interrupts
from .groups import Group, TensorParallel, part_key
from .holdings import GONE_WORDS, Holdings, check_id
from .pushes import PushSession, _NewPush, _RepeatPush

logger = logging.getLogger("handoff_broker.store")


class Intake:
    """Pushes into the store; the `SessionOwner` its push sessions report each chunk, commit and end to."""

    def __init__(self, holdings: Holdings, tp: TensorParallel) -> None:
        self.h = holdings
        self.tp = tp
        self.arrivals = itertools.count(1)  # push headers, in the order they came
        self.begun = 0  # pushes begun, so the sweeper sees a hand-off that came and went between two of its rounds

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
        h = self.h
        whole = h.contract(model)
        check_id(model, handoff_id)
        user_key = (model, handoff_id)
        try:
            if not (math.isfinite(ttl) and 0.0 <= ttl):
                raise MalformedRequest(f"ttl_seconds must be a finite number of seconds >= 0, got {ttl!r}", model)
            if fingerprint != whole.fingerprint:
                raise FingerprintMismatch(model, whole.fingerprint, fingerprint)
            filled = whole.at(position)  # (PositionOutOfRange when position >= ctx)
            contract = view(filled, shard, pushing=True)
        except HandoffError as refused:
            if shard.whole and not resume:
                with h.lock:
                    self._refused(user_key, position, refused)
            raise
        key = user_key if shard.whole else part_key(user_key, "push", shard)
        if resume:
            return self.resume(contract, key, user_key, position, interrupt)
        deadline = h.clock() + (0.0 if no_wait else wait)
        arrival = next(self.arrivals)
        interrupts: list[Interrupt] = []
        try:
            with h.lock:
                while True:
                    group = h.groups.get(user_key)
                    if h.draining and group is None:
                        raise Draining()  # a rank joining a sharded push under way is let in: it is in flight
                    met = self._meet_held(contract, key, user_key, group, shard, position, arrival, interrupts)
                    if isinstance(met, PushSession):
                        return met
                    if met:
                        continue  # a push it replaces was freed: look again
                    free = h.ledger.free_bytes
                    if contract.nbytes <= free:
                        break
                    remaining = deadline - h.clock()
                    if remaining <= 0 or contract.nbytes > h.config.max_bytes:
                        refused = CapacityExhausted(model, contract.nbytes, free, h.config.max_bytes)
                        if shard.whole:
                            self._refused(user_key, position, refused)
                        raise refused
                    if not is_active():
                        raise CallCancelled(
                            f"{model}: the push of `{handoff_id}` was abandoned while it waited for room"
                        )
                    h.changed.wait(min(remaining, WAIT_SLICE))
                now = h.clock()
                entry = Entry(key, contract, position, h.config.ttl if ttl <= 0 else min(ttl, h.config.ttl),
                              threading.Condition(h.lock), spans=[TensorSpans(model, c) for c in contract.carried],
                              resumable=resumable, created=now, arrival=arrival,
                              reservation=h.ledger.reservation())  # fmt: skip
                entry.reservation.charge(entry.nbytes)
                session = _NewPush(self, contract, key, entry)
                entry.begin(session, interrupt, now)
                if not shard.whole:
                    if group is None:
                        h.tombstones.pop(user_key, None)  # (an aborted push's: a new one replaces it)
                        group = h.groups[user_key] = Group(user_key, filled, position, shard.size, now,
                                                           reservation=h.ledger.reservation())  # fmt: skip
                    group.pushed[shard.rank] = entry
                    entry.group, entry.rank = group, shard.rank
                h.add(entry)
                self.begun += 1
                return session
        finally:
            run_interrupts(interrupts)

    def _refused(self, user_key: HandoffKey, position: int, refused: HandoffError) -> None:
        """Under the lock: a whole push refused at its header, for an id nothing is held of, leaves an aborted
        tombstone, so that a puller waiting for it (the vLLM producer hands out its ticket before its push commits)
        hears PUSH_ABORTED and why at once; a later push of the id replaces it."""
        h = self.h
        if user_key not in h.tombstones and user_key not in h.entries and user_key not in h.groups:
            h.bury(user_key, "aborted", 0, "", position, f"refused {refused.reason}: {refused.message}")
            h.changed.notify_all()

    def _meet_held(
        self,
        contract: Contract,
        key: HandoffKey,
        user_key: HandoffKey,
        group: Group | None,
        shard: Shard,
        position: int,
        arrival: int,
        interrupts: list[Interrupt],
    ) -> PushSession | bool:
        """Under the lock, at a push's header: what the id already held or delivered makes of it — a repeat to check
        (its session), a refusal (raised), a push under way it replaces (freed, its stream added to `interrupts`:
        True, look again), or nothing (False: a new push)."""
        h = self.h
        model, handoff_id = user_key
        repeat = self.tp.sharding_checks(user_key, group, shard, position)
        if repeat is not None:
            return _RepeatPush(self, contract, key, delivered_digest=repeat)
        held = h.entries.get(key)
        if held is not None and held.committed:
            if held.position != position:
                raise HandoffExists(model, handoff_id, f"was pushed at position {held.position}, not {position}")
            return _RepeatPush(self, contract, key, held=held)
        tomb = h.tombstones.get(user_key)
        if tomb is not None and tomb.how == "cancelled":
            raise HandoffGone(model, handoff_id, "was cancelled; push it under a new id")
        if tomb is not None and tomb.how == "confirmed":
            if not tomb.digest:  # a tensor-parallel hand-off: its parts' digests went with it
                raise HandoffGone(model, handoff_id, GONE_WORDS["confirmed"])
            if tomb.position not in (-1, position):  # the same bytes at another position differ
                raise HandoffExists(model, handoff_id, f"was delivered at position {tomb.position}, not {position}")
            return _RepeatPush(self, contract, key, delivered_digest=tomb.digest)
        if held is None:
            return False
        if group is not None and group.feeding:
            # Its chunks are being cut for decode ranks already: the hand-off starts over, every rank.
            logger.info("push of %s/%s replaces a rank's push being cut: every rank must push again", *user_key)
            interrupts += h.end_group(group, "aborted")
            return True
        if held.arrival > arrival:
            raise HandoffExists(model, handoff_id, "is being pushed by a newer stream, which this older one does not "
                                                   "replace")  # fmt: skip
        logger.info("push of %s/%s replaces one still in flight", *user_key)
        interrupts += h.free(held, "replaced")
        return True

    def resume(
        self, contract: Contract, key: HandoffKey, user_key: HandoffKey, position: int, interrupt: Interrupt | None
    ) -> PushSession:
        """Continue a broken resumable push (or one rank's part of one): a new session on the same entry, its bytes
        and checks so far. The previous stream, if the broker still thinks it alive, is dead to the pusher: it no
        longer owns the entry, and is interrupted. (While draining, a kept push is a push in flight: it may finish.)"""
        h = self.h
        model, handoff_id = user_key
        with h.lock:
            entry = h.entries.get(key)
            if entry is None or entry.committed or not entry.resumable:
                if h.draining:
                    raise Draining()  # nothing here to finish: push it whole to another broker
                raise UnknownHandoff(model, handoff_id)  # nothing to resume (gone, or done): push it whole
            if entry.position != position:
                raise HandoffExists(model, handoff_id, f"was pushed at position {entry.position}, not {position}")
            session = _NewPush(self, contract, key, entry, resumed=True)
            stale = entry.begin(session, interrupt, h.clock())
            h.schedule(entry)
        run_interrupts(stale)
        logger.info("push of %s/%s resumed with %d bytes held", model, handoff_id, sum(x.received for x in entry.spans))
        return session

    def progress(
        self, model: str, handoff_id: str, shard: Shard = WHOLE
    ) -> tuple[bool, int, list[tuple[str, list[tuple[int, int]]]]]:
        """(committed, position, each tensor's name and received ranges) of a push the broker holds, whole or in
        part; with a `shard`, of that rank's part of a sharded push (ranges within the rank's own arrays)."""
        h = self.h
        h.contract(model)
        key = (model, handoff_id) if shard.whole else part_key((model, handoff_id), "push", shard)
        with h.lock:
            entry = h.entries.get(key)
            if entry is None:
                raise UnknownHandoff(model, handoff_id)
            ranges = [(c.name, spans.ranges()) for c, spans in zip(entry.contract.carried, entry.spans)]
            return entry.committed, entry.position, ranges

    # -- what a push session reports ----------------------------------------------------------------------------------

    def append(self, session: _NewPush, chunk: StoredChunk) -> None:
        h = self.h
        with h.lock:
            entry = self._owned(session)  # first: a stream a resume replaced must not mark bytes it will not keep
            if not entry.reservation.take_chunk():
                raise CapacityExhausted(
                    entry.key[0], 1, 0, h.config.max_chunks, what=f"chunks (send chunks of {CHUNK_FLOOR}+ bytes)"
                )
            spans = entry.spans[chunk.index]
            spans.add(chunk.offset, chunk.length)
            entry.received.append((chunk.index, chunk.offset, chunk.length, chunk.crc))
            entry.push_activity = h.clock()
            group = entry.group
            if group is not None and group.feeding:  # cut as it arrives: kept by tensor, for the cut
                entry.by_tensor[chunk.index].append(chunk)
                ready = self.tp.ready_to_cut(group) if spans.complete else []
            else:
                entry.arrived.append(chunk)
                ready = []
                if entry.claimed:
                    entry.changed.notify_all()
        if ready:
            self.tp.cut_tensors(group, ready)

    def commit(self, session: _NewPush, digest: str) -> None:
        h = self.h
        with h.lock:
            entry = self._owned(session)
            group = entry.group
            if group is None or not group.feeding:  # (a part being cut as it arrives keeps its chunks by tensor)
                entry.ordered = sorted(entry.arrived, key=lambda c: (c.index, c.offset))
                entry.by_tensor = by_tensor(entry.ordered, len(entry.contract.carried))
                entry.starts = [[c.offset for c in run] for run in entry.by_tensor]
            entry.commit(digest, h.clock())
            h.schedule(entry)
            h.changed.notify_all()
            ready = []
            if group is not None:
                group.push_digests[entry.rank] = digest
                if group.complete:  # visible now: every rank's ttl runs from here, not from its own commit
                    for part in group.pushed.values():
                        part.expires_at = entry.expires_at
                ready = self.tp.whole_at_last(group)
        if ready:
            self.tp.cut_tensors(group, ready)

    def suspend(self, session: _NewPush) -> None:
        """The push's stream broke: keep a resumable push, unseen, for the resume window; free any other at once."""
        h = self.h
        with h.lock:
            entry = h.entries.get(session.key)
            if entry is None or entry.push is not session:
                return
            entry.push_interrupt = None  # the stream is already gone
            if not entry.resumable:
                h.free(entry, "aborted")
                return
            entry.suspend(h.clock() + h.config.resume_window)
            h.schedule(entry)

    def abort(self, session: _NewPush) -> None:
        h = self.h
        with h.lock:
            entry = h.entries.get(session.key)
            if entry is not None and entry.push is session:
                entry.push_interrupt = None  # the push's own handler is failing it: its call ends with its own status
                h.free(entry, "aborted")

    def _owned(self, session: _NewPush) -> Entry:
        """Under the lock: the session's entry, if it is still its own (not cancelled, not replaced by a retry)."""
        entry = self.h.entries.get(session.key)
        if entry is None or entry.push is not session:
            model, handoff_id = session.key
            mine = session.entry
            if mine.group is not None:
                model, handoff_id = mine.group.key
                if mine.ended == "abandoned":
                    raise PushAborted(model, handoff_id, "was abandoned: another rank's push of it failed or lapsed; "
                                                         "push every rank again")  # fmt: skip
            tomb = self.h.tombstones.get((model, handoff_id))
            if tomb is not None and tomb.how == "cancelled":
                raise HandoffCancelled(model, handoff_id)
            raise HandoffExists(model, handoff_id, "was pushed again by a newer stream, which replaces this one")
        return entry
