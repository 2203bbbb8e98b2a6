"""What `serve` (and the client commands) check before anything listens, so that a mistake is one line naming the
flag the user gave, not a library's words after the lanes have started: a file named by a flag that cannot be read,
an address that is no address of this machine, an etcd that does not answer.

Each check returns what is wrong, or raises ManifestError naming the flag and the value; none changes anything.
"""

from __future__ import annotations

import socket
import urllib.error
from pathlib import Path

from handoff_client.protocol.errors import ManifestError

from .registry import START_TIMEOUT


def read_flag_file(flag: str, path: str | None) -> bytes | None:
    """The bytes of the file a flag names (None where the flag is not given); ManifestError naming the flag, the
    path and why when it cannot be read."""
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ManifestError(f"{flag} {path}: {e.strerror or e}") from None


def unlistenable(host: str) -> str | None:
    """Why this machine cannot listen on `host` (not an address, or not one of its own), or None: the address is
    bound once, on a free port, and let go."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        found = socket.getaddrinfo(bare, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        return f"not an address or host name this machine can resolve ({getattr(e, 'strerror', None) or e})"
    family, kind, proto, _, address = found[0]
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(address)
        except OSError as e:
            return f"not an address of this machine: cannot listen on it ({e.strerror or e})"
    return None


def etcd_unreachable(url: str) -> str | None:
    """Why etcd at `url` (`etcd://host:port/prefix`, as --etcd's type has checked it) does not answer its gateway's
    status call, or None. An HTTP error is an answer (an etcd still electing its leader; registration retries)."""
    from handoff_client.protocol.etcd import etcd_call, parse_etcd_url

    endpoint, _ = parse_etcd_url(url)
    try:
        etcd_call(endpoint, "maintenance/status", {}, START_TIMEOUT)
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        return f"etcd does not answer at {endpoint} ({getattr(reason, 'strerror', None) or reason})"
    return None
