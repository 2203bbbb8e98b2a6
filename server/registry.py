"""A broker's membership in a fleet through etcd: registered under a prefix with a lease it keeps alive, revoked when
it drains (as Dynamo and Mooncake register their workers). Clients list the prefix (handoff_client/fleet/_members.py).

Speaks etcd's documented HTTP/JSON gateway (v3 API) with the standard library, so the broker needs no etcd client
package: lease/grant, kv/put with the lease, lease/keepalive every third of the TTL, lease/revoke.

The registration is IN the set or OUT of it, and says which through `on_change` (the broker's fleet health and its
`handoff_fleet_registered` gauge):
- IN from the moment its key is put under a live lease, and for as long as a keepalive answered within the lease.
- OUT once the lease has lapsed: etcd answered a keepalive without a TTL (the lease is gone), or no keepalive was
  answered for a whole lease (etcd unreachable: etcd has dropped the key by then). While OUT it tries every third of
  the TTL to take a new lease and put its key again, and is IN again once it has; both changes are logged.
- Stopped: no more keepalives; the lease revoked when draining (the key leaves the set at once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from handoff_client.protocol.etcd import b64, etcd_call, parse_etcd_url

logger = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = 5
STILL_OUT_EVERY = 10.0
"""Seconds between the warnings of a broker still out of its fleet (it tries every third of its lease)."""
START_TIMEOUT = 3.0
"""Seconds the first registration's calls may take (an etcd just started may still be electing its leader)."""

FLEET_HEALTH_SERVICE = "handoff.v1.Fleet"
"""The health service name that says whether the broker is in its fleet's set: SERVING while registered (always,
without --etcd), NOT_SERVING while out of it or draining. For readiness probes; liveness asks "" (the broker
itself), which stays SERVING while it is out, since it still serves what it holds."""


class EtcdRegistration:
    """This broker's key `<prefix>/<address>` under a lease of `ttl` seconds, kept alive until `stop`, and taken
    again under a new lease whenever the one it held lapsed."""

    def __init__(
        self,
        url: str,
        address: str,
        ttl: int = DEFAULT_LEASE_SECONDS,
        on_change: Callable[[bool], None] = lambda registered: None,
    ) -> None:
        self.endpoint, self.prefix = parse_etcd_url(url)
        self.address = address
        self.ttl = ttl
        self.key = f"{self.prefix}/{address}"
        self.registered = False
        self._on_change = on_change
        self._lease: str | None = None
        self._renewed = 0.0  # (time.monotonic() when the last answered keepalive or grant was asked)
        self._out_since = 0.0
        self._said = 0.0  # (seconds out when "still out" was last logged)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def _timeout(self) -> float:
        """Each call's own limit once running: about a keepalive's period, so a hung call (etcd paused, packets
        dropped) never holds up the next one for long."""
        return max(self.ttl / 3, 1.0)

    def start(self) -> None:
        """Register (OSError when etcd cannot be reached: the broker does not start), then keep the lease alive."""
        self._register(timeout=START_TIMEOUT)
        self._thread = threading.Thread(target=self._keep_alive, name="handoff-etcd-lease", daemon=True)
        self._thread.start()
        logger.info("registered as %s in etcd at %s (lease %ss)", self.key, self.endpoint, self.ttl)

    def _register(self, timeout: float | None = None) -> None:
        """A new lease, and the key put under it (so the key no longer depends on any former lease); then IN."""
        asked, timeout = time.monotonic(), timeout or self._timeout
        lease = etcd_call(self.endpoint, "lease/grant", {"TTL": self.ttl}, timeout)["ID"]
        try:
            etcd_call(self.endpoint, "kv/put", {"key": b64(self.key), "value": b64(self.address), "lease": lease},
                      timeout)  # fmt: skip
        except BaseException:
            self._revoke(lease)  # (a lease for a key never put: each retry every third of the TTL would add one)
            raise
        former, self._lease, self._renewed = self._lease, lease, asked
        if former is not None:
            self._revoke(former)  # (it holds no key now; revoked so it does not linger if etcd still had it)
        self._set(True)

    def _revoke(self, lease: str) -> None:
        """Revoke `lease`, as far as etcd can be reached (a lease nobody keeps alive lapses after its TTL anyway)."""
        try:
            etcd_call(self.endpoint, "lease/revoke", {"ID": lease}, self._timeout)
        except OSError:
            pass

    def _set(self, registered: bool) -> None:
        if registered != self.registered:
            self.registered = registered
            self._on_change(registered)

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            if self.registered:
                self._renew()
            if not self.registered and not self._stop.is_set():
                self._register_again()

    def _renew(self) -> None:
        asked = time.monotonic()
        try:
            answer = etcd_call(self.endpoint, "lease/keepalive", {"ID": self._lease}, self._timeout)
            result = answer.get("result")  # (the gateway streams keepalive answers: each in "result", or "error")
            if not isinstance(result, dict):
                raise OSError(f"etcd answered the keepalive with {str(answer)[:200]}")
        except (OSError, ValueError) as e:  # etcd away for a moment: the lease lasts ttl, try again
            if time.monotonic() - self._renewed < self.ttl:
                logger.warning("etcd keepalive failed: %s", e)
                return
            self._lapsed(f"no keepalive was answered for {time.monotonic() - self._renewed:.1f} s ({e})")
            return
        if int(result.get("TTL", 0)) > 0:
            self._renewed = asked
        else:  # etcd answers a keepalive of a lease it no longer has with no TTL
            self._lapsed("etcd answered the keepalive without a TTL")

    def _lapsed(self, why: str) -> None:
        self._out_since, self._said = time.monotonic(), -STILL_OUT_EVERY
        self._set(False)
        logger.warning("out of the fleet: the etcd lease of %s lapsed (%s, lease %ss); registering again",
                       self.key, why, self.ttl)  # fmt: skip

    def _register_again(self) -> None:
        try:
            self._register()
        except (OSError, KeyError, ValueError) as e:
            out = time.monotonic() - self._out_since
            if out >= self._said + STILL_OUT_EVERY:  # (once in a while, not every try)
                self._said = out
                logger.warning("still out of the fleet after %.1f s: etcd at %s: %s", out, self.endpoint, e)
            return
        logger.warning("registered again as %s in etcd at %s after %.1f s out of the fleet (lease %ss)",
                       self.key, self.endpoint, time.monotonic() - self._out_since, self.ttl)  # fmt: skip

    def stop(self, revoke: bool = True) -> None:
        """Stop keeping the lease alive; revoke it (drain: leave the set at once) unless told not to."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if revoke and self._lease is not None:
            try:
                etcd_call(self.endpoint, "lease/revoke", {"ID": self._lease})
                logger.info("left the etcd set (%s)", self.key)
            except OSError as e:
                logger.warning("etcd revoke failed (the lease will lapse in %ss): %s", self.ttl, e)
        self._set(False)
