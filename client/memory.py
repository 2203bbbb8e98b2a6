"""glibc's allocator, set for a process whose work is receiving gRPC messages of a megabyte (glibc only; elsewhere a
no-op).

grpcio hands every received message to Python as a new `bytes` object, so a stream of 1 MiB chunks is a stream of
1 MiB allocations and frees. With glibc's defaults each one is either an mmap of its own (until a large free raises
the mmap threshold) or comes from the top of a heap that is trimmed back to the system as soon as a few MiB lie free
there; either way the pages are faulted in and zeroed again for the next message. Measured on a 2-core VM
(benchmarks/bench.py): page faults were 10-15 % of the broker's CPU on a push and a third of a decoder's CPU on a
pull. A fixed mmap threshold above the chunk size and a trim threshold of tens of megabytes keep those pages mapped
and reused: the broker's CPU per GiB received fell ~15 % and a puller's ~30 %.

The cost is the freed memory each arena keeps (`keep`, TRIM_THRESHOLD unless told); `trim()` hands it back. The
broker keeps up to its --max-bytes, so the pages a confirmed hand-off leaves serve the next push instead of being
faulted in again (the largest single cost left on its receive path), and trims once it has held nothing for
--trim-after seconds. Both are process-wide settings: the broker sets them for itself; a decode or prefill worker
opts in with `handoff_client.tune_allocator()`, since a library must not change its host's allocator unasked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD = 8 << 20
"""Allocations below this come from the heap and are reused; above the largest chunk frame a worker receives (the
broker sets its own, larger: handoff_broker.app.ALLOCATOR_MMAP_THRESHOLD)."""

TRIM_THRESHOLD = 64 << 20
"""Free bytes a heap may keep at its top before glibc returns them: room for a few dozen frames in flight."""

_MALLOPT_MAX = (1 << 31) - 1  # mallopt takes an int

_libc: ctypes.CDLL | None = None
try:
    _name = ctypes.util.find_library("c")
    _candidate = ctypes.CDLL(_name) if _name else None
    if _candidate is not None and hasattr(_candidate, "mallopt") and hasattr(_candidate, "malloc_trim"):
        _libc = _candidate
except OSError:  # not glibc
    _libc = None


def tune_allocator(arenas: int | None = None, keep: int = TRIM_THRESHOLD, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Keep the pages of received messages mapped for the next ones, up to `keep` free bytes at a heap's top (at
    most 2 GiB), for every allocation under `mmap_threshold` (at most glibc's 32 MiB on 64-bit); with `arenas`, also
    cap glibc's arenas (each thread may otherwise get one, each keeping its own free pages). True where glibc took
    every setting.

    Call it early, before the threads that receive are started: an arena already made is not capped."""
    if _libc is None:
        return False
    ok = _libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok &= _libc.mallopt(_M_TRIM_THRESHOLD, max(mmap_threshold, min(keep, _MALLOPT_MAX))) == 1
    if arenas is not None:
        ok &= _libc.mallopt(_M_ARENA_MAX, arenas) == 1
    logger.debug("allocator tuned: mmap above %d, trim above %d, arenas %s (%s)",
                 mmap_threshold, keep, arenas or "glibc's", ok)  # fmt: skip
    return bool(ok)


def trim() -> None:
    """Return every arena's free pages to the system."""
    if _libc is not None:
        _libc.malloc_trim(0)
