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
  client, so none waits out gRPC's reconnect backoff from its former life; the connection to the former one stays
  open RETIRED_SECONDS for the calls under way on it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Self, TypeVar

from ._members import BrokerSet
from .protocol.errors import BrokerUnavailable, HandoffError, MalformedRequest, WaitTimedOut

T = TypeVar("T")
logger = logging.getLogger(__name__)

TICKET_PREFIX = "hb1:"
PROBE_SECONDS = 0.2
"""How long a pull waits at each of the next brokers in score order before settling at the first."""
PROBED = 3


def is_fleet(target: str) -> bool:
    """Whether a target names several brokers (a list, a DNS name, an etcd prefix) rather than one."""
    return "," in target or target.startswith(("dns:///", "etcd://"))


def rendezvous(brokers: list[str], model: str, handoff_id: str) -> list[str]:
    """The brokers in the order this hand-off prefers them."""
    key = f"|{model}|{handoff_id}".encode()
    return sorted(brokers, key=lambda b: hashlib.sha256(b.encode() + key).digest(), reverse=True)


def make_ticket(broker: str, model: str, handoff_id: str, fingerprint: str) -> str:
    body = json.dumps({"b": broker, "m": model, "i": handoff_id, "f": fingerprint}, separators=(",", ":"))
    return TICKET_PREFIX + base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def ticket_for(ticket: str, model: str, handoff_id: str) -> dict[str, str]:
    """What a ticket names, refused unless it is this hand-off's."""
    fields = read_ticket(ticket)
    if (fields["m"], fields["i"]) != (model, handoff_id):
        raise MalformedRequest(f"the ticket is for {fields['m']}/{fields['i']}, not {model}/{handoff_id}")
    return fields


def read_ticket(ticket: str) -> dict[str, str]:
    """The broker, model, id and fingerprint a ticket names; MalformedRequest for anything else."""
    try:
        if not ticket.startswith(TICKET_PREFIX):
            raise ValueError("no prefix")
        raw = ticket[len(TICKET_PREFIX) :]
        fields = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        if not all(isinstance(fields.get(k), str) for k in "bmif"):
            raise ValueError("fields")
        return fields
    except (ValueError, UnicodeDecodeError):
        raise MalformedRequest(f"`{ticket[:40]}` is not a hand-off ticket (a push returns one)") from None


def named(broker: str, error: HandoffError) -> HandoffError:
    """The error, with the broker it came from in its message and fields."""
    if error.fields.get("broker") != broker:
        error.fields["broker"] = broker
        error.message = f"broker {broker}: {error.message}"
        error.args = (error.message,)
    return error


def in_order(brokers: list[str], attempt: Callable[[str], T]) -> T:
    """The first broker in order that answers; the next on UNAVAILABLE (down or draining)."""
    last: HandoffError | None = None
    for broker in brokers:
        try:
            return attempt(broker)
        except BrokerUnavailable as e:
            last = named(broker, e)
    raise last or BrokerUnavailable._rebuild("no broker in the set", {})


def probe_then_wait(
    brokers: list[str],
    pull: Callable[[str, float, float | None], T],
    timeout: float,
    departed: Mapping[str, float] | None = None,
) -> T:
    """Ask the first few brokers briefly (the push may have gone to the next one while the first was down), then
    wait at the first that answers for what is left of `timeout`. `pull(broker, timeout, wait_for_push)`: a probe
    waits PROBE_SECONDS for the push to begin, but a hand-off it finds streams for the whole of what is left.

    `departed`: brokers in `brokers` that have left the set (with how long ago): probed, since a hand-off pushed
    there before it left may still be there, but never waited at, since no new push goes there. When the first
    broker, the hand-off's own, cannot be reached and no probed broker holds the hand-off, that is the answer:
    BrokerUnavailable naming it, at once."""
    departed = departed or {}
    deadline = time.monotonic() + timeout
    answering: list[str] = []
    unreachable: dict[str, HandoffError] = {}
    last: HandoffError | None = None
    for broker in brokers[:PROBED]:
        try:
            return pull(broker, max(deadline - time.monotonic(), 0.0), PROBE_SECONDS)
        except WaitTimedOut:
            if broker not in departed:
                answering.append(broker)
        except BrokerUnavailable as e:
            last = named(broker, e)
            if type(e) is BrokerUnavailable:  # (not draining, not a lane that broke: the broker is not there)
                unreachable[broker] = last
        except HandoffError as e:  # (it had the hand-off, and something else went wrong: that is the answer)
            raise named(broker, e) from None
    if brokers and brokers[0] in unreachable:
        raise owner_gone(brokers[0], unreachable[brokers[0]], departed.get(brokers[0]))
    for broker in answering[:1] or [b for b in brokers[PROBED:] if b not in departed][:1]:
        try:
            return pull(broker, max(deadline - time.monotonic(), 0.0), None)
        except HandoffError as e:
            raise named(broker, e) from None
    raise last or WaitTimedOut._rebuild("no broker in the set holds the hand-off", {})


def owner_gone(broker: str, error: HandoffError, left_ago: float | None) -> HandoffError:
    """The error of a pull whose hand-off's own broker cannot be reached, saying what that means."""
    where = "it is in the set" if left_ago is None else f"it left the set {left_ago:.1f} s ago"
    error.message += (f" (the first broker in this hand-off's rendezvous order; {where}; the next brokers do not "
                      "hold it: a hand-off pushed there is lost with it)")  # fmt: skip
    error.args = (error.message,)
    return error


RETIRED_SECONDS = 600.0
"""How long the client made for a broker's former registration stays open after the broker registered anew: the
calls under way on it finish (none takes longer, unless given a longer timeout), then it is closed."""

FLEET_CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (("grpc.use_local_subchannel_pool", 1),)
"""Each per-broker channel keeps its connection to itself: by default gRPC shares subchannels among a process's
channels to one address, so a channel made anew for a broker that registered again would inherit the old one's,
still waiting out its reconnect backoff."""


class FleetClient:
    """HandoffClient's API over a set of brokers: pushes placed by rendezvous hashing, pulls by ticket or by the same
    hashing. Made by `HandoffClient(target)` when the target names several brokers. `refresh`: seconds between reads
    of a DNS name's or an etcd prefix's brokers (5)."""

    def __init__(self, target: str, **options: object) -> None:
        from ._client import DEFAULT_TIMEOUT

        self.target = target
        refresh = float(options.pop("refresh", 5.0))  # type: ignore[arg-type]
        self.timeout = float(options.get("timeout", DEFAULT_TIMEOUT))  # type: ignore[arg-type]
        self._set = BrokerSet(target, refresh)
        options["options"] = FLEET_CHANNEL_OPTIONS + tuple(options.get("options", ()))  # type: ignore[arg-type]
        self._options = options
        self._clients: dict[str, tuple[str | None, object]] = {}  # broker -> (its registration, its client)
        self._retired: list[tuple[float, object]] = []  # (when, client) made for a former registration
        self._lock = threading.Lock()

    def _client(self, broker: str):
        """The broker's client: the one made for its current registration, made anew when it registered again (a
        broker not in the set now keeps the one it had)."""
        from ._client import HandoffClient

        registration = self._set.registration(broker)
        with self._lock:
            now = time.monotonic()
            while self._retired and now - self._retired[0][0] >= RETIRED_SECONDS:
                self._retired.pop(0)[1].close()
            held = self._clients.get(broker)
            if held is not None and (registration is None or held[0] == registration):
                return held[1]
            if held is not None:
                logger.info("broker %s registered anew: connecting to it afresh", broker)
                self._retired.append((now, held[1]))
            client = HandoffClient(broker, **self._options)
            self._clients[broker] = (registration, client)
            return client

    def close(self) -> None:
        with self._lock:
            for _, client in self._clients.values():
                client.close()
            for _, client in self._retired:
                client.close()
            self._clients.clear()
            self._retired.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list_contracts(self, **kwargs: object):
        return in_order(self._set.brokers(), lambda b: self._client(b).list_contracts(**kwargs))

    def get_contract(self, model: str, **kwargs: object):
        return in_order(self._set.brokers(), lambda b: self._client(b).get_contract(model, **kwargs))

    def push(self, model: str, handoff_id: str, position: int, tensors, **kwargs: object):
        """Push to the first live broker in this hand-off's rendezvous order; the result's ticket names it."""
        order = rendezvous(self._set.brokers(), model, handoff_id)
        return in_order(order, lambda b: self._client(b).push(model, handoff_id, position, tensors, **kwargs))

    def pull(
        self, model: str, handoff_id: str, *, ticket: str | None = None, timeout: float | None = None, **kwargs: object
    ):
        """From the broker the ticket names, if it is or was in the set; or else by rendezvous order: a brief look at
        the first few, then a wait at the first that answers."""
        timeout = self.timeout if timeout is None else timeout
        brokers = self._set.brokers()
        if ticket is not None:
            broker = ticket_for(ticket, model, handoff_id)["b"]
            if not self._set.known(broker):
                self._set.read_now()  # it may have joined since this client last read the set
            if self._set.known(broker):
                try:
                    return self._client(broker).pull(model, handoff_id, timeout=timeout, ticket=ticket, **kwargs)
                except HandoffError as e:
                    raise named(broker, e) from None
            # A ticket is unsigned: it may only choose among the brokers this client was given, never send the
            # decoder's token and keys to a host of the ticket's choosing.
            logger.warning("the ticket for %s/%s names %s, which has never been in this client's broker set (a "
                           "ticket from another fleet, or forged); pulling by rendezvous order instead",
                           model, handoff_id, broker[:100])  # fmt: skip
            brokers = self._set.brokers()
        departed = self._set.left_recently()
        order = rendezvous(brokers + [b for b in departed if b not in brokers], model, handoff_id)
        return probe_then_wait(
            order,
            lambda b, t, w: self._client(b).pull(model, handoff_id, timeout=t, wait_for_push=w, **kwargs),
            timeout,
            departed,
        )

    def cancel(self, model: str, handoff_id: str, **kwargs: object) -> bool:
        """Cancel wherever the hand-off is (a broker that left the set recently may still hold it); True if some
        broker held it."""
        brokers = self._set.brokers()
        departed = [b for b in self._set.left_recently() if b not in brokers]
        for broker in rendezvous(brokers + departed, model, handoff_id):
            try:
                if self._client(broker).cancel(model, handoff_id, **kwargs):
                    return True
            except BrokerUnavailable:
                continue
        return False
