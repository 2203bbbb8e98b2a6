"""The ledger: what the store holds, charged against its two bounds, in one place.

    bytes    the hand-offs' reserved bytes (a push reserves its size at its header; a cut, its copies)   <= max_bytes
    chunks   the chunks pushes have stored (each costs ~400 bytes beside its data)                     <= max_chunks

Every charge belongs to a `Reservation` (one per entry, one per tensor-parallel group); releasing a reservation
gives back exactly what it holds, once, however many paths end it. The totals are asserted never negative and
never past their bounds, after every change: an accounting slip fails loudly where it happens instead of leaking
room or letting memory past `--max-bytes`. Used under the store's lock (it has none of its own).

One half of the principle the broker is built on (the other: admission.py, for threads and the lanes' openings):
every resource a call can make the broker hold is charged, at the edge, to its call's admission slot or to a ledger
reservation here, and released exactly once however the call ends (docs/lanes.md lists each, charged where,
released where).
"""

from __future__ import annotations


class Ledger:
    """Totals of bytes and chunks held, and their bounds."""

    def __init__(self, max_bytes: int, max_chunks: int) -> None:
        self.max_bytes = max_bytes
        self.max_chunks = max_chunks
        self.bytes = 0
        self.chunks = 0

    @property
    def free_bytes(self) -> int:
        return self.max_bytes - self.bytes

    def fits(self, nbytes: int) -> bool:
        return self.bytes + nbytes <= self.max_bytes

    def reservation(self) -> Reservation:
        """An empty reservation, charged through `charge` and `take_chunk`."""
        return Reservation(self)

    def _change(self, nbytes: int, chunks: int) -> None:
        self.bytes += nbytes
        self.chunks += chunks
        assert 0 <= self.bytes <= self.max_bytes, f"ledger: {self.bytes} bytes held of {self.max_bytes}"
        assert 0 <= self.chunks <= self.max_chunks, f"ledger: {self.chunks} chunks held of {self.max_chunks}"


class Reservation:
    """What one entry (or group) holds of the ledger; `release` is idempotent."""

    __slots__ = ("_ledger", "bytes", "chunks")

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self.bytes = 0
        self.chunks = 0

    def charge(self, nbytes: int) -> None:
        """Hold `nbytes` more; the caller has checked they fit (`Ledger.fits`)."""
        self._ledger._change(nbytes, 0)
        self.bytes += nbytes

    def take_chunk(self) -> bool:
        """Hold one more stored chunk, if the ledger has room for it."""
        if self._ledger.chunks >= self._ledger.max_chunks:
            return False
        self._ledger._change(0, 1)
        self.chunks += 1
        return True

    def release(self) -> None:
        """Give back everything held (nothing, the second time)."""
        nbytes, chunks, self.bytes, self.chunks = self.bytes, self.chunks, 0, 0
        self._ledger._change(-nbytes, -chunks)
