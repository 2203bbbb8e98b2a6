"""Admission at the edge: the limits a client can push against, checked before a call takes a thread for long.

The sync gRPC server has `--workers` threads, and every open push or pull stream, and every call waiting (a pull for
its push, a push for room), holds one. Left unbounded, a few hundred waiting pulls take every thread, and the pushes
they wait for, health checks and status queue behind them until everything times out. So:

    streams   open PushHandoff and PullHandoff streams          at most workers - reserve
    waiting   of those, calls waiting for a push or for room    at most half of the streams
    reserve   threads no stream may take                        max(1, workers // 8): health, status, contracts,
                                                                confirms and cancels always find one

A stream past its limit is refused at once with BROKER_BUSY (RESOURCE_EXHAUSTED, RetryInfo), which the client
retries; a call that would wait past the waiting limit does not wait (a pull whose push has not begun, or a push
short of room, is refused as BROKER_BUSY or CAPACITY_EXHAUSTED). Every refusal is counted by reason, as every other.

A stream that sends nothing is ended by the `Watchdog` (watchdog.py) after `--idle-timeout`: it cannot pin a
thread by silence, before its header or after.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from handoff_client._errors import BrokerBusy


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

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.give_back()


@dataclass(frozen=True)
class Admission:
    """The broker's budgets, sized from its worker threads."""

    streams: Budget
    waiting: Budget

    @classmethod
    def for_workers(cls, workers: int) -> Admission:
        if workers < 2:
            raise ValueError(
                f"--workers must be at least 2 (one for streams, one for health and status), not {workers}"
            )
        reserve = max(1, workers // 8)
        streams = workers - reserve
        return cls(
            streams=Budget("open push and pull streams", streams),
            waiting=Budget("calls waiting for a push or for room", max(1, streams // 2)),
        )
