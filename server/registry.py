"""A broker's membership in a fleet through etcd: registered under a prefix with a lease it keeps alive, revoked when
it drains (as Dynamo and Mooncake register their workers). Clients list the prefix (handoff_client/_fleet.py).

Speaks etcd's documented HTTP/JSON gateway (v3 API) with the standard library, so the broker needs no etcd client
package: lease/grant, kv/put with the lease, lease/keepalive every third of the TTL, lease/revoke.
"""

from __future__ import annotations

import logging
import threading

from handoff_client._etcd import b64, etcd_call, parse_etcd_url

logger = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = 5


class EtcdRegistration:
    """This broker's key `<prefix>/<address>` under a lease of `ttl` seconds, kept alive until `stop`."""

    def __init__(self, url: str, address: str, ttl: int = DEFAULT_LEASE_SECONDS) -> None:
        self.endpoint, self.prefix = parse_etcd_url(url)
        self.address = address
        self.ttl = ttl
        self.key = f"{self.prefix}/{address}"
        self._lease: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._lease = etcd_call(self.endpoint, "lease/grant", {"TTL": self.ttl})["ID"]
        etcd_call(self.endpoint, "kv/put", {"key": b64(self.key), "value": b64(self.address), "lease": self._lease})
        self._thread = threading.Thread(target=self._keep_alive, name="handoff-etcd-lease", daemon=True)
        self._thread.start()
        logger.info("registered as %s in etcd at %s (lease %ss)", self.key, self.endpoint, self.ttl)

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                etcd_call(self.endpoint, "lease/keepalive", {"ID": self._lease})
            except OSError as e:  # etcd away for a moment: the lease lasts ttl, try again
                logger.warning("etcd keepalive failed: %s", e)

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
