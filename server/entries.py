"""The store's records and the few things every part of it shares: a hand-off's entry, its tombstone, a claim,
a stored chunk, the store's configuration and events, and how interrupts of calls are run.

Plain data, no behaviour of the store's own: store.py (the state machine), groups.py (tensor-parallel hand-offs)
and pushes.py (a push's checks) all import from here and from nothing of each other at run time, so the import
graph of server/ has no cycle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from handoff_client._contract import Contract, TensorSpans

from .ledger import Reservation

if TYPE_CHECKING:
    from .groups import Group

logger = logging.getLogger("handoff_broker.store")

HandoffKey = tuple[str, str]
"""(model, handoff_id): ids are the router's request ids, unique per model."""

Interrupt = Callable[[], None]

MAX_HANDOFF_ID = 256
MAX_TOMBSTONES = 100_000
FEED_BATCH = 256
CHUNK_FLOOR = 4096
MIN_CHUNK_BUDGET = 8192
WAIT_SLICE = 0.1  # seconds between re-checks of a waiting caller's liveness


class StoreEvents(Protocol):
    """What the store reports as it happens (the broker's metrics implement it)."""

    def expired(self, model: str) -> None: ...
    def lease_returned(self, model: str) -> None: ...
    def cancelled(self, model: str) -> None: ...
    def claimed(self, model: str, waited: float | None) -> None: ...
    def confirmed(self, model: str, since_push: float) -> None: ...
    def resharded(self, model: str, copied: int) -> None: ...


class Unobserved:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args: None


@dataclass(frozen=True)
class StoreConfig:
    """How long things may live and how much the store may hold."""

    max_bytes: int
    ttl: float = 300.0
    lease: float = 30.0
    idle_timeout: float = 30.0
    resume_window: float = 10.0
    push_deadline: float = 600.0
    tombstone_ttl: float = 600.0
    sweep_interval: float = 0.25
    trim_after: float = 30.0  # seconds holding nothing before `on_idle` (the broker returns memory then)

    @property
    def max_chunks(self) -> int:
        """The chunks the store holds at most: each costs ~400 bytes beside its data (measured), so 1-byte chunks
        would hold ~400x what `max_bytes` counts; bounded by an average of CHUNK_FLOOR bytes a chunk, the overhead
        stays under a tenth of `max_bytes` (and a few MiB for a small store)."""
        return max(MIN_CHUNK_BUDGET, self.max_bytes // CHUNK_FLOOR)


@dataclass(eq=False)
class Entry:
    key: HandoffKey
    contract: Contract
    position: int
    ttl: float
    push: object | None  # the PushSession that owns the entry until its commit
    changed: threading.Condition  # chunks arrived, or the push committed or ended (for pipelined pullers)
    arrived: list[StoredChunk] = field(default_factory=list)  # in arrival order, grown by the push
    ordered: list[StoredChunk] = field(default_factory=list)  # contract order, from the commit
    by_tensor: list[list[StoredChunk]] = field(default_factory=list)
    starts: list[list[int]] = field(default_factory=list)  # per tensor, sorted chunk offsets (for byte compares)
    committed: bool = False
    digest: str = ""
    expires_at: float = float("inf")
    generation: int = 0
    claimed: bool = False
    streaming: bool = False
    live: bool = False  # the current claim was made before the commit
    lease_until: float = 0.0
    push_activity: float = 0.0
    pull_activity: float = 0.0
    push_interrupt: Interrupt | None = None
    pull_interrupt: Interrupt | None = None
    ended: str | None = None  # why it left the store: aborted, replaced, expired, cancelled, confirmed
    resumable: bool = False
    suspended_until: float | None = None  # a broken resumable push, kept unseen until then
    spans: list[TensorSpans] = field(default_factory=list)  # the push's checks so far, kept for a resume
    received: list[tuple[int, int, int, int]] = field(default_factory=list)  # digest entries so far
    created: float = 0.0
    arrival: int = 0  # the order its push's header came in: an older push never replaces a newer one
    committed_at: float = 0.0
    reservation: Reservation | None = None  # what it holds of the ledger (a group's pulling ranks: the group's)
    group: Group | None = None  # the tensor-parallel hand-off this entry is one rank's part of
    rank: int = 0
    cut_part: bool = False  # a pulling rank's part, filled by the cut (no push of its own to time out)

    @property
    def nbytes(self) -> int:
        return self.contract.nbytes


@dataclass(frozen=True)
class Tombstone:
    how: str  # expired, cancelled or confirmed
    generation: int
    digest: str
    until: float
    position: int = -1  # the hand-off's position (-1: not known, as for a cancel of an id never held)


@dataclass(frozen=True)
class Claim:
    """A decode worker's hold on a hand-off: the generation that may confirm it, and where its chunks come from."""

    model: str
    handoff_id: str
    generation: int
    position: int
    fingerprint: str
    nbytes: int
    chunks: int  # known when claimed after the commit; 0 for a pipelined claim
    entry: Entry = field(repr=False, compare=False)


@dataclass(frozen=True)
class StoreStats:
    receiving: int
    ready: int
    claimed: int
    resident_bytes: int
    max_bytes: int
    tombstones: int
    oldest_seconds: float = 0.0
    draining: bool = False


@dataclass(frozen=True)
class StoredChunk:
    """A checked chunk, kept as the frame it arrived in so a puller gets those very bytes."""

    index: int
    offset: int
    length: int
    crc: int
    frame: bytes
    data: memoryview


def by_tensor(chunks: list[StoredChunk], tensors: int) -> list[list[StoredChunk]]:
    """The chunks grouped by their tensor's index, each group in the order given."""
    grouped: list[list[StoredChunk]] = [[] for _ in range(tensors)]
    for chunk in chunks:
        grouped[chunk.index].append(chunk)
    return grouped


def run_interrupts_later(interrupts: list[Interrupt]) -> None:
    """Interrupts due while the lock is held: run them on their own thread rather than wait for the lock's release."""
    if interrupts:
        threading.Thread(target=run_interrupts, args=(interrupts,), name="handoff-interrupt", daemon=True).start()


def run_interrupts(interrupts: list[Interrupt]) -> None:
    for interrupt in interrupts:
        try:
            interrupt()
        except Exception:  # an interrupt of a call that already ended: nothing to do
            logger.debug("interrupt failed", exc_info=True)
