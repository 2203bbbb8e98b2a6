"""Audit reads: a committed hand-off streamed to an auditor without a claim, so that its decoder's claim, pull and
confirm go on as if the read had not happened (PullRequest.audit in the .proto; docs/engines.md, "Audit").

What is decided here:
- Only what has passed every check is read: a committed entry (READY, or CLAIMED by its decoder), its chunks in
  contract order with the digest the push was committed under. A read made while the push is under way waits (up to
  its wait) for the commit; one of a hand-off gone says why, as a pull would.
- It takes nothing: no claim, no hold, no reservation, no byte copied. The chunks it sends are the entry's own; when
  the hand-off leaves the store (its decoder confirmed it, it was cancelled or expired) the read ends at its next
  batch (HANDOFF_GONE, HANDOFF_CANCELLED), so past the store's bounds it keeps at most one batch of chunks alive, as
  a pull's stream does.
- A tensor-parallel hand-off is read as it is held, rank by rank: `shard` names one part at the TP size its parts
  have (the pushing ranks' until a decoder pulls, then the pulling ranks'); any other shard, or a whole read of a
  sharded hand-off, is refused SHARD_MISMATCH naming the size held, so the auditor reads each part and joins them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from handoff_client.protocol.errors import HandoffCancelled, HandoffGone, ShardMismatch, WaitTimedOut
from handoff_client.protocol.shards import WHOLE, Shard

from .entries import FEED_BATCH, WAIT_SLICE, Claim, Entry, StoredChunk
from .holdings import GONE_WORDS, Holdings, check_id

AUDIT = 0
"""The claim generation of an audit read: no claim (real ones are never 0), nothing to confirm."""


def held_at(model: str, handoff_id: str, side: str, size: int, got: int) -> ShardMismatch:
    """SHARD_MISMATCH naming the TP size the parts are held at (`have`) and whether as pushed (rank 0 alone holds the
    tensors not split) or as pulled (every rank holds them): `side`, for the reader's view of each part."""
    error = ShardMismatch(model, handoff_id, side, size, got)
    return ShardMismatch._rebuild(error.message, {**error.fields, "side": side})


class AuditReads:
    """Reads of committed hand-offs that claim nothing."""

    def __init__(self, holdings: Holdings, closed: threading.Event) -> None:
        self.h = holdings
        self.closed = closed

    def read(self, model: str, handoff_id: str, wait: float, is_active: Callable[[], bool] = lambda: True,
             shard: Shard = WHOLE) -> Claim:  # fmt: skip
        """The hand-off (or one part of a sharded one) once committed, waiting up to `wait` s for its commit."""
        h = self.h
        h.contract(model)
        check_id(model, handoff_id)
        started = h.clock()
        with h.lock:
            while True:
                entry = self._look(model, handoff_id, shard)
                if entry is not None:
                    chunks = len(entry.ordered)
                    fingerprint = entry.contract.fingerprint
                    return Claim(model, handoff_id, AUDIT, entry.position, fingerprint, entry.nbytes, chunks, entry)
                waited = h.clock() - started
                if waited >= wait or not is_active() or self.closed.is_set():
                    raise WaitTimedOut(model, handoff_id, waited)
                h.changed.wait(min(wait - waited, WAIT_SLICE))

    def _look(self, model: str, handoff_id: str, shard: Shard) -> Entry | None:
        """Under the lock: the committed entry to read, a refusal (raised), or None (not committed yet)."""
        h = self.h
        key = (model, handoff_id)
        group = h.groups.get(key)
        if group is not None:
            pulled = bool(group.pull_size and group.pulled)
            size = group.pull_size if pulled else group.push_size
            if shard.whole or shard.size != size:
                raise held_at(model, handoff_id, "pulled" if pulled else "pushed", size, shard.size)
            entry = (group.pulled if pulled else group.pushed).get(shard.rank)
            return entry if entry is not None and entry.committed and entry.ended is None else None
        entry = h.entries.get(key)
        if entry is not None:
            if not shard.whole:
                raise held_at(model, handoff_id, "pushed", 1, shard.size)
            return entry if entry.committed else None
        tomb = h.tombstones.get(key)
        if tomb is not None and tomb.how == "cancelled":
            raise HandoffCancelled(model, handoff_id)
        if tomb is not None and tomb.how in GONE_WORDS:
            raise HandoffGone(model, handoff_id, GONE_WORDS[tomb.how])
        return None

    def feed(self, claim: Claim, start: int) -> tuple[list[StoredChunk], str | None]:
        """The read's chunks from the `start`-th on, a batch at a time, then ([], the digest); HANDOFF_GONE or
        HANDOFF_CANCELLED once the hand-off has left the store."""
        entry = claim.entry
        with self.h.lock:
            if entry.ended == "cancelled":
                raise HandoffCancelled(claim.model, claim.handoff_id)
            if entry.ended is not None:
                words = GONE_WORDS.get(entry.ended, f"left the broker ({entry.ended})")
                raise HandoffGone(claim.model, claim.handoff_id, f"{words} while it was audited")
            if start < len(entry.ordered):
                return entry.ordered[start : start + FEED_BATCH], None
            return [], entry.digest
