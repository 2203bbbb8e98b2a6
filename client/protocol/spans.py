"""What of each tensor has arrived: a push's bytes at the broker, a pull's at the client, checked chunk by chunk
against the contract's sizes with the same errors the whole-array checks raise (`contract.check_array`)."""

from __future__ import annotations

import bisect

from .contract import Carried
from .errors import BadChunk, MissingTensor, WrongLength


class TensorSpans:
    """The byte ranges of one tensor received so far, kept disjoint, so a hand-off is complete exactly when every
    tensor's ranges add up to its size. Used by the broker on a push and by the client on a pull."""

    __slots__ = ("carried", "model", "received", "_starts", "_ends")

    def __init__(self, model: str, carried: Carried) -> None:
        self.model = model
        self.carried = carried
        self.received = 0
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, offset: int, length: int) -> None:
        """Record bytes [offset, offset + length); BadChunk if they are empty, past the end, or already received."""
        at = self.check(offset, length)
        self._starts.insert(at, offset)
        self._ends.insert(at, offset + length)
        self.received += length

    def check(self, offset: int, length: int) -> int:
        """Whether bytes [offset, offset + length) could be added now (BadChunk if not); where they would go."""
        name, size = self.carried.name, self.carried.nbytes
        if length == 0:
            raise BadChunk(self.model, name, offset, length, "is empty")
        if offset + length > size:
            raise BadChunk(
                self.model, name, offset, length, f"runs past the tensor's {size} bytes ({self.carried.layout()})"
            )
        at = bisect.bisect_right(self._starts, offset)
        if (at > 0 and self._ends[at - 1] > offset) or (at < len(self._starts) and self._starts[at] < offset + length):
            raise BadChunk(self.model, name, offset, length, "overlaps bytes already received")
        return at

    @property
    def complete(self) -> bool:
        return self.received == self.carried.nbytes

    def ranges(self) -> list[tuple[int, int]]:
        """The received bytes as (offset, length), in order, adjacent ranges merged."""
        merged: list[tuple[int, int]] = []
        for start, end in zip(self._starts, self._ends):
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end - merged[-1][0])
            else:
                merged.append((start, end - start))
        return merged

    def check_complete(self) -> None:
        """At the end of a stream: the tensor came whole (MissingTensor if not at all, WrongLength if in part)."""
        if self.complete:
            return  # (a position-indexed tensor at position 0 is complete with no bytes at all)
        if self.received == 0:
            raise MissingTensor(self.model, self.carried.name)
        c = self.carried
        raise WrongLength(self.model, c.name, c.values, self.received, c.dtype, c.numpy_dtype.itemsize, c.filled_note())
