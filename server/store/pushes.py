"""A push's checks as its chunks arrive, and what it becomes: a new hand-off, or a repeat of one already held.

Every chunk is checked on arrival — its tensor is carried, it lies within the tensor, it overlaps nothing received,
its CRC32C holds — and at the end every tensor must be whole. A push of a new id keeps its chunks (the store feeds
them to a pipelined puller at once) and commits them as the hand-off; a push of an id the broker holds, or has
delivered, must repeat it exactly and then changes nothing. A session belongs to one stream; the store owns the rest.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from handoff_client.protocol.contract import Contract
from handoff_client.protocol.errors import BadChunk, HandoffExists, MissingTensor
from handoff_client.protocol.frames import ChunkFrame, crc32c, handoff_digest
from handoff_client.protocol.spans import TensorSpans

from .entries import StoredChunk

if TYPE_CHECKING:
    from .entries import Entry, HandoffKey


class SessionOwner(Protocol):
    """What a push session reports to: the store's intake (which records each chunk, the commit or the end under the
    store's lock)."""

    def append(self, session: _NewPush, chunk: StoredChunk) -> None: ...
    def suspend(self, session: _NewPush) -> None: ...
    def commit(self, session: _NewPush, digest: str) -> None: ...
    def abort(self, session: _NewPush) -> None: ...


@dataclass(frozen=True)
class PushOutcome:
    bytes: int
    chunks: int
    digest: str
    duplicate: bool


class PushSession:
    """One push stream's checks, chunk by chunk: name, bounds, overlap, checksum; then the whole at `finish`."""

    def __init__(
        self,
        store: SessionOwner,
        contract: Contract,
        key: HandoffKey,
        spans: list[TensorSpans] | None = None,
        received: list[tuple[int, int, int, int]] | None = None,
        held_before: frozenset[tuple[int, int, int, int]] = frozenset(),
    ) -> None:
        self.store = store
        self.contract = contract
        self.key = key
        self._spans = spans if spans is not None else [TensorSpans(contract.model, c) for c in contract.carried]
        self._received = received if received is not None else []
        self._held_before = held_before

    def check_frame(self, index: int, offset: int, length: int) -> None:
        """Whether a lane frame of tensor `index` (`contract.carried`) could be added now: within its tensor, over no
        byte already received (BadChunk naming the tensor and its size if not). A lane's receiver asks before it
        allocates the frame's buffer, so a header can never make the broker allocate past what the call reserved."""
        self._spans[index].check(offset, length)

    def add(self, chunk: ChunkFrame) -> None:
        index = self.contract.index(chunk.tensor)
        length = len(chunk.data)
        if (index, chunk.offset, length, chunk.crc32c) in self._held_before:
            # A resume re-sent a chunk its broken stream delivered after the pusher asked what was held: that copy
            # is held and was checked; this one is not kept.
            return
        self._spans[index].check(chunk.offset, length)  # bounds and overlap before the checksum is paid for
        if crc32c(chunk.data) != chunk.crc32c:
            raise BadChunk(self.contract.model, chunk.tensor, chunk.offset, length, "fails its CRC32C on arrival")
        self._record(StoredChunk(index, chunk.offset, length, chunk.crc32c, chunk.frame, chunk.data))

    def _record(self, chunk: StoredChunk) -> None:
        """The chunk counts as received (a repeat's own bookkeeping; a new push records under the store's lock)."""
        self._spans[chunk.index].add(chunk.offset, chunk.length)
        self._received.append((chunk.index, chunk.offset, chunk.length, chunk.crc))
        self._keep(chunk)

    @property
    def complete(self) -> bool:
        return all(spans.complete for spans in self._spans)

    def finish(self) -> PushOutcome:
        """The stream closed cleanly: every tensor whole, then the hand-off committed (or matched)."""
        if missing := [spans.carried.name for spans in self._spans if not spans.complete and not spans.received]:
            raise MissingTensor(self.contract.model, *missing)  # every one named, not only the first
        for spans in self._spans:
            spans.check_complete()
        return self._finish(handoff_digest(self._received))

    def abort(self) -> None:
        """The push was refused: keep nothing."""

    def suspend(self) -> None:
        """The push's stream broke: keep nothing, unless the push is resumable."""
        self.abort()

    def _keep(self, chunk: StoredChunk) -> None:
        raise NotImplementedError

    def _finish(self, digest: str) -> PushOutcome:
        raise NotImplementedError


class _NewPush(PushSession):
    """A push of an id the broker does not hold: its chunks are kept (and fed to a pipelined puller at once), and
    become a complete hand-off at `finish`."""

    def __init__(
        self, store: SessionOwner, contract: Contract, key: HandoffKey, entry: Entry, resumed: bool = False
    ) -> None:
        # The checks so far live on the entry, so a resumed push's session continues them (made under the store's
        # lock, so what the broken stream delivered is all in `entry.received`).
        held = frozenset(entry.received) if resumed else frozenset()
        super().__init__(store, contract, key, entry.spans, entry.received, held)
        self.entry = entry

    def _record(self, chunk: StoredChunk) -> None:
        self.store.append(self, chunk)

    def suspend(self) -> None:
        self.store.suspend(self)

    def _finish(self, digest: str) -> PushOutcome:
        self.store.commit(self, digest)
        return PushOutcome(self.contract.nbytes, len(self._received), digest, duplicate=False)

    def abort(self) -> None:
        self.store.abort(self)


class _RepeatPush(PushSession):
    """A push of an id already held or already delivered: a retry must repeat it exactly, and then changes nothing.

    Against a held hand-off every byte is compared; against a delivered one (its bytes are gone) the digest is.
    """

    def __init__(
        self,
        store: SessionOwner,
        contract: Contract,
        key: HandoffKey,
        held: Entry | None = None,
        delivered_digest: str = "",
    ) -> None:
        super().__init__(store, contract, key)
        # Taken now: if the held hand-off is confirmed meanwhile, these lists stay whole for the comparison.
        self._starts = held.starts if held is not None else None
        self._stored = held.by_tensor if held is not None else None
        self._want = held.digest if held is not None else delivered_digest
        # The response describes the hand-off held, as its digest does: the original push's chunks, however this
        # repeat cut them (a delivered one's digest matched only if its chunks did).
        self._chunks = sum(len(run) for run in held.by_tensor) if held is not None else None

    def _keep(self, chunk: StoredChunk) -> None:
        if self._stored is None or self._starts is None:
            return
        starts, stored = self._starts[chunk.index], self._stored[chunk.index]
        offset, data = chunk.offset, chunk.data
        at = max(bisect.bisect_right(starts, offset) - 1, 0)
        end = offset + len(data)
        while at < len(stored) and stored[at].offset < end:
            held = stored[at]
            lo, hi = max(offset, held.offset), min(end, held.offset + held.length)
            if lo < hi and data[lo - offset : hi - offset] != held.data[lo - held.offset : hi - held.offset]:
                model, handoff_id = self.key
                name = self.contract.carried[chunk.index].name
                raise HandoffExists(model, handoff_id, f"differs in `{name}` within bytes {lo}..{hi}")
            at += 1

    def _finish(self, digest: str) -> PushOutcome:
        if self._stored is None and digest != self._want:
            model, handoff_id = self.key
            raise HandoffExists(model, handoff_id, "was delivered with different content (or chunking)")
        chunks = self._chunks if self._chunks is not None else len(self._received)
        return PushOutcome(self.contract.nbytes, chunks, self._want, duplicate=True)
