"""Which brokers a fleet client places hand-offs on, and what it remembers of those that left.

The set is a comma-separated list of host:port; `dns:///name:port`, re-resolved every `refresh` seconds (a
Kubernetes headless Service gives every pod's address); or `etcd://host:port/prefix`, the brokers registered there
with leases (handoff_broker/registry.py), listed every `refresh` seconds through etcd's HTTP/JSON gateway.

Invariants:
- `brokers()` is the set as last read, re-read at most every `refresh` seconds; a read that fails keeps the set
  last read (etcd or DNS away for a moment does not take the fleet away), and only a first read that fails raises.
- A broker once in the set stays `known` after it leaves (up to MAX_REMEMBERED, those gone longest forgotten first):
  a ticket naming it is that broker's. Only an address never in the set is foreign.
- `registration(broker)` is what identifies the broker's current registration (etcd: its lease; "" for a list or
  DNS), and changes whenever the broker registers anew: restarted, or back after its lease lapsed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from urllib.parse import urlparse

from ..protocol.errors import BrokerUnavailable
from ..protocol.etcd import list_registrations

logger = logging.getLogger(__name__)

MAX_REMEMBERED = 4096
"""Brokers that left the set that a client still recognises in tickets (an address each: a few hundred KiB)."""

LEFT_RECENTLY = 60.0
"""Seconds a broker that left the set is still taken, by a pull without a ticket, for the broker its hand-offs were
pushed to. A decoder pulls within seconds of the push; a broker gone longer is no longer anyone's first choice."""

FORCED_READ_EVERY = 1.0
"""The most often a ticket naming an unknown broker makes the client re-read the set before its `refresh` is due
(the broker may have joined since the last read; a stream of forged tickets costs etcd one read a second)."""


class BrokerSet:
    """The live set of brokers, and the brokers that left it."""

    def __init__(self, target: str, refresh: float = 5.0) -> None:
        self._etcd = target if target.startswith("etcd://") else None
        self._dns = target[len("dns:///") :] if target.startswith("dns:///") else None
        self.dynamic = self._dns is not None or self._etcd is not None
        static = [t.strip() for t in target.split(",") if t.strip()] if not self.dynamic else []
        self._refresh = refresh
        self._current: dict[str, str] = dict.fromkeys(static, "")  # address -> its registration
        self._left: dict[str, float] = {}  # address -> when it was seen gone (time.monotonic()), oldest first
        self._read_at = 0.0
        self._forced_at = 0.0
        self._lock = threading.Lock()

    def brokers(self) -> list[str]:
        """The brokers in the set now, sorted."""
        return sorted(self.members())

    def members(self) -> dict[str, str]:
        """Each broker in the set now, with its registration."""
        with self._lock:
            if self.dynamic and (not self._read_at or time.monotonic() - self._read_at >= self._refresh):
                self._read()
            return dict(self._current)

    def read_now(self) -> None:
        """Re-read the set before `refresh` is due (at most every FORCED_READ_EVERY seconds)."""
        with self._lock:
            if self.dynamic and time.monotonic() - self._forced_at >= FORCED_READ_EVERY:
                self._forced_at = time.monotonic()
                self._read()

    def known(self, broker: str) -> bool:
        """Whether the broker is in the set, or was once."""
        with self._lock:
            return broker in self._current or broker in self._left

    def registration(self, broker: str) -> str | None:
        """The broker's current registration; None while it is not in the set."""
        with self._lock:
            return self._current.get(broker)

    def left_recently(self, within: float = LEFT_RECENTLY) -> dict[str, float]:
        """The brokers that left the set less than `within` seconds ago, with how long ago each left."""
        now = time.monotonic()
        with self._lock:
            return {broker: now - at for broker, at in self._left.items() if now - at < within}

    def _read(self) -> None:
        """Read the set (the lock held), and note who left and who came back."""
        first = not self._read_at
        self._read_at = time.monotonic()
        try:
            members = self._etcd_members() if self._etcd else self._dns_members()
        except (BrokerUnavailable, OSError) as e:
            if first:
                raise
            logger.warning("the broker set could not be read (%s); keeping the %d broker(s) last read",
                           e, len(self._current))  # fmt: skip
            return
        now = time.monotonic()
        for gone in self._current.keys() - members.keys():
            self._left.pop(gone, None)
            self._left[gone] = now
            logger.info("broker %s left the set", gone)
        for back in members.keys() & self._left.keys():
            del self._left[back]
        while len(self._left) > MAX_REMEMBERED:
            del self._left[next(iter(self._left))]
        self._current = members

    def _dns_members(self) -> dict[str, str]:
        host, _, port = (self._dns or "").rpartition(":")
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        addresses = {info[4][0] for info in infos}
        return {f"[{a}]:{port}" if ":" in a else f"{a}:{port}": "" for a in addresses}

    def _etcd_members(self) -> dict[str, str]:
        """The addresses registered under the prefix, with their leases, through etcd's HTTP/JSON gateway."""
        try:
            return list_registrations(self._etcd or "")
        except OSError as e:
            where = urlparse(self._etcd or "").netloc
            raise BrokerUnavailable._rebuild(f"etcd at {where} cannot be read: {e}", {}) from None
