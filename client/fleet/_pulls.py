"""`pull_tensors` over a fleet: one pull's tensors, as each arrives whole, from the broker that holds the hand-off.

The broker is the ticket's, when the ticket names a broker this client's set has held; else it is found as
FleetClient.pull finds it (_order.py): a brief look at the first brokers in rendezvous order, then a wait at
the first that answers. Either way the pull is that broker's `HandoffClient.pull_tensors` (handoff_client/_pulls.py): its chunks on
a lane or the stream, a lane that breaks starting over on the stream within the same call, every chunk checked, the
claim confirmed only at the end. Errors name the broker. The broker's connection is held (_clients.py) until
the iteration ends, however it ends.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..protocol.errors import HandoffError
from ._order import named, probe_then_wait

if TYPE_CHECKING:
    from .._pulls import PulledTensors
    from ..protocol.contract import Carried, Handoff
    from ._clients import BrokerClients


@dataclass
class _Started:
    """A pull that found its hand-off at `broker`: its stream, and the first tensor it yielded (None: none)."""

    broker: str
    hold: ExitStack
    pulled: PulledTensors
    items: Iterator[tuple[Carried, Any]]
    first: tuple[Carried, Any] | None


@dataclass(frozen=True)
class Route:
    """Where a fleet pull goes: the ticket's broker, or else the brokers in rendezvous order (`departed`: those of
    them that left the set, with how long ago)."""

    broker: str | None
    order: list[str]
    departed: Mapping[str, float]


class FleetPulledTensors:
    """A fleet pull's stream: iterate for `(carried, array)` as each tensor completes; then `.handoff`, confirmed.
    The same promises as PulledTensors (nothing yielded may be kept unless the iteration ends normally; a tensor
    yielded twice after a lane fell back to the stream counts at its last yield)."""

    def __init__(self, clients: BrokerClients, model: str, handoff_id: str, route: Route, timeout: float,
                 wait_for_push: float | None, options: dict[str, Any]) -> None:  # fmt: skip
        self._clients = clients
        self._model = model
        self._handoff_id = handoff_id
        self._route = route
        self._timeout = timeout
        self._wait_for_push = wait_for_push  # (the ticket's broker only: a probe waits PROBE_SECONDS at each)
        self._options = options
        self._pulled: PulledTensors | None = None
        self.broker: str | None = None
        """The broker the hand-off is pulled from, once found."""

    @property
    def handoff(self) -> Handoff:
        """The whole hand-off; available once iteration has ended normally (and the claim is confirmed)."""
        if self._pulled is None:
            raise RuntimeError("the pull has not been iterated to its end")
        return self._pulled.handoff

    @property
    def position(self) -> int | None:
        """The hand-off's position, once its header has come (before the first tensor is yielded)."""
        return None if self._pulled is None else self._pulled.position

    @property
    def claim(self) -> int:
        return 0 if self._pulled is None else self._pulled.claim

    @property
    def left_its_lane(self) -> bool:
        return self._pulled is not None and self._pulled.left_its_lane

    def __iter__(self) -> Iterator[tuple[Carried, Any]]:
        route = self._route
        if route.broker is not None:
            try:
                started = self._start(route.broker, self._timeout, self._wait_for_push)
            except HandoffError as e:
                raise named(route.broker, e) from None
        else:
            started = probe_then_wait(route.order, self._start, self._timeout, route.departed)
        with started.hold:
            self._pulled, self.broker = started.pulled, started.broker
            try:
                if started.first is not None:
                    yield started.first
                yield from started.items
            except HandoffError as e:
                raise named(started.broker, e) from None
            finally:
                started.items.close()  # (an iteration given up: its stream is cancelled, its claim goes back)

    def _start(self, broker: str, timeout: float, wait_for_push: float | None) -> _Started:
        """Start the pull at `broker` and wait for its first tensor (so a broker without the hand-off says so here,
        WaitTimedOut after `wait_for_push`); the broker's client held until the iteration ends."""
        hold = ExitStack()
        try:
            client = hold.enter_context(self._clients.using(broker))
            pulled = client.pull_tensors(self._model, self._handoff_id, timeout=timeout, wait_for_push=wait_for_push,
                                         **self._options)  # fmt: skip
            items = iter(pulled)
            first = next(items, None)
        except BaseException:
            hold.close()
            raise
        return _Started(broker, hold, pulled, items, first)
