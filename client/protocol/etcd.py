"""etcd's documented HTTP/JSON gateway (v3 API), spoken with the standard library: what a broker registers and what a
client lists must agree on the URL, the prefix and the encoding, so both sides use these (handoff_broker/registry.py
registers, _fleet.py lists).
"""

from __future__ import annotations

import base64
import json
import urllib.request
from urllib.parse import urlparse

DEFAULT_PREFIX = "handoff"


def b64(text: str) -> str:
    """A key or value as the gateway takes it."""
    return base64.b64encode(text.encode()).decode()


def parse_etcd_url(url: str) -> tuple[str, str]:
    """`etcd://host:port/prefix` (or http://) into the gateway endpoint and the key prefix."""
    parsed = urlparse(url)
    prefix = parsed.path.strip("/") or DEFAULT_PREFIX
    return f"http://{parsed.netloc}", prefix


def etcd_call(endpoint: str, path: str, body: dict, timeout: float = 3.0) -> dict:
    """One gateway call (`kv/range`, `lease/grant`, ...); OSError when etcd cannot be reached."""
    request = urllib.request.Request(
        f"{endpoint}/v3/{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def list_values(url: str, timeout: float = 3.0) -> list[str]:
    """The values of every key under the URL's prefix, sorted."""
    return sorted(list_registrations(url, timeout))


def list_registrations(url: str, timeout: float = 3.0) -> dict[str, str]:
    """Each value under the URL's prefix (a broker's address) and the lease its key is held under: a broker that
    registers again (restarted, or its lease lapsed) holds its key under a new lease, so a client can tell a new
    registration of the same address from the one it knew."""
    endpoint, prefix = parse_etcd_url(url)
    start = prefix + "/"
    end = prefix + chr(ord("/") + 1)  # every key that starts with the prefix and its slash
    kvs = etcd_call(endpoint, "kv/range", {"key": b64(start), "range_end": b64(end)}, timeout).get("kvs", [])
    return {base64.b64decode(kv["value"]).decode(): str(kv.get("lease", "")) for kv in kvs}
