"""Admission at the edge: the limits a client can push against, checked before a call takes a thread for long.

The sync gRPC server has `--workers` threads, and every open push or pull stream, and every call waiting (a pull for
its push, a push for room), holds one. Left unbounded, a few hundred waiting pulls take every thread, and the pushes
they wait for, health checks and status queue behind them until everything times out. So:

    streams   open PushHandoff and PullHandoff streams          at most workers - reserve
    waiting   of those, calls waiting for a push or for room    at most half of the streams
    waiting pushes   of those, pushes waiting for room          at most their windows' budget / one stream window
    reserve   threads no stream may take                        max(1, workers // 8): health, status, contracts,
                                                                confirms and cancels always find one

A stream past its limit is refused at once with BROKER_BUSY (RESOURCE_EXHAUSTED, RetryInfo), which the client
retries; a call that would wait past the waiting limit does not wait (a pull whose push has not begun, or a push
short of room, is refused as BROKER_BUSY or CAPACITY_EXHAUSTED). Every refusal is counted by reason, as every other.

A push waiting for room holds what its HTTP/2 window let in (up to app.STREAM_WINDOW_BYTES), outside --max-bytes: the
waiting pushes' windows are counted against a budget of their own (app.waiting_windows_budget: an eighth of
--max-bytes, at least 16 MiB), so many pushes waiting on a full broker cannot hold their window each beside it (60
on a full 2 MiB broker held 120 MiB; now 8 wait, and the rest are refused at once, CAPACITY_EXHAUSTED, as a push
past the waiting budget always was).

A stream that sends nothing is ended by the `Watchdog` (watchdog.py) after `--idle-timeout`: it cannot pin a
thread by silence, before its header or after.

The principle, here and in the ledger (ledger.py): every resource a call can make the broker hold is charged, at the
edge, to that call's admission slot or its ledger reservation, and is released exactly once, when the call ends,
however it ends. A slot stands for a worker thread, so it is held exactly as long as the call may hold one: a push's
while its handler runs; a pull's until its call has ended and no thread runs its handler (`HeldWhileRunning`), so
a thread still asleep in a lane's opening is never counted free. A thread waiting for its lane's connections waits
at most the opening deadline (handoff_client.protocol.lane.OPENING_TIMEOUT) and is woken the moment its call ends
(`LaneListener.forget`). A connection that is no call's yet (an opening) holds no slot: the lane listener holds at
most 64, each at most the opening deadline, shared fairly by source (server/lanes.py). Bytes, chunks, frame buffers,
rings and HTTP/2 windows: the ledger's reservation, or a bound a call (docs/lanes.md, "Every resource a call can
make the broker hold", lists each: charged where, released where).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Self, TypeVar

from handoff_client.protocol.errors import BrokerBusy

T = TypeVar("T")

WAITING_WINDOWS_MIN_BYTES = 16 << 20
"""The least the waiting pushes' windows may hold together (waiting_windows_budget)."""


def waiting_windows_budget(max_bytes: int) -> int:
    """What the windows of pushes waiting for room may hold together, outside --max-bytes: an eighth of it, at least
    WAITING_WINDOWS_MIN_BYTES. The broker lets this / its stream window pushes wait (app.py)."""
    return max(WAITING_WINDOWS_MIN_BYTES, max_bytes // 8)


class Budget:
    """A count of slots, taken without waiting and given back exactly once each."""

    def __init__(self, what: str, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a budget of {what} needs at least one slot, not {limit}")
        self.what = what
        self.limit = limit
        self._taken = 0
        self._lock = threading.Lock()

    @property
    def taken(self) -> int:
        return self._taken

    def try_take(self) -> Slot | None:
        with self._lock:
            if self._taken >= self.limit:
                return None
            self._taken += 1
        return Slot(self)

    def take(self, model: str | None = None) -> Slot:
        """A slot, or BrokerBusy naming this budget."""
        slot = self.try_take()
        if slot is None:
            raise BrokerBusy(self.what, self.limit, model)
        return slot

    def _give_back(self) -> None:
        with self._lock:
            assert self._taken > 0, f"{self.what}: a slot given back twice"
            self._taken -= 1


class Slot:
    """One taken slot of a Budget; `give_back` is idempotent, so every path that ends a call may call it."""

    __slots__ = ("_budget", "_lock")

    def __init__(self, budget: Budget) -> None:
        self._budget: Budget | None = budget
        self._lock = threading.Lock()

    def give_back(self) -> None:
        with self._lock:
            budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.give_back()


class HeldWhileRunning(Iterator[T]):
    """A server-streaming handler's responses, holding its stream `slot` (and whatever `on_release` adds) for as long
    as the call may hold a worker thread: given back exactly once, when the call has ended (`call_ended`, its
    done-callback) and no thread is inside the handler, or when the handler returns, whichever comes first.

    grpcio abandons a handler's generator mid-stream when its client goes, suspended at a `yield` and closed only
    when collected, so a slot given back only by the handler's own `finally` could stay taken for ever; but a slot
    given back at the call's end while a thread still runs the handler (asleep on its lane's opening, say) would
    let admission hand out a worker thread that is not free. Neither: the slot stands for the thread. And once the
    call has ended the handler is never resumed (only closed), though grpcio may still ask for a next response."""

    def __init__(self, slot: Slot, responses: Iterator[T]) -> None:
        self._slot = slot
        self._responses = responses
        self._lock = threading.Lock()
        self._inside = False  # a thread is running the handler now
        self._ended = False  # the call has ended
        self._released: list[Callable[[], None]] = [slot.give_back]

    def on_release(self, release: Callable[[], None]) -> None:
        """Run `release` too when the slot is given back (at once, if it already was)."""
        with self._lock:
            if self._released:
                self._released.append(release)
                return
        release()

    def call_ended(self) -> None:
        """The call's done-callback: from now on, the slot goes back as soon as no thread is inside the handler."""
        with self._lock:
            self._ended = True
            inside = self._inside
        if not inside:
            self._release()

    def __next__(self) -> T:
        with self._lock:
            ended = self._ended
            self._inside = not ended
        if ended:  # grpcio may ask for the next response after the call ended (between its is-active check and its
            self.close()  # `next`): its slot may be handed out already, so the handler is closed, not run on
            raise StopIteration
        try:
            return next(self._responses)
        except BaseException:  # returned or raised: the handler holds nothing more
            self._release()
            raise
        finally:
            with self._lock:
                self._inside = False
                ended = self._ended
            if ended:
                self._release()

    def close(self) -> None:
        """Close the handler (grpcio collecting an abandoned stream; `yield from` passes the close on)."""
        try:
            close = getattr(self._responses, "close", None)
            if close is not None:
                close()
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            released, self._released = self._released, []
        for release in released:
            release()


class Slots:
    """Slots of several budgets, given back together (each exactly once, as a Slot is)."""

    __slots__ = ("_slots",)

    def __init__(self, *slots: Slot) -> None:
        self._slots = slots

    def give_back(self) -> None:
        for slot in self._slots:
            slot.give_back()


@dataclass(frozen=True)
class Admission:
    """The broker's budgets, sized from its worker threads."""

    streams: Budget
    waiting: Budget
    waiting_pushes: Budget

    @classmethod
    def for_workers(cls, workers: int, waiting_pushes: int | None = None) -> Admission:
        """The budgets for `workers` threads; `waiting_pushes` caps the pushes that may wait for room (at most the
        waiting budget, which is also the default)."""
        if workers < 2:
            raise ValueError(
                f"--workers must be at least 2 (one for streams, one for health and status), not {workers}"
            )
        reserve = max(1, workers // 8)
        streams = workers - reserve
        waiting = max(1, streams // 2)
        return cls(
            streams=Budget("open push and pull streams", streams),
            waiting=Budget("calls waiting for a push or for room", waiting),
            waiting_pushes=Budget("pushes waiting for room", max(1, min(waiting, waiting_pushes or waiting))),
        )

    def waiting_for_room(self) -> Slots | None:
        """A push's slots to wait for room (one of `waiting`, one of `waiting_pushes`, given back together), or None
        where either budget is spent (the push then does not wait)."""
        pushes = self.waiting_pushes.try_take()
        if pushes is None:
            return None
        call = self.waiting.try_take()
        if call is None:
            pushes.give_back()
            return None
        return Slots(call, pushes)
