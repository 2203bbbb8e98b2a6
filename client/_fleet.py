"""Many brokers serving as one: placement by rendezvous hashing, and tickets that name where a hand-off lives.

Both sides of a hand-off pick its broker without talking: every broker of the set is scored by
sha256(broker | model | handoff_id) and the highest wins (rendezvous, or highest-random-weight, hashing), so adding
or losing a broker moves only the hand-offs it scores highest for. A broker that is down or draining is skipped in
score order. A push returns a ticket naming its broker; a decoder that has it (the router passes it on, as vLLM's
proxy passes kv_transfer_params) pulls from that broker directly. Without one, a pull asks the first few brokers in
score order briefly before it waits at the first that answers.

The set is a comma-separated list of host:port; `dns:///name:port`, re-resolved every `refresh` seconds (a
Kubernetes headless Service gives every pod's address); or `etcd://host:port/prefix`, the brokers registered there
with leases (server/registry.py), listed every `refresh` seconds through etcd's HTTP/JSON gateway.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlparse

from ._errors import BrokerUnavailable, HandoffError, MalformedRequest, WaitTimedOut
from ._etcd import list_values

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


class BrokerSet:
    """The live list of brokers: static, re-resolved from DNS, or listed from an etcd prefix."""

    def __init__(self, target: str, refresh: float = 5.0) -> None:
        self._etcd = target if target.startswith("etcd://") else None
        self._dns = target[len("dns:///") :] if target.startswith("dns:///") else None
        dynamic = self._dns is not None or self._etcd is not None
        self._static = [t.strip() for t in target.split(",") if t.strip()] if not dynamic else []
        self._refresh = refresh
        self._resolved: list[str] = []
        self._at = 0.0
        self._lock = threading.Lock()

    def brokers(self) -> list[str]:
        if self._dns is None and self._etcd is None:
            return list(self._static)
        with self._lock:
            if not self._at or time.monotonic() - self._at >= self._refresh:
                self._resolved = self._etcd_members() if self._etcd else self._dns_members()
                self._at = time.monotonic()
            return list(self._resolved)

    def _dns_members(self) -> list[str]:
        host, _, port = (self._dns or "").rpartition(":")
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        addresses = {info[4][0] for info in infos}
        return sorted(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses)

    def _etcd_members(self) -> list[str]:
        """The addresses registered under the prefix, through etcd's HTTP/JSON gateway (v3 range)."""
        try:
            return list_values(self._etcd or "")
        except OSError as e:
            where = urlparse(self._etcd or "").netloc
            raise BrokerUnavailable._rebuild(f"etcd at {where} cannot be read: {e}", {}) from None


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


def probe_then_wait(brokers: list[str], pull: Callable[[str, float, float | None], T], timeout: float) -> T:
    """Ask the first few brokers briefly (the push may have gone to the next one while the first was down), then
    wait at the first that answers for what is left of `timeout`. `pull(broker, timeout, wait_for_push)`: a probe
    waits PROBE_SECONDS for the push to begin, but a hand-off it finds streams for the whole of what is left."""
    deadline = time.monotonic() + timeout
    answering: list[str] = []
    last: HandoffError | None = None
    for broker in brokers[:PROBED]:
        try:
            return pull(broker, max(deadline - time.monotonic(), 0.0), PROBE_SECONDS)
        except WaitTimedOut:
            answering.append(broker)
        except BrokerUnavailable as e:
            last = named(broker, e)
    for broker in answering[:1] or brokers[PROBED : PROBED + 1]:
        try:
            return pull(broker, max(deadline - time.monotonic(), 0.0), None)
        except HandoffError as e:
            raise named(broker, e) from None
    raise last or WaitTimedOut._rebuild("no broker in the set holds the hand-off", {})


class FleetClient:
    """HandoffClient's API over a set of brokers: pushes placed by rendezvous hashing, pulls by ticket or by the same
    hashing. Made by `HandoffClient(target)` when the target names several brokers."""

    def __init__(self, target: str, **options: object) -> None:
        from ._client import DEFAULT_TIMEOUT

        self.target = target
        refresh = float(options.pop("refresh", 5.0))  # type: ignore[arg-type]
        self.timeout = float(options.get("timeout", DEFAULT_TIMEOUT))  # type: ignore[arg-type]
        self._set = BrokerSet(target, refresh)
        self._options = options
        self._clients: dict[str, object] = {}
        self._lock = threading.Lock()

    def _client(self, broker: str):  # noqa: ANN202 - a single-broker HandoffClient
        from ._client import HandoffClient

        with self._lock:
            if broker not in self._clients:
                self._clients[broker] = HandoffClient(broker, **self._options)
            return self._clients[broker]

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list_contracts(self, **kwargs: object):  # noqa: ANN201
        return in_order(self._set.brokers(), lambda b: self._client(b).list_contracts(**kwargs))

    def get_contract(self, model: str, **kwargs: object):  # noqa: ANN201
        return in_order(self._set.brokers(), lambda b: self._client(b).get_contract(model, **kwargs))

    def push(self, model: str, handoff_id: str, position: int, tensors, **kwargs: object):  # noqa: ANN001, ANN201
        """Push to the first live broker in this hand-off's rendezvous order; the result's ticket names it."""
        order = rendezvous(self._set.brokers(), model, handoff_id)
        return in_order(order, lambda b: self._client(b).push(model, handoff_id, position, tensors, **kwargs))

    def pull(  # noqa: ANN201
        self, model: str, handoff_id: str, *, ticket: str | None = None, timeout: float | None = None, **kwargs: object
    ):
        """From the broker the ticket names, or else by rendezvous order: a brief look at the first few, then a wait
        at the first that answers."""
        timeout = self.timeout if timeout is None else timeout
        brokers = self._set.brokers()
        if ticket is not None:
            fields = ticket_for(ticket, model, handoff_id)
            if fields["b"] in brokers:
                try:
                    return self._client(fields["b"]).pull(model, handoff_id, timeout=timeout, ticket=ticket, **kwargs)
                except HandoffError as e:
                    raise named(fields["b"], e) from None
            # A ticket is unsigned: it may only choose among the brokers this client was given, never send the
            # decoder's token and keys to a host of the ticket's choosing.
            logger.warning("the ticket for %s/%s names %s, which is not in this client's broker set; pulling by "
                           "rendezvous order instead", model, handoff_id, fields["b"][:100])  # fmt: skip
        order = rendezvous(brokers, model, handoff_id)
        return probe_then_wait(
            order,
            lambda b, t, w: self._client(b).pull(model, handoff_id, timeout=t, wait_for_push=w, **kwargs),
            timeout,
        )

    def cancel(self, model: str, handoff_id: str, **kwargs: object) -> bool:
        """Cancel wherever the hand-off is; True if some broker held it."""
        for broker in rendezvous(self._set.brokers(), model, handoff_id):
            try:
                if self._client(broker).cancel(model, handoff_id, **kwargs):
                    return True
            except BrokerUnavailable:
                continue
        return False
