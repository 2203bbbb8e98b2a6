"""The fleet client's connection to each broker: made when a call needs it, closed once nothing needs it any more.

A broker's client (one gRPC channel) is held by each call that uses it, from `using(broker)` to the end of its
`with` block (a unary call, a push; a pull's whole iteration): `calls` counts them. A client is *retired* when it
can serve no new call:
- its broker registered anew (restarted, or back after its etcd lease lapsed): calls go to a new client, so none
  waits out gRPC's reconnect backoff from the broker's former life;
- its broker left the set (drained, cut from etcd, dead) more than `keep_left` seconds ago (the set's
  LEFT_RECENTLY: while a pull without a ticket may still look there). A ticket naming it later gets a new client,
  retired in turn once that call ends.

Invariants: a retired client serves no new call, and is closed exactly once, as soon as no call holds it (never
under a call still using it: closing a channel ends every call on it). `close()` closes every client at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._client import BrokerClient
    from ._members import BrokerSet

logger = logging.getLogger(__name__)

SWEEP_EVERY = 1.0
"""The most often the clients are checked for brokers that left the set (a check reads the set, a dict per broker)."""


@dataclass(eq=False)
class _Held:
    """A broker's client, the registration it was made for, and the calls holding it."""

    broker: str
    registration: str | None
    client: BrokerClient
    calls: int = 0
    retired: bool = False


class BrokerClients:
    """Each broker's client, made and retired as described above. `make(broker)` makes a broker's client."""

    def __init__(self, brokers: BrokerSet, make: Callable[[str], BrokerClient], keep_left: float) -> None:
        self._set = brokers
        self._make = make
        self._keep_left = keep_left
        self._current: dict[str, _Held] = {}  # broker -> the client new calls to it take
        self._retiring: list[_Held] = []  # retired clients some call still holds
        self._swept_at = 0.0
        self._closed = False
        self._lock = threading.Lock()

    @contextmanager
    def using(self, broker: str) -> Iterator[BrokerClient]:
        """The broker's client, held for the `with` block."""
        held = self._take(broker)
        try:
            yield held.client
        finally:
            self._let_go(held)

    def open_brokers(self) -> list[str]:
        """The brokers with a client open now, retired ones still in use included (once each)."""
        with self._lock:
            return sorted({held.broker for held in [*self._current.values(), *self._retiring]})

    def _take(self, broker: str) -> _Held:
        registration = self._set.registration(broker)
        self._sweep()
        closing: list[_Held] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("the fleet client is closed")
            held = self._current.get(broker)
            if held is not None and registration is not None and held.registration != registration:
                logger.info("broker %s registered anew: connecting to it afresh", broker)
                closing += self._retire(held)
                held = None
            if held is None:
                held = _Held(broker, registration, self._make(broker))
                self._current[broker] = held
            held.calls += 1
        self._close(closing)
        return held

    def _let_go(self, held: _Held) -> None:
        with self._lock:
            held.calls -= 1
            closing = held.retired and held.calls == 0 and held in self._retiring  # (not when close() took it)
            if closing:
                self._retiring.remove(held)
        if closing:
            self._close([held])

    def _sweep(self) -> None:
        """Retire the clients of brokers out of the set for more than `keep_left` seconds."""
        now = time.monotonic()
        if now - self._swept_at < SWEEP_EVERY:
            return
        self._swept_at = now
        members = self._set.members()
        recent = self._set.left_recently(self._keep_left)
        closing: list[_Held] = []
        with self._lock:
            for broker, held in list(self._current.items()):
                if broker not in members and broker not in recent:
                    logger.info("broker %s is out of the set: its connection closes once no call uses it", broker)
                    closing += self._retire(held)
        self._close(closing)

    def _retire(self, held: _Held) -> list[_Held]:
        """Under the lock: no new call takes `held`; the list of it, if no call holds it (to be closed now)."""
        held.retired = True
        if self._current.get(held.broker) is held:
            del self._current[held.broker]
        if held.calls == 0:
            return [held]
        self._retiring.append(held)
        return []

    @staticmethod
    def _close(helds: list[_Held]) -> None:
        for held in helds:
            held.client.close()

    def close(self) -> None:
        """Close every client (the calls still under way on them end)."""
        with self._lock:
            self._closed = True
            helds = [*self._current.values(), *self._retiring]
            self._current.clear()
            self._retiring.clear()
        self._close(helds)
