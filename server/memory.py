"""Keep the broker's RSS close to the hand-off bytes it holds (glibc only; elsewhere these do nothing).

Chunk frames are large, short-lived `bytes` objects allocated by gRPC's threads. glibc's defaults hurt twice here:
its mmap threshold rises after the first large free, so later frames land in the heap, whose freed pages are not
returned to the system; and each of the many RPC threads may get an arena of its own, fragmenting further. Fixing
the threshold makes every frame an mmap that goes back to the system when freed; capping arenas bounds the rest;
`trim` hands back what the heap still holds once the store has emptied.
"""

from __future__ import annotations

import ctypes
import os
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 256 << 10
ARENA_MAX = 4

_libc: ctypes.CDLL | None = None
try:
    _name = ctypes.util.find_library("c")
    _candidate = ctypes.CDLL(_name) if _name else None
    if _candidate is not None and hasattr(_candidate, "mallopt") and hasattr(_candidate, "malloc_trim"):
        _libc = _candidate
except OSError:  # not glibc
    _libc = None


def tune_allocator() -> bool:
    """Fix the mmap threshold and cap the arenas; True where it took effect."""
    if _libc is None:
        return False
    ok = True
    if os.environ.get("HANDOFF_MMAP_THRESHOLD"):
        ok = _libc.mallopt(_M_MMAP_THRESHOLD, int(os.environ["HANDOFF_MMAP_THRESHOLD"])) == 1
    ok = _libc.mallopt(_M_ARENA_MAX, ARENA_MAX) == 1 and ok
    logger.debug("allocator tuned: mmap threshold %d, %d arenas (%s)", MMAP_THRESHOLD_BYTES, ARENA_MAX, ok)
    return ok


def trim() -> None:
    """Return the heap's free pages to the system."""
    if _libc is not None:
        _libc.malloc_trim(0)
