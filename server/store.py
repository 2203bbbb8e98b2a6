"""Where hand-offs live between their push and their pull: a state machine with bounded memory.

    push header ─► RECEIVING ──commit──► READY ──claim──► CLAIMED ──confirm──► (gone: confirmed)
                       │                  │  ▲               │
                       │ abort            │  └──release──────┤  stream broke before the end, or lease lapsed
                       ▼                  ▼                  │
                   (nothing)         (gone: expired)         ▼ cancel, from any state: (gone: cancelled)

What it guarantees:
- A hand-off is visible to pullers only after every chunk and the whole have passed the contract's checks
  (`commit`); an aborted push frees its bytes at once and leaves no trace.
- A READY hand-off goes to one claimant at a time; each claim has a new generation, and only the current
  generation can confirm. A claim whose stream broke returns to READY at once; one whose stream ended but that was
  never confirmed returns after `lease` seconds.
- Resident bytes (reserved by pushes at their header, from the contract) never exceed `max_bytes`.
- A READY hand-off nobody claims expires after `ttl` seconds. What is gone leaves a tombstone for
  `tombstone_ttl`, so late callers hear *expired*, *cancelled* or *confirmed* rather than *unknown*, and a push
  retried after its hand-off was delivered is recognised.

Plain Python and numpy-free: no gRPC in here. Every method is thread-safe; a PushSession belongs to one stream.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum

from handoff_client._contract import Contract, TensorSpans
from handoff_client._errors import (
    AlreadyClaimed,
    BadChunk,
    CapacityExhausted,
    Draining,
    FingerprintMismatch,
    HandoffCancelled,
    HandoffExists,
    HandoffGone,
    MalformedRequest,
    StaleClaim,
    UnknownHandoff,
    UnknownModel,
    WaitTimedOut,
)
from handoff_client._frames import ChunkFrame, crc32c, handoff_digest

logger = logging.getLogger(__name__)

HandoffKey = tuple[str, str]
"""(model, handoff_id): ids are the router's request ids, unique per model."""

MAX_HANDOFF_ID = 256
MAX_TOMBSTONES = 100_000


class Phase(Enum):
    RECEIVING = "receiving"
    READY = "ready"
    CLAIMED = "claimed"


@dataclass(frozen=True)
class StoreConfig:
    """How long things may live and how much the store may hold."""

    max_bytes: int
    ttl: float = 300.0
    lease: float = 30.0
    tombstone_ttl: float = 600.0
    sweep_interval: float = 0.5


@dataclass(frozen=True)
class StoredChunk:
    """A checked chunk, kept as the frame it arrived in so a puller gets those very bytes."""

    index: int
    offset: int
    length: int
    crc: int
    frame: bytes
    data: memoryview


@dataclass(eq=False)
class _Entry:
    key: HandoffKey
    contract: Contract
    position: int
    phase: Phase
    push: object  # the PushSession that owns a RECEIVING entry
    chunks: list[StoredChunk] = field(default_factory=list)
    starts: list[list[int]] = field(default_factory=list)  # per tensor, sorted chunk offsets (for byte compares)
    by_tensor: list[list[StoredChunk]] = field(default_factory=list)
    digest: str = ""
    expires_at: float = 0.0
    generation: int = 0
    streaming: bool = False
    lease_until: float = 0.0

    @property
    def nbytes(self) -> int:
        return self.contract.nbytes


@dataclass(frozen=True)
class _Tombstone:
    how: str  # "expired", "cancelled" or "confirmed"
    generation: int
    digest: str
    until: float


@dataclass(frozen=True)
class PushOutcome:
    bytes: int
    chunks: int
    digest: str
    duplicate: bool


@dataclass(frozen=True)
class Claim:
    """A decode worker's hold on a hand-off: what to stream, and the generation that may confirm it."""

    model: str
    handoff_id: str
    generation: int
    position: int
    fingerprint: str
    nbytes: int
    chunks: tuple[StoredChunk, ...]
    digest: str


@dataclass(frozen=True)
class StoreStats:
    receiving: int
    ready: int
    claimed: int
    resident_bytes: int
    max_bytes: int
    tombstones: int


class Store:
    """Every hand-off the broker holds, by (model, handoff_id)."""

    def __init__(self, contracts: Mapping[str, Contract], config: StoreConfig, clock: Callable[[], float] = time.monotonic):
        self.contracts = dict(contracts)
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # any entry changed phase, or bytes were freed
        self._entries: dict[HandoffKey, _Entry] = {}
        self._tombstones: OrderedDict[HandoffKey, _Tombstone] = OrderedDict()
        self._resident = 0
        self._draining = False
        self._closed = threading.Event()
        self._sweeper: threading.Thread | None = None

    # -- life of the store --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the sweeper that expires, returns lapsed leases and forgets old tombstones."""
        self._sweeper = threading.Thread(target=self._sweep_forever, name="handoff-sweeper", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._changed.notify_all()
        if self._sweeper is not None:
            self._sweeper.join()

    def drain(self) -> None:
        """Take no new pushes or claims; what is in flight goes on."""
        with self._lock:
            self._draining = True
            self._changed.notify_all()

    def contract(self, model: str) -> Contract:
        try:
            return self.contracts[model]
        except KeyError:
            raise UnknownModel(model, sorted(self.contracts)) from None

    def stats(self) -> StoreStats:
        with self._lock:
            phases = [e.phase for e in self._entries.values()]
            return StoreStats(
                receiving=phases.count(Phase.RECEIVING),
                ready=phases.count(Phase.READY),
                claimed=phases.count(Phase.CLAIMED),
                resident_bytes=self._resident,
                max_bytes=self.config.max_bytes,
                tombstones=len(self._tombstones),
            )

    # -- prefill side -------------------------------------------------------------------------------------------------

    def begin_push(self, model: str, handoff_id: str, position: int, fingerprint: str, wait: float) -> PushSession:
        """Open a push: the header's checks, then the hand-off's whole size reserved (waiting up to `wait` s).

        A push of an id already held is checked against it byte for byte instead (a blind retry); a push of an id
        still RECEIVING replaces that push (its stream is presumed dead: the retry came first).
        """
        contract = self.contract(model)
        _check_id(model, handoff_id)
        if fingerprint != contract.fingerprint:
            raise FingerprintMismatch(model, contract.fingerprint, fingerprint)
        contract.check_position(position)
        key = (model, handoff_id)
        deadline = self._clock() + wait
        with self._lock:
            while True:
                if self._draining:
                    raise Draining()
                held = self._entries.get(key)
                if held is not None and held.phase is not Phase.RECEIVING:
                    if held.position != position:
                        raise HandoffExists(model, handoff_id, f"was pushed at position {held.position}, not {position}")
                    return _RepeatPush(self, contract, key, held=held)
                tomb = self._tombstones.get(key)
                if tomb is not None and tomb.how == "cancelled":
                    raise HandoffGone(model, handoff_id, "was cancelled; push it under a new id")
                if tomb is not None and tomb.how == "confirmed":
                    return _RepeatPush(self, contract, key, delivered_digest=tomb.digest)
                if held is not None:  # a push of this id in flight: this one replaces it
                    self._free(held)
                    logger.info("push of %s/%s replaces one still in flight", model, handoff_id)
                    continue
                free = self.config.max_bytes - self._resident
                if contract.nbytes <= free:
                    break
                remaining = deadline - self._clock()
                if remaining <= 0 or contract.nbytes > self.config.max_bytes:
                    raise CapacityExhausted(model, contract.nbytes, free)
                self._changed.wait(remaining)
            session = _NewPush(self, contract, key)
            entry = _Entry(key, contract, position, Phase.RECEIVING, session)
            session.entry = entry
            self._entries[key] = entry
            self._tombstones.pop(key, None)
            self._resident += entry.nbytes
            return session

    def _commit(self, session: _NewPush, chunks: list[StoredChunk], digest: str) -> None:
        with self._lock:
            entry = session.entry
            self._check_owner(session)
            chunks.sort(key=lambda c: (c.index, c.offset))
            entry.chunks = chunks
            entry.by_tensor = [[] for _ in entry.contract.carried]
            for chunk in chunks:
                entry.by_tensor[chunk.index].append(chunk)
            entry.starts = [[c.offset for c in run] for run in entry.by_tensor]
            entry.digest = digest
            entry.phase = Phase.READY
            entry.expires_at = self._clock() + self.config.ttl
            self._changed.notify_all()

    def _abort(self, session: _NewPush) -> None:
        with self._lock:
            entry = self._entries.get(session.key)
            if entry is not None and entry.push is session and entry.phase is Phase.RECEIVING:
                self._free(entry)

    def _check_owner(self, session: PushSession) -> None:
        """Under the lock: the session's entry is still its own (not cancelled, not replaced by a retry)."""
        entry = self._entries.get(session.key)
        if entry is None or entry.push is not session:
            model, handoff_id = session.key
            tomb = self._tombstones.get(session.key)
            if tomb is not None and tomb.how == "cancelled":
                raise HandoffCancelled(model, handoff_id)
            raise HandoffExists(model, handoff_id, "was pushed again by a newer stream, which replaces this one")

    def _still_owned(self, session: PushSession) -> None:
        with self._lock:
            self._check_owner(session)

    # -- decode side --------------------------------------------------------------------------------------------------

    def claim(self, model: str, handoff_id: str, wait: float, is_active: Callable[[], bool] = lambda: True) -> Claim:
        """Claim a READY hand-off, waiting up to `wait` seconds for its push to commit."""
        self.contract(model)
        _check_id(model, handoff_id)
        key = (model, handoff_id)
        started = self._clock()
        with self._lock:
            while True:
                if self._draining:
                    raise Draining()
                entry = self._entries.get(key)
                if entry is not None and entry.phase is Phase.READY:
                    entry.generation += 1
                    entry.phase = Phase.CLAIMED
                    entry.streaming = True
                    return Claim(
                        model,
                        handoff_id,
                        entry.generation,
                        entry.position,
                        entry.contract.fingerprint,
                        entry.nbytes,
                        tuple(entry.chunks),
                        entry.digest,
                    )
                if entry is not None and entry.phase is Phase.CLAIMED:
                    raise AlreadyClaimed(model, handoff_id)
                tomb = self._tombstones.get(key)
                if entry is None and tomb is not None:
                    raise HandoffGone(model, handoff_id, _gone_words(tomb.how))
                waited = self._clock() - started
                if waited >= wait:
                    raise WaitTimedOut(model, handoff_id, waited)
                if not is_active() or self._closed.is_set():
                    raise WaitTimedOut(model, handoff_id, waited)  # nobody is listening any more
                self._changed.wait(min(wait - waited, 0.25))

    def is_current(self, claim: Claim) -> bool:
        """Whether the claim still holds its hand-off (not cancelled, not superseded)."""
        with self._lock:
            entry = self._entries.get((claim.model, claim.handoff_id))
            return entry is not None and entry.phase is Phase.CLAIMED and entry.generation == claim.generation

    def release(self, claim: Claim, sent_all: bool) -> None:
        """The claim's stream has ended: whole (the lease starts) or broken (the hand-off is READY again at once)."""
        with self._lock:
            entry = self._entries.get((claim.model, claim.handoff_id))
            if entry is None or entry.phase is not Phase.CLAIMED or entry.generation != claim.generation:
                return
            entry.streaming = False
            if sent_all:
                entry.lease_until = self._clock() + self.config.lease
            else:
                self._return_to_pool(entry)

    def confirm(self, model: str, handoff_id: str, generation: int) -> None:
        """The decode worker has the hand-off whole: forget it. Idempotent for the same generation."""
        self.contract(model)
        key = (model, handoff_id)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                if entry.phase is not Phase.CLAIMED:
                    raise StaleClaim(model, handoff_id, generation, "has lapsed; the hand-off went back to the pool")
                if entry.generation != generation:
                    raise StaleClaim(model, handoff_id, generation, f"is superseded by claim {entry.generation}")
                self._free(entry, "confirmed")
                return
            tomb = self._tombstones.get(key)
            if tomb is None:
                raise UnknownHandoff(model, handoff_id)
            if tomb.how == "confirmed" and tomb.generation == generation:
                return
            if tomb.how == "confirmed":
                raise StaleClaim(model, handoff_id, generation, f"is superseded by claim {tomb.generation}")
            raise HandoffGone(model, handoff_id, _gone_words(tomb.how))

    def cancel(self, model: str, handoff_id: str) -> bool:
        """Free the hand-off in whatever phase it is; pushers and pullers in flight find it cancelled."""
        self.contract(model)
        key = (model, handoff_id)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                if key not in self._tombstones:
                    self._bury(key, "cancelled", 0, "")
                return False
            self._free(entry, "cancelled")
            return True

    # -- housekeeping -------------------------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Expire unclaimed hand-offs, return lapsed leases, forget old tombstones."""
        now = self._clock()
        with self._lock:
            for entry in list(self._entries.values()):
                if entry.phase is Phase.READY and now >= entry.expires_at:
                    logger.info("hand-off %s/%s expired unclaimed (%d bytes freed)", *entry.key, entry.nbytes)
                    self._free(entry, "expired")
                elif entry.phase is Phase.CLAIMED and not entry.streaming and now >= entry.lease_until:
                    logger.info("claim %d on %s/%s lapsed unconfirmed", entry.generation, *entry.key)
                    self._return_to_pool(entry)
            while self._tombstones:
                key, tomb = next(iter(self._tombstones.items()))
                if tomb.until > now and len(self._tombstones) <= MAX_TOMBSTONES:
                    break
                del self._tombstones[key]

    def _sweep_forever(self) -> None:
        while not self._closed.wait(self.config.sweep_interval):
            try:
                self.sweep()
            except Exception:  # a sweeper that dies would let memory grow unbounded: log and go on
                logger.exception("sweep failed")

    # -- under the lock -----------------------------------------------------------------------------------------------

    def _return_to_pool(self, entry: _Entry) -> None:
        entry.phase = Phase.READY
        entry.streaming = False
        entry.expires_at = self._clock() + self.config.ttl
        self._changed.notify_all()

    def _free(self, entry: _Entry, how: str | None = None) -> None:
        del self._entries[entry.key]
        self._resident -= entry.nbytes
        if how is not None:
            self._bury(entry.key, how, entry.generation, entry.digest)
        entry.chunks = []
        entry.by_tensor = []
        self._changed.notify_all()

    def _bury(self, key: HandoffKey, how: str, generation: int, digest: str) -> None:
        self._tombstones.pop(key, None)
        self._tombstones[key] = _Tombstone(how, generation, digest, self._clock() + self.config.tombstone_ttl)


def _gone_words(how: str) -> str:
    return {
        "expired": "expired before any decode worker claimed it",
        "cancelled": "was cancelled",
        "confirmed": "was already delivered to a decode worker and confirmed",
    }[how]


def _check_id(model: str, handoff_id: str) -> None:
    if not handoff_id or len(handoff_id) > MAX_HANDOFF_ID or not handoff_id.isprintable():
        raise MalformedRequest(
            f"a handoff_id must be 1..{MAX_HANDOFF_ID} printable characters, got {handoff_id[:64]!r}", model
        )


class PushSession:
    """One push stream's checks, chunk by chunk: name, bounds, overlap, checksum; then the whole at `commit`."""

    def __init__(self, store: Store, contract: Contract, key: HandoffKey) -> None:
        self.store = store
        self.contract = contract
        self.key = key
        self._spans = [TensorSpans(contract.model, c) for c in contract.carried]
        self._entries: list[tuple[int, int, int, int]] = []
        self._since_check = 0

    def add(self, chunk: ChunkFrame) -> None:
        index = self.contract.index(chunk.tensor)
        length = len(chunk.data)
        self._spans[index].add(chunk.offset, length)
        if crc32c(chunk.data) != chunk.crc32c:
            raise BadChunk(self.contract.model, chunk.tensor, chunk.offset, length, "fails its CRC32C on arrival")
        self._entries.append((index, chunk.offset, length, chunk.crc32c))
        self._keep(index, chunk)

    def finish(self) -> PushOutcome:
        """The stream closed cleanly: every tensor whole, then the hand-off made visible (or matched)."""
        for spans in self._spans:
            spans.check_complete()
        return self._finish(handoff_digest(self._entries))

    def abort(self) -> None:
        """The stream failed or broke: keep nothing."""

    def _keep(self, index: int, chunk: ChunkFrame) -> None:
        raise NotImplementedError

    def _finish(self, digest: str) -> PushOutcome:
        raise NotImplementedError


class _NewPush(PushSession):
    """A push of an id the broker does not hold: its chunks are kept, and become the hand-off at `finish`."""

    def __init__(self, store: Store, contract: Contract, key: HandoffKey) -> None:
        super().__init__(store, contract, key)
        self.entry: _Entry
        self._chunks: list[StoredChunk] = []

    def _keep(self, index: int, chunk: ChunkFrame) -> None:
        self._chunks.append(StoredChunk(index, chunk.offset, len(chunk.data), chunk.crc32c, chunk.frame, chunk.data))
        self._since_check += 1
        if self._since_check >= 64:  # notice a cancel or a replacing retry without taking the lock every chunk
            self._since_check = 0
            self.store._still_owned(self)

    def _finish(self, digest: str) -> PushOutcome:
        self.store._commit(self, self._chunks, digest)
        return PushOutcome(self.contract.nbytes, len(self._chunks), digest, duplicate=False)

    def abort(self) -> None:
        self.store._abort(self)
        self._chunks = []


class _RepeatPush(PushSession):
    """A push of an id already held or already delivered: a retry must repeat it exactly, and then changes nothing.

    Against a held hand-off every byte is compared; against a delivered one (its bytes are gone) the digest is.
    """

    def __init__(
        self, store: Store, contract: Contract, key: HandoffKey, held: _Entry | None = None, delivered_digest: str = ""
    ) -> None:
        super().__init__(store, contract, key)
        # Taken now: if the held hand-off is confirmed meanwhile, these lists stay whole for the comparison.
        self._starts = held.starts if held is not None else None
        self._stored = held.by_tensor if held is not None else None
        self._want = held.digest if held is not None else delivered_digest

    def _keep(self, index: int, chunk: ChunkFrame) -> None:
        if self._stored is None or self._starts is None:
            return
        starts, stored = self._starts[index], self._stored[index]
        offset, data = chunk.offset, chunk.data
        at = max(bisect.bisect_right(starts, offset) - 1, 0)
        end = offset + len(data)
        while at < len(stored) and stored[at].offset < end:
            held = stored[at]
            lo, hi = max(offset, held.offset), min(end, held.offset + held.length)
            if lo < hi and data[lo - offset : hi - offset] != held.data[lo - held.offset : hi - held.offset]:
                model, handoff_id = self.key
                raise HandoffExists(model, handoff_id, f"differs in `{chunk.tensor}` within bytes {lo}..{hi}")
            at += 1

    def _finish(self, digest: str) -> PushOutcome:
        if self._stored is None and digest != self._want:
            model, handoff_id = self.key
            raise HandoffExists(model, handoff_id, "was delivered with different content (or chunking)")
        return PushOutcome(self.contract.nbytes, len(self._entries), self._want, duplicate=True)


def iter_frames(claim: Claim) -> Iterator[bytes]:
    """The chunk frames of a claim, in contract order."""
    for chunk in claim.chunks:
        yield chunk.frame
