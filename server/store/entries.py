"""The store's records and the few things every part of it shares: a hand-off's entry — its state (`Stage`, and
its claim's `Hold`) and the transitions that alone change it, each asserting it is legal — its tombstone, a claim,
a stored chunk, the store's configuration and events, and how interrupts of calls are run.

Every part of the store (holdings, intake, delivery, groups, timers, pushes) imports from here, and this module from
none of them at run time, so the import graph of server/ has no cycle (tests/test_layout.py checks it).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from handoff_client.protocol.contract import Contract
from handoff_client.protocol.limits import MAX_HANDOFF_ID  # noqa: F401 - the one rule, the client keeps to it too
from handoff_client.protocol.spans import TensorSpans

from .ledger import Reservation

if TYPE_CHECKING:
    from .groups import Group

logger = logging.getLogger("handoff_broker.store")

HandoffKey = tuple[str, str]
"""(model, handoff_id): ids are the router's request ids, unique per model."""

Interrupt = Callable[[], None]

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


class Stage(enum.Enum):
    """Where an entry is in its push's life (its claim, if any, is `Entry.hold`; leaving the store, `Entry.ended`).

    RECEIVING ──suspend──► SUSPENDED ──resume──► RECEIVING ──commit──► READY
    FILLING (a pulling rank's part, filled by the cut) ──commit──► READY
    """

    RECEIVING = "receiving"  # a push stream owns it and adds chunks
    SUSPENDED = "suspended"  # its resumable push's stream broke: kept unseen until resumed or `suspended_until`
    FILLING = "filling"  # a pulling rank's part, filled by the cut: no push of its own to time out
    READY = "ready"  # committed: every chunk and the whole checked


@dataclass(eq=False)
class Hold:
    """A decode worker's claim on an entry, from its grant until it is confirmed, returned (its stream broke,
    stalled, or streamed whole and went unconfirmed past the lease) or the entry leaves the store.

        granted (streaming) ──stream ended whole──► leased ──confirm──► (the entry goes)
               └── stream broke, or stalled past the lease; leased past the lease ──► returned (`Entry.unclaim`)
    """

    generation: int  # unique for the store's life, across every id and rank: a zombie's confirm cannot match
    live: bool  # granted before the commit: its stream reads chunks as they arrive
    activity: float  # while streaming: the last moment its stream moved
    interrupt: Interrupt | None  # its stream, while streaming
    streaming: bool = True
    lease_until: float = float("inf")  # once streamed whole: when it lapses unconfirmed


@dataclass(eq=False)
class Entry:
    """A hand-off (or one tensor-parallel rank's part of one) held by the store. Its state is `stage`, `hold` and
    `ended`, changed only through the transition methods below, each under the store's lock."""

    key: HandoffKey
    contract: Contract
    position: int
    ttl: float
    changed: threading.Condition  # chunks arrived, or the push committed or ended (for pipelined pullers)
    stage: Stage = Stage.RECEIVING
    push: object | None = None  # the PushSession that owns it while RECEIVING
    push_interrupt: Interrupt | None = None  # that push's stream
    push_activity: float = 0.0
    hold: Hold | None = None
    last_generation: int = 0  # the latest claim's (0: never claimed)
    ended: str | None = None  # why it left the store: aborted, replaced, expired, cancelled, confirmed, cut, abandoned
    arrived: list[StoredChunk] = field(default_factory=list)  # in arrival order, grown by the push
    ordered: list[StoredChunk] = field(default_factory=list)  # contract order, from the commit
    by_tensor: list[list[StoredChunk]] = field(default_factory=list)
    starts: list[list[int]] = field(default_factory=list)  # per tensor, sorted chunk offsets (for byte compares)
    digest: str = ""
    expires_at: float = float("inf")  # READY and unclaimed: when it expires
    resumable: bool = False
    suspended_until: float = 0.0
    spans: list[TensorSpans] = field(default_factory=list)  # the push's checks so far, kept for a resume
    received: list[tuple[int, int, int, int]] = field(default_factory=list)  # digest entries so far
    created: float = 0.0
    arrival: int = 0  # the order its push's header came in: an older push never replaces a newer one
    committed_at: float = 0.0
    reservation: Reservation | None = None  # what it holds of the ledger (a group's pulling ranks: the group's)
    group: Group | None = None  # the tensor-parallel hand-off this entry is one rank's part of
    rank: int = 0

    @property
    def nbytes(self) -> int:
        return self.contract.nbytes

    @property
    def committed(self) -> bool:
        return self.stage is Stage.READY

    @property
    def claimed(self) -> bool:
        return self.hold is not None

    def holds(self, generation: int) -> bool:
        """Whether the claim `generation` still holds this entry."""
        return self.ended is None and self.hold is not None and self.hold.generation == generation

    # -- the push's side ----------------------------------------------------------------------------------------------

    def begin(self, session: object, interrupt: Interrupt | None, now: float) -> list[Interrupt]:
        """A push stream owns the entry from now (its first, or a resume's); the stream it replaces, if the store
        still thought it alive, is returned for interrupting."""
        assert self.ended is None and self.stage in (Stage.RECEIVING, Stage.SUSPENDED), self.stage
        stale = [self.push_interrupt] if self.push is not None and self.push_interrupt is not None else []
        self.stage, self.push, self.push_interrupt, self.push_activity = Stage.RECEIVING, session, interrupt, now
        return stale

    def suspend(self, until: float) -> None:
        """Its push's stream broke, the push being resumable: kept, unseen by pullers, until `until`."""
        assert self.stage is Stage.RECEIVING, self.stage
        self.stage, self.push, self.push_interrupt, self.suspended_until = Stage.SUSPENDED, None, None, until

    def commit(self, digest: str, now: float, committed_at: float | None = None) -> None:
        """Every chunk and the whole checked: complete for pullers; its ttl runs (unless claimed)."""
        assert self.ended is None and self.stage in (Stage.RECEIVING, Stage.FILLING), self.stage
        self.stage, self.digest = Stage.READY, digest
        self.push = self.push_interrupt = None
        self.committed_at = now if committed_at is None else committed_at
        self.expires_at = now + self.ttl
        self.changed.notify_all()

    # -- the claim's side ---------------------------------------------------------------------------------------------

    def grant(self, generation: int, interrupt: Interrupt | None, now: float) -> Hold:
        assert self.ended is None and self.hold is None
        self.hold = Hold(generation, live=not self.committed, activity=now, interrupt=interrupt)
        self.last_generation = generation
        return self.hold

    def streamed_whole(self, lease_until: float) -> None:
        """Its claim's stream ended with the digest sent: the claim is leased until confirmed or `lease_until`."""
        assert self.hold is not None
        self.hold.streaming, self.hold.interrupt, self.hold.lease_until = False, None, lease_until

    def unclaim(self, now: float) -> list[Interrupt]:
        """The claim ends without a confirm: free for the next puller (its ttl runs again, if committed). Its stream,
        if still open, is returned for interrupting."""
        hold, self.hold = self.hold, None
        assert hold is not None
        if self.committed:
            self.expires_at = now + self.ttl
        self.changed.notify_all()
        return [hold.interrupt] if hold.streaming and hold.interrupt is not None else []

    # -- leaving the store --------------------------------------------------------------------------------------------

    def end(self, how: str) -> list[Interrupt]:
        """It leaves the store: its bytes released, its chunks dropped. The streams to interrupt are returned: a
        pusher still sending (unless committed or cut), and a puller still streaming when it is cancelled or its
        confirm came before its stream's end was read (it may be blocked on flow control, out of `feed`'s reach,
        holding a thread and the chunks it was sending); a pipelined puller waiting in `feed` hears why there."""
        assert self.ended is None, self.ended
        self.ended = how
        if self.reservation is not None:
            self.reservation.release()
        interrupts = (
            [self.push_interrupt] if self.push_interrupt and how in ("aborted", "replaced", "cancelled") else []
        )
        hold = self.hold
        if hold is not None and hold.streaming and hold.interrupt and how in ("cancelled", "confirmed"):
            interrupts.append(hold.interrupt)
        self.push_interrupt = None
        if hold is not None:
            hold.interrupt = None
        self.arrived, self.ordered, self.by_tensor = [], [], []
        self.changed.notify_all()
        return interrupts

    # -- time ---------------------------------------------------------------------------------------------------------

    def due(self, now: float, config: StoreConfig) -> tuple[str, str] | None:
        """What lapsed at `now`, as (what happens, why), if anything: "free" (with how it ends) or "unclaim"."""
        hold = self.hold
        if self.stage is Stage.SUSPENDED and now >= self.suspended_until:
            return "aborted", "broken push not resumed in time: freed"
        if self.stage in (Stage.RECEIVING, Stage.SUSPENDED) and now - self.created >= config.push_deadline:
            return "aborted", f"push still unfinished after {config.push_deadline}s: aborted"
        if self.stage is Stage.RECEIVING and now - self.push_activity >= config.idle_timeout:
            return "aborted", f"push sent nothing for {config.idle_timeout}s: aborted"
        if hold is not None and hold.streaming and now - hold.activity >= config.lease:
            return "unclaim", f"claim {hold.generation} stalled: revoked"
        if hold is not None and not hold.streaming and now >= hold.lease_until:
            return "unclaim", f"claim {hold.generation} lapsed unconfirmed"
        if self.committed and hold is None and now >= self.expires_at and self._may_expire():
            return "expired", f"expired unclaimed ({self.nbytes} bytes freed)"
        return None

    def next_due(self, config: StoreConfig) -> float:
        """The earliest moment `due` may find something (a lower bound: activity only pushes it later)."""
        hold = self.hold
        times = [float("inf")]
        if self.stage is Stage.SUSPENDED:
            times += [self.suspended_until, self.created + config.push_deadline]
        if self.stage is Stage.RECEIVING:
            times += [self.created + config.push_deadline, self.push_activity + config.idle_timeout]
        if hold is not None:
            times.append(hold.activity + config.lease if hold.streaming else hold.lease_until)
        elif self.committed:
            times.append(self.expires_at)  # (a rank's part that may not expire yet is looked at again later)
        return min(times)

    def _may_expire(self) -> bool:
        """Whether an unclaimed entry's ttl runs: a rank's part waits while every rank of its push has begun and one
        is still pushing (that push's idle timeout and deadline bound the wait); its ttl runs again from the last
        commit, and meanwhile if a rank never began at all."""
        group = self.group
        return group is None or group.complete or len(group.pushed) < group.push_size


@dataclass(frozen=True)
class Tombstone:
    how: str  # expired, cancelled, confirmed, or aborted (its push failed before it committed: a new push replaces it)
    generation: int
    digest: str
    until: float
    position: int = -1  # the hand-off's position (-1: not known, as for a cancel of an id never held)
    why: str = ""  # an aborted push's refusal, if known


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
