"""How the client makes its calls: the channel (plaintext or TLS), the message limits, and which failures are
retried, and how (_client.py, _pulls.py and fleet/ use these)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from .protocol.errors import (
    BrokerBusy,
    BrokerUnavailable,
    CallCancelled,
    HandoffError,
    LaneBroken,
    MalformedRequest,
    PushAborted,
)
from .protocol.limits import DEFAULT_PORT, MAX_MESSAGE_BYTES

RECONNECT_BACKOFF_MS = (100, 1000)
"""gRPC's reconnect backoff, first and longest (ms; gRPC adds 20 % jitter): a broker that restarts is reached within
about a second of its coming back. gRPC's defaults (1 s, growing 1.6x to 120 s) kept clients of a broker that was
down for a few seconds away from it for up to 30 s after it was back."""

CONNECT_TIMEOUT_MS = 5000
"""The least time one connection attempt gets (gRPC's `min_reconnect_backoff_ms`, 20 s by default): a broker whose
host went away (its packets dropped, not refused) is known unreachable after this, not after 20 s."""

KEEPALIVE_MS = (2000, 2000)
"""HTTP/2 keepalive while a call is under way: a ping after this long (ms), and the connection given up when its
answer has not come this long after (ms). A broker that stops answering with its sockets still open (frozen, hung,
or behind a partition that drops packets) is known unreachable within about 4 s, and its calls end UNAVAILABLE,
instead of each waiting out its whole timeout; a fleet then goes to the next broker. The broker permits pings this
often (server/app.py, MIN_PING_INTERVAL_MS). Pings continue while no data flows (a pull waiting for its push)."""

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS[0]),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS[1]),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_MS[1]),  # (what gRPC 1.85 waits for a keepalive's answer: 60 s else)
    ("grpc.http2.max_pings_without_data", 0),  # (gRPC stops after 2 by default: a waiting pull would go unwatched)
    ("grpc.keepalive_permit_without_calls", 0),  # (an idle connection costs the broker nothing)
)


def make_channel(
    target: str,
    options: tuple[tuple[str, object], ...] = (),
    credentials: grpc.ChannelCredentials | None = None,
    *,
    tls_root_certificates: bytes | None = None,
    tls_certificate_chain: bytes | None = None,
    tls_private_key: bytes | None = None,
    tls_server_name: str | None = None,
) -> grpc.Channel:
    """A channel to `target`: TLS when given a CA or a client certificate (PEM bytes; mutual TLS with both), or
    `credentials` of any other kind; plaintext otherwise. `tls_server_name` overrides the name checked against the
    broker's certificate. A URL of HTTP (`http://`, `https://`, `grpc://`) is refused, naming the host:port meant:
    gRPC would try to resolve the whole URL as a host name ("Misformatted domain name")."""
    scheme, _, rest = target.partition("://")
    if rest and scheme.lower() in URL_SCHEMES:
        raise MalformedRequest(f"target `{target[:200]}` is a URL: a broker is reached at host:port "
                               f"(`{rest.split('/')[0][:100]}`), a fleet at `a:1,b:2`, `dns:///NAME` or `etcd://...`")  # fmt: skip
    target = with_default_port(target)
    if tls_server_name:
        options += (("grpc.ssl_target_name_override", tls_server_name),)
    if credentials is None and (tls_root_certificates or tls_certificate_chain):
        credentials = grpc.ssl_channel_credentials(tls_root_certificates, tls_private_key, tls_certificate_chain)
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


URL_SCHEMES = ("http", "https", "grpc", "grpcs")
"""What a target is not written with (gRPC's own schemes, `dns:`, `unix:`, `ipv4:`..., are not URLs of these)."""

PLAINTEXT_TO_TLS = "Socket closed"
"""What gRPC says when a plaintext channel reaches a TLS port: the broker closes the connection at its first bytes."""


def tls_hint(error: HandoffError, plaintext: bool) -> HandoffError:
    """`error`, where a plaintext channel could not reach its broker the way it cannot reach one serving TLS, with a
    hint of TLS (the broker logs only an SSL handshake failure, which the caller never sees)."""
    if not (plaintext and type(error) is BrokerUnavailable and PLAINTEXT_TO_TLS in error.message):
        return error
    hint = ("; if the broker serves TLS, this plaintext client cannot reach it: give it the broker's CA "
            "(tls_root_certificates=, or --tls-ca on the command line)")  # fmt: skip
    return BrokerUnavailable._rebuild(error.message + hint, error.fields)


def with_default_port(target: str) -> str:
    """`target` with DEFAULT_PORT added where it names a host and no port: `127.0.0.1`, `broker`, `[::1]`,
    `dns:///brokers`. Other schemes (`unix:`, `ipv4:`, ...) and targets with a port are left as they are."""
    prefix = "dns:///" if target.startswith("dns:///") else ""
    host = target[len(prefix) :]
    if host.startswith("["):  # [v6] or [v6]:port
        has_port = "]:" in host
    elif host.count(":") > 1:  # a bare IPv6 address: a port needs brackets, so none is added
        has_port = True
    else:  # host, host:port, or another scheme's scheme:path
        has_port = ":" in host
    return target if has_port or not host else f"{target}:{DEFAULT_PORT}"


@dataclass(frozen=True)
class RetryPolicy:
    """How the client retries what is safe to retry: exponential backoff with jitter, a bounded number of attempts,
    and never past the call's own timeout.

    Safe: a push that met UNAVAILABLE (the broker drops a broken push at once, and a repeat of a committed one is
    recognised byte for byte and changes nothing); a pull whose stream broke or whose push was aborted (the claim
    goes back to the pool); a confirm (idempotent for its claim); a call refused as BROKER_BUSY (it took nothing).
    Never retried: anything else the broker refused.
    """

    attempts: int = 4
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    multiplier: float = 2.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_backoff
        for _ in range(self.attempts - 1):
            yield random.uniform(delay / 2, delay)
            delay = min(delay * self.multiplier, self.max_backoff)


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(attempts=1)


def retryable_push(error: HandoffError) -> bool:
    """A push is retried only when the broker could not be reached (and is not draining: go elsewhere), was at
    its limit of concurrent work (it took nothing), or its lane broke (the retry goes on the stream)."""
    return type(error) in (BrokerUnavailable, BrokerBusy, LaneBroken)


def retryable_pull(error: HandoffError) -> bool:
    """A pull is retried when its stream (or lane) broke or its push was aborted: the hand-off is, or will be, there
    again; or when the broker was at its limit of concurrent work."""
    return type(error) in (BrokerUnavailable, BrokerBusy, CallCancelled, PushAborted, LaneBroken)
