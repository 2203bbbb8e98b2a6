"""Many brokers serving as one: placement by rendezvous hashing, and tickets that name where a hand-off lives.

Both sides of a hand-off pick its broker without talking: every broker of the set is scored by
sha256(broker | model | handoff_id) and the highest wins (rendezvous, or highest-random-weight, hashing), so adding
or losing a broker moves only the hand-offs it scores highest for. A broker that is down or draining is skipped in
score order. A push returns a ticket naming its broker; a decoder that has it (the router passes it on, as vLLM's
proxy passes kv_transfer_params) pulls from that broker directly. Without one, a pull asks the first few brokers in
score order briefly before it waits at the first that answers. The set, and what the client remembers of brokers
that left it, is _members.py's.

What a broker's trouble costs (docs/scaling.md):
- A ticket naming a broker that is, or once was, in the set is that broker's: it is pulled from there, even after
  the broker left the set (a draining broker, or one cut from etcd, still serves what it holds), and a broker that
  cannot be reached is reported at once, by name (BrokerUnavailable). Only a ticket naming a broker never in the set
  is not followed (it is unsigned: it may choose among the client's brokers, never send the decoder elsewhere).
- A pull without a ticket whose hand-off's first broker in score order (among the set and the brokers that left it
  in the last LEFT_RECENTLY seconds) cannot be reached, and that the next brokers do not hold, is reported the same
  way, at once: a hand-off pushed there is lost with it. (A pull made before its push, for such an id, fails too,
  and the caller recomputes; a decoder given a ticket never meets this.)
- A broker that registers anew (restarted, or back after its etcd lease lapsed) gets a new connection from each
  client, so none waits out gRPC's reconnect backoff from its former life; and a broker out of the set for longer
  than LEFT_RECENTLY has its connection closed. Either way the former connection is closed once the last call
  under way on it ends, never under it (_clients.py).
- The vLLM connector places a hand-off before its push (`place`), names that broker in the ticket the router gets
  at once, and pushes there alone (`push(..., broker=)`): the ticket names the broker that holds the hand-off, or,
  when that push failed, one that does not, which a decoder hears at once (see `push`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Self, TypeVar

from .._client import DEFAULT_TIMEOUT, BrokerClient
from .._produced import ProducedTensors, is_produced, producing
from ..protocol.errors import BrokerUnavailable, HandoffError, MalformedRequest
from ..protocol.tickets import ticket_for
from ._clients import BrokerClients
from ._members import LEFT_RECENTLY, BrokerSet
from ._order import in_order, named, probe_then_wait
from ._pulls import FleetPulledTensors, Route

T = TypeVar("T")
logger = logging.getLogger(__name__)


def rendezvous(brokers: list[str], model: str, handoff_id: str) -> list[str]:
    """The brokers in the order this hand-off prefers them."""
    key = f"|{model}|{handoff_id}".encode()
    return sorted(brokers, key=lambda b: hashlib.sha256(b.encode() + key).digest(), reverse=True)


FLEET_CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (("grpc.use_local_subchannel_pool", 1),)
"""Each per-broker channel keeps its connection to itself: by default gRPC shares subchannels among a process's
channels to one address, so a channel made anew for a broker that registered again would inherit the old one's,
still waiting out its reconnect backoff."""


class FleetClient:
    """HandoffClient's API over a set of brokers: pushes placed by rendezvous hashing, pulls by ticket or by the same
    hashing. Made by `HandoffClient(target)` when the target names several brokers. `refresh`: seconds between reads
    of a DNS name's or an etcd prefix's brokers (5)."""

    def __init__(self, target: str, **options: object) -> None:
        self.target = target
        refresh = float(options.pop("refresh", 5.0))  # type: ignore[arg-type]
        self.timeout = float(options.get("timeout", DEFAULT_TIMEOUT))  # type: ignore[arg-type]
        self._set = BrokerSet(target, refresh)
        options["options"] = FLEET_CHANNEL_OPTIONS + tuple(options.get("options", ()))  # type: ignore[arg-type]
        options.setdefault("retry_unreachable", False)  # (a broker that cannot be reached: the next one is tried)
        self._options = options
        self._clients = BrokerClients(self._set, self._connect, LEFT_RECENTLY)

    def _connect(self, broker: str) -> BrokerClient:
        return BrokerClient(broker, **self._options)  # type: ignore[arg-type]

    def close(self) -> None:
        self._clients.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _at(self, broker: str, call: Callable[..., T]) -> T:
        """`call(client)` with the broker's client, held for the call; its error names the broker."""
        with self._clients.using(broker) as client:
            try:
                return call(client)
            except HandoffError as e:
                raise named(broker, e) from None

    def list_contracts(self, **kwargs: object):
        return in_order(self._set.brokers(), lambda b: self._at(b, lambda c: c.list_contracts(**kwargs)))

    def get_contract(self, model: str, **kwargs: object):
        return in_order(self._set.brokers(), lambda b: self._at(b, lambda c: c.get_contract(model, **kwargs)))

    def brokers(self) -> list[str]:
        """The brokers in the set now, sorted."""
        return self._set.brokers()

    def place(self, model: str, handoff_id: str) -> str:
        """The broker a push of this hand-off goes to now: the first of the set in its rendezvous order."""
        brokers = self._set.brokers()
        if not brokers:
            raise BrokerUnavailable._rebuild(f"no broker in the set {self.target}", {})
        return rendezvous(brokers, model, handoff_id)[0]

    def push(self, model: str, handoff_id: str, position: int, tensors, *, broker: str | None = None, **kwargs: object):
        """Push to the first live broker in this hand-off's rendezvous order; the result's ticket names it.

        `broker` (from `place`, made before the push by whoever already handed out a ticket naming it): push there
        and nowhere else, so the ticket is never wrong about where the hand-off went; if that broker cannot take it,
        the push fails (and the decoder, following the ticket, hears at once that the broker is unreachable, or
        does not hold it). Every tensor-parallel rank given the same broker meets there. Only a broker this client's
        set holds, or once held, is pushed to (MalformedRequest otherwise). `tensors` still being made (an iterable
        of pairs) are made once, and every broker tried is sent the same arrays."""
        if is_produced(tensors) and not isinstance(tensors, ProducedTensors):
            with producing(model, tensors) as made:
                return self.push(model, handoff_id, position, made, broker=broker, **kwargs)
        if broker is not None:
            if not self._set.known(broker):
                self._set.read_now()  # it may have joined since this client last read the set
            if not self._set.known(broker):
                raise MalformedRequest(f"broker {broker[:100]} has never been in this client's broker set "
                                       f"{self.target[:100]}: not pushed there", model)  # fmt: skip
            try:
                return self._at(broker, lambda c: c.push(model, handoff_id, position, tensors, **kwargs))
            except HandoffError as e:
                raise named(broker, e) from None
        order = rendezvous(self._set.brokers(), model, handoff_id)
        return in_order(order, lambda b: self._at(b, lambda c: c.push(model, handoff_id, position, tensors, **kwargs)))

    def _route(self, model: str, handoff_id: str, ticket: str | None) -> Route:
        """The ticket's broker, if it is or was in the set; or else the rendezvous order, with the brokers that left
        the set recently (probed, never waited at)."""
        if ticket is not None:
            broker = ticket_for(ticket, model, handoff_id)["b"]
            if not self._set.known(broker):
                self._set.read_now()  # it may have joined since this client last read the set
            if self._set.known(broker):
                return Route(broker, [broker], {})
            # A ticket is unsigned: it may only choose among the brokers this client was given, never send the
            # decoder's token and keys to a host of the ticket's choosing.
            logger.warning("the ticket for %s/%s names %s, which has never been in this client's broker set (a "
                           "ticket from another fleet, or forged); pulling by rendezvous order instead",
                           model, handoff_id, broker[:100])  # fmt: skip
        brokers = self._set.brokers()
        departed = self._set.left_recently()
        return Route(None, rendezvous(brokers + [b for b in departed if b not in brokers], model, handoff_id), departed)

    def pull(
        self, model: str, handoff_id: str, *, ticket: str | None = None, timeout: float | None = None, **kwargs: object
    ):
        """From the broker the ticket names, if it is or was in the set; or else by rendezvous order: a brief look at
        the first few, then a wait at the first that answers."""
        timeout = self.timeout if timeout is None else timeout
        route = self._route(model, handoff_id, ticket)
        if route.broker is not None:
            try:
                return self._at(route.broker, lambda c: c.pull(model, handoff_id, timeout=timeout, ticket=ticket,
                                                              **kwargs))  # fmt: skip
            except HandoffError as e:
                raise named(route.broker, e) from None
        return probe_then_wait(
            route.order,
            lambda b, t, w: self._at(b, lambda c: c.pull(model, handoff_id, timeout=t, wait_for_push=w, **kwargs)),
            timeout,
            route.departed,
        )

    def pull_tensors(
        self,
        model: str,
        handoff_id: str,
        *,
        ticket: str | None = None,
        timeout: float | None = None,
        wait_for_push: float | None = None,
        **kwargs: object,
    ) -> FleetPulledTensors:
        """HandoffClient.pull_tensors from the broker that holds the hand-off, found as `pull` finds it (the ticket's
        broker, else rendezvous order): iterate for `(carried, array)` as each tensor arrives whole; a lane that
        breaks falls back to the stream within the same iteration. `wait_for_push` applies at the ticket's broker
        (without a ticket each broker is looked at briefly, then the first that answers waited at). Nothing happens
        until it is iterated."""
        timeout = self.timeout if timeout is None else timeout
        route = self._route(model, handoff_id, ticket)
        options = {**kwargs, "ticket": ticket} if route.broker is not None else dict(kwargs)
        return FleetPulledTensors(self._clients, model, handoff_id, route, timeout, wait_for_push, options)

    def cancel(self, model: str, handoff_id: str, *, broker: str | None = None, **kwargs: object) -> bool:
        """Cancel wherever the hand-off is (a broker that left the set recently may still hold it); True if some
        broker held it. `broker` (where a push was placed, `place`): cancel there and nowhere else."""
        if broker is not None:
            if not self._set.known(broker):
                raise MalformedRequest(f"broker {broker[:100]} has never been in this client's broker set "
                                       f"{self.target[:100]}: not cancelled there", model)  # fmt: skip
            return self._at(broker, lambda c: c.cancel(model, handoff_id, **kwargs))
        brokers = self._set.brokers()
        departed = [b for b in self._set.left_recently() if b not in brokers]
        for held_by in rendezvous(brokers + departed, model, handoff_id):
            try:
                if self._at(held_by, lambda c: c.cancel(model, handoff_id, **kwargs)):
                    return True
            except BrokerUnavailable:
                continue
        return False
