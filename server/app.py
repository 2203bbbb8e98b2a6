"""Assemble a broker: the store, the servicer, health and reflection, on a gRPC server bound to a port.

`build_server(config)` returns a started-able server and the port it bound (port 0 picks a free one, as tests do);
`Broker.stop(grace)` drains: health turns NOT_SERVING, new pushes and claims get UNAVAILABLE, streams in flight get
`grace` seconds to finish.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self, TypeVar

import grpc
from grpc_health.v1 import health_pb2
from handoff_client.memory import trim, tune_allocator
from handoff_client.protocol.contract import Contract
from handoff_client.protocol.lane import DEFAULT_LANE_MIN_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_SHM_LANE_MIN_BYTES
from handoff_client.protocol.limits import DEFAULT_PORT, MAX_MESSAGE_BYTES
from handoff_client.protocol.wire import SERVICE_NAME
from prometheus_client import CollectorRegistry

from .admission import Admission, waiting_windows_budget
from .auth import AuthInterceptor, TokenTable
from .contracts import default_contracts
from .health_port import Health, HealthPort
from .lanes import LaneListener
from .metrics import Metrics, MetricsServer
from .probe_calls import ProbeCalls, probe_calls_limit
from .registry import FLEET_HEALTH_SERVICE, EtcdRegistration
from .restarts import restart_grace
from .rpc import rpc_handler
from .service import HandoffBrokerServicer
from .sockets import bind_error
from .store import Store, StoreConfig, StoreStats
from .watchdog import Watchdog

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_HOST = "127.0.0.1"
ALLOCATOR_ARENAS = 1
"""glibc arenas for the whole broker: one heap, so the pages freed by any thread serve the next frame of any other,
and trimming it when the broker goes idle hands back everything (measured: with more arenas, tens of MiB stayed)."""
ALLOCATOR_MMAP_THRESHOLD = 32 << 20
"""The broker's frames come from its heap, and so reuse its pages, up to this size: glibc's largest on 64-bit, where
a worker's is 8 MiB (handoff_client.memory). A client may send lane frames up to the lane's max_frame_bytes; at
8 MiB, 8 MiB frames were each faulted in afresh and 256 MiB moved at a quarter to a fifth of the rate it did at 32
(2 vCPUs). Not for workers: a decoder tuned with 32 MiB faulted in more pages on some of its pulls."""
STREAM_WINDOW_BYTES = 2 << 20
"""A gRPC stream's HTTP/2 receive window in the broker: what a push's stream may have in flight before the broker
reads it, outside --max-bytes (docs/lifecycle.md, "Memory"). Fixed, without BDP probing: 40 pushes of 32 MiB waiting
for room held 1.28 GiB with it (the transport took in each whole), 1.5 MiB each without. The cost, on the streams only
(a large hand-off takes a lane): a 32 MiB push on loopback took 0.050 s against 0.034, its pull 0.063 against 0.048
(medians of 5, 2 vCPUs); with a 1 MiB window, 0.11 and 0.13."""
MIN_PING_INTERVAL_MS = 1000
"""The most often a client may ping (ms): below the client's keepalive (2 s), so it knows a silent broker in seconds."""
DEFAULT_WORKERS = 256
"""Threads serving calls: each open stream, and each pull waiting for its push, holds one."""


def default_max_bytes(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Half the memory the broker may use: the machine's physical memory, or its container's limit (cgroup v2's
    memory.max, v1's memory.limit_in_bytes) when that is lower — so `docker run -m 2g` holds 1 GiB of hand-offs,
    not half the host's RAM. The other half is room for the Python heap and gRPC's buffers around them."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 8 << 30
    return min(physical, container_memory_limit(cgroup_root) or physical) // 2


def container_memory_limit(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cgroup's memory limit in bytes (v2, then v1); None where there is none or it cannot be read."""
    for file in (cgroup_root / "memory.max", cgroup_root / "memory" / "memory.limit_in_bytes"):
        try:
            text = file.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "no limit" with a number near 2**63; v2 with "max"
            return int(text)
    return None


@dataclass(frozen=True)
class BrokerConfig:
    """Everything a broker is started with."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    contracts: dict[str, Contract] = field(default_factory=default_contracts)
    max_bytes: int = field(default_factory=default_max_bytes)
    ttl: float = 300.0
    lease: float = 30.0
    idle_timeout: float = 30.0
    resume_window: float = 10.0
    trim_after: float = 30.0
    # Port of the Prometheus /metrics endpoint (0: any free port); None: no endpoint. Its address: `host` unless
    # `metrics_host` says otherwise (scrapes from a private network while gRPC listens on a public one, say).
    metrics_port: int | None = None
    metrics_host: str | None = None
    # Port of the health port (server/health_port.py: health alone, plaintext, no thread per call; 0: any free
    # port), on `host`; None: none (health is still served on the main port, bounded: server/probe_calls.py).
    health_port: int | None = None
    workers: int = DEFAULT_WORKERS
    # HTTP/2 keepalive: a decoder whose connection dies without a FIN is noticed and its claim returned.
    keepalive_seconds: float = 20.0
    keepalive_timeout_seconds: float = 10.0
    # Security: PEM bytes of the server's certificate chain and key (TLS), and of the CA that client certificates
    # must chain to (mutual TLS); bearer tokens with roles.
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_client_ca: bytes | None = None
    tokens: TokenTable | None = None
    # Limits on what a client controls.
    # Fleet membership: register in etcd (etcd://host:port/prefix) under the address clients should use.
    etcd: str | None = None
    advertise: str | None = None
    etcd_lease: int = 5
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_streams_per_connection: int = 100
    push_deadline: float = 600.0
    # How long after its start a pull naming another incarnation before its push (a ticket's `e`) waits for that push
    # (server/restarts.py: 2 s, or $HANDOFF_RESTART_GRACE).
    restart_grace: float = field(default_factory=restart_grace)
    # The lanes for bulk bytes (docs/lanes.md), on unless turned off: the TCP lane (its frames sealed while the broker
    # serves TLS), on its port (0: any free one), advertising the host clients should
    # connect to (empty: the one they reached the broker at); the shared-memory lane for clients on this host, on
    # its Unix socket (empty: one in a new private directory); the smallest hand-off moved on each; the most TCP
    # connections one call's lane may be striped over.
    lanes: bool = True
    lane_port: int = 0
    lane_advertise_host: str = ""
    shared_memory_lane: bool = True
    lane_socket: str = ""
    lane_min_bytes: int = DEFAULT_LANE_MIN_BYTES
    shared_memory_lane_min_bytes: int = DEFAULT_SHM_LANE_MIN_BYTES
    lane_max_connections: int = DEFAULT_MAX_CONNECTIONS


class Broker:
    """A running broker: its server, its store, its port."""

    def __init__(self, config: BrokerConfig) -> None:
        # Before gRPC's threads start, so none makes an arena past the cap. Freed hand-off memory is kept mapped, up
        # to the hand-off budget, for the next pushes; the store trims it after --trim-after seconds holding nothing.
        tune_allocator(arenas=ALLOCATOR_ARENAS, keep=config.max_bytes, mmap_threshold=ALLOCATOR_MMAP_THRESHOLD)
        self.config = config
        self.incarnation = secrets.token_hex(8)
        """This process's incarnation: a ticket names it, so a pull after a restart is refused at once (BrokerRestarted)."""
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.store = Store(
            config.contracts,
            StoreConfig(
                config.max_bytes,
                ttl=config.ttl,
                lease=config.lease,
                idle_timeout=config.idle_timeout,
                resume_window=config.resume_window,
                trim_after=config.trim_after,
                push_deadline=config.push_deadline,
            ),
            events=self.metrics,
        )
        self.metrics.watch(self.store.stats)
        self.metrics_port: int | None = None
        self.registration: EtcdRegistration | None = None
        self._metrics_server: MetricsServer | None = None
        self._started = False
        self.health = Health()
        options = [
            # The transport's own bound, above the broker's checked limit so a breach gets a reasoned, counted status.
            ("grpc.max_receive_message_length", 2 * config.max_message_bytes + (1 << 20)),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_concurrent_streams", config.max_streams_per_connection),
            ("grpc.keepalive_time_ms", int(config.keepalive_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_seconds * 1000)),
            ("grpc.http2.ping_timeout_ms", int(config.keepalive_timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            # Clients ping every 2 s while a call is under way (their keepalive): permitted.
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
            ("grpc.so_reuseport", 0),  # a second broker on a taken port must fail, not silently share it
            # Each push stream's bytes in flight, before the broker reads them, are at most its window: a push waiting
            # for room (or its turn) holds STREAM_WINDOW_BYTES outside --max-bytes, not the whole hand-off the window
            # grew to fit (BDP probing, on by default, took in all 32 MiB of each waiting push).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ]
        waiting_pushes = waiting_windows_budget(config.max_bytes) // STREAM_WINDOW_BYTES
        self.admission = Admission.for_workers(config.workers, waiting_pushes)
        tcp_lane = (config.host, config.lane_port) if config.lanes else None
        lane_socket = config.lane_socket if config.lanes and config.shared_memory_lane else None
        # Every port is bound here, before anything serves: one taken fails the start naming it, and none is left open.
        self.lanes = None
        if tcp_lane is not None or lane_socket is not None:
            sealed = config.tls_cert is not None  # the TCP lane's frames as private as the calls (docs/lanes.md)
            self.lanes = LaneListener(  # (its errors name the flag whose port or path it could not take)
                tcp_lane, config.lane_advertise_host, lane_socket, sealed, config.lane_max_connections
            )
        self.watchdog = Watchdog()  # (after the lanes, whose failure to bind would leave its thread running)
        servicer = HandoffBrokerServicer(
            self.store,
            self.metrics,
            self.admission,
            self.watchdog,
            max_message_bytes=config.max_message_bytes,
            idle_timeout=config.idle_timeout,
            lanes=self.lanes,
            lane_min_bytes=config.lane_min_bytes,
            shm_lane_min_bytes=config.shared_memory_lane_min_bytes,
            incarnation=self.incarnation,
        )
        self.restarts = servicer.incarnation  # (its grace runs from start(): when the port serves)
        self.restarts.grace = config.restart_grace
        self.restarts.forget = self.store.cancel  # (a late push of a hand-off refused for its `e`: refused)
        interceptors = [AuthInterceptor(config.tokens, servicer._count_refusal)] if config.tokens else []
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="handoff-rpc"),
            options=options,
            interceptors=interceptors,
        )
        self.probe_calls = ProbeCalls(self.health.servicer, (SERVICE_NAME,), config.tokens, self.watchdog,
                                      servicer._count_refusal, probe_calls_limit(config.workers))  # fmt: skip
        self.server.add_generic_rpc_handlers((rpc_handler(servicer), self.probe_calls))
        address = f"{_bracketed(config.host)}:{config.port}"
        credentials = None
        if config.tls_cert is not None and config.tls_key is not None:
            credentials = grpc.ssl_server_credentials(
                [(config.tls_key, config.tls_cert)],
                root_certificates=config.tls_client_ca,
                require_client_auth=config.tls_client_ca is not None,
            )
        try:  # (grpcio raises "Failed to bind to address", or returns 0 in older releases: the cause is found below)
            if config.tls_cert is not None and config.tls_key is not None:
                self.port = self.server.add_secure_port(address, credentials)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            self._release_ports()
            raise OSError(f"cannot listen for gRPC (--port) on {config.host}:{config.port}: {_why_not(config)}")
        self.health_port: int | None = None
        if config.health_port is not None:
            try:
                self.health.port = HealthPort(config.host, config.health_port)
            except OSError:
                self._release_ports()
                raise
            self.health_port = self.health.port.port
        if config.metrics_port is not None:
            host = config.metrics_host or config.host
            try:
                self._metrics_server = _bound("/metrics (--metrics-port)", host, config.metrics_port,
                                              lambda: MetricsServer(host, config.metrics_port, self.registry))  # fmt: skip
            except OSError:
                self._release_ports()
                raise
            self.metrics_port = self._metrics_server.server_port

    def _release_ports(self) -> None:
        """A start that failed lets go of what it bound."""
        self.server.stop(None)
        if self.lanes is not None:
            self.lanes.close()
        if self.health.port is not None:
            self.health.port.close()
        self.watchdog.stop()

    @property
    def address(self) -> str:
        return f"{_bracketed(self.config.host)}:{self.port}"

    def start(self) -> Broker:
        self._started = True
        if self._metrics_server is not None:
            self._metrics_server.serve_in_background()
            host = self.config.metrics_host or self.config.host
            logger.info("metrics on http://%s:%d/metrics", _bracketed(host), self.metrics_port)
        self.store.on_idle = trim
        self.store.start()
        if self.lanes is not None:
            self.lanes.start()
            if self.lanes.port is not None:
                logger.info("TCP lane on %s:%d", _bracketed(self.config.host), self.lanes.port)
            if self.lanes.socket_path is not None:
                logger.info("shared-memory lane on %s", self.lanes.socket_path)
        self.server.start()
        self.restarts.start()
        if self.health.port is not None:
            self.health.port.start()
            logger.info("health on %s:%d (plaintext: statuses only)", _bracketed(self.config.host), self.health_port)
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._in_fleet(not self.config.etcd)  # (with --etcd: out until registered)
        if self.config.etcd:
            self.registration = EtcdRegistration(
                self.config.etcd, self.config.advertise or self.address, self.config.etcd_lease, self._in_fleet
            )
            self.registration.start()
        tls = "mutual TLS" if self.config.tls_client_ca else "TLS" if self.config.tls_cert else "no TLS"
        tokens = "bearer tokens" if self.config.tokens else "no tokens"
        if not self.config.tls_cert and not self.config.tokens:
            logger.warning(
                "open: %s and %s; anyone who can reach %s may push, pull and cancel", tls, tokens, self.address
            )
        else:
            logger.info("secured with %s and %s", tls, tokens)
        logger.info(
            "serving %s on %s; %d bytes for hand-offs; ttl %ss, lease %ss",
            ", ".join(sorted(self.config.contracts)),
            self.address,
            self.config.max_bytes,
            self.config.ttl,
            self.config.lease,
        )
        return self

    def _in_fleet(self, registered: bool) -> None:
        """Whether the broker is in its fleet's set, told to probes (FLEET_HEALTH_SERVICE) and to Prometheus."""
        serving = health_pb2.HealthCheckResponse.SERVING if registered else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(FLEET_HEALTH_SERVICE, serving)
        self.metrics.fleet_registered.set(int(registered))

    def stop(self, grace: float = 5.0) -> StoreStats:
        """Drain, give streams in flight `grace` seconds, stop; the stats of what was still held.

        While draining the server still takes calls: new pushes, and pulls of hand-offs it does not hold, get
        UNAVAILABLE (DRAINING) and health says NOT_SERVING, so clients and probes go elsewhere; pushes in flight
        finish, and decoders pull and confirm what it holds. It stops when it is empty or `grace` has passed.
        """
        if self.registration is not None:
            self.registration.stop(revoke=True)  # leave the fleet first: clients stop choosing this broker
        self._in_fleet(False)
        self.health.enter_graceful_shutdown()
        self.store.drain()
        self.store.settled(grace)
        self.server.stop(0.2).wait()
        if self.lanes is not None:
            self.lanes.close()
        if self.health.port is not None:
            self.health.port.close()  # (after the main port: probes saw NOT_SERVING while it drained)
        self.watchdog.stop()
        self.store.close()
        if self._metrics_server is not None:
            if self._started:
                self._metrics_server.shutdown()  # (it waits for a serving loop: only once one ran)
            self._metrics_server.server_close()
        stats = self.store.stats()
        logger.info(
            "stopped; %d hand-off(s) (%d bytes) were still held",
            stats.receiving + stats.ready + stats.claimed,
            stats.resident_bytes,
        )
        return stats

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=0.5)


def build_server(config: BrokerConfig) -> tuple[Broker, int]:
    """A broker bound to its port, not yet started (the port is useful when `config.port` is 0)."""
    broker = Broker(config)
    return broker, broker.port


def _bound(what: str, host: str, port: int, bind: Callable[[], T]) -> T:
    """`bind()`, its failure an OSError that names what could not listen, and where."""
    try:
        return bind()
    except OSError as e:
        raise OSError(f"cannot listen for {what} on {host}:{port}: {e.strerror or e}") from None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _why_not(config: BrokerConfig) -> str:
    """Why gRPC could not listen on the configured address ("Address already in use", ...); the TLS material when
    the address itself is free."""
    why = bind_error(config.host, config.port)
    if why is not None:
        return why
    if config.tls_cert is not None:
        return "gRPC refused the TLS certificate or key (--tls-cert, --tls-key, --tls-client-ca)"
    return "gRPC could not bind it (GRPC_VERBOSITY=debug says why)"
