"""Keep the broker's RSS close to the hand-off bytes it holds (glibc only; elsewhere these do nothing).

Chunk frames are large, short-lived `bytes` objects allocated by gRPC's threads. glibc's mmap threshold rises after
the first large free, so later frames land in the heap, whose freed pages are not returned to the system by
themselves; and each of the many RPC threads may get an arena of its own, fragmenting further. Capping the arenas
bounds the second; `trim`, called when the store has emptied, hands back what the heap still holds. (Fixing the
mmap threshold low instead made every frame an mmap returned at once, but cost throughput in page faults: measured,
and left as glibc has it.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8
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
    """Cap glibc's arenas; True where it took effect."""
    if _libc is None:
        return False
    ok = _libc.mallopt(_M_ARENA_MAX, ARENA_MAX) == 1
    logger.debug("allocator tuned: at most %d arenas (%s)", ARENA_MAX, ok)
    return ok


def trim() -> None:
    """Return the heap's free pages to the system."""
    if _libc is not None:
        _libc.malloc_trim(0)
