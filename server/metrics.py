"""Every metric the broker exports, defined here once, on an injected registry.

Names follow Prometheus conventions: a `handoff_` prefix, base units with unit suffixes (`_bytes`, `_seconds`),
`_total` on counters. Labels come from small fixed sets — the model (one per contract served), an outcome, an
error reason (the ErrorReason enum), a stream kind — and never an id, so cardinality stays bounded.

Gauges of what the store holds are read from it at scrape time rather than kept in step by hand.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from .store import StoreStats

DURATION_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
)  # fmt: skip
"""From a 64 KiB hand-off on loopback (a fraction of a millisecond) to a 70B model's at 32k context (tens of s)."""


class Metrics:
    """The broker's metrics; the store and the servicer call these as things happen."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.pushes = Counter(
            "handoff_pushes_total", "Pushes by how they ended: committed, duplicate, refused, broken.",
            ["model", "outcome"], registry=registry,
        )  # fmt: skip
        self.pulls = Counter(
            "handoff_pulls_total", "Pull streams by how they ended: delivered, refused, broken.",
            ["model", "outcome"], registry=registry,
        )  # fmt: skip
        self.rejections = Counter(
            "handoff_rejections_total",
            "Calls refused, by the ErrorReason sent.",
            ["model", "reason"],
            registry=registry,
        )
        self.bytes_in = Counter(
            "handoff_received_bytes_total", "Tensor bytes received in pushes.", ["model"], registry=registry
        )
        self.bytes_out = Counter(
            "handoff_sent_bytes_total", "Tensor bytes sent in pulls.", ["model"], registry=registry
        )
        self.lane_bytes = Counter(
            "handoff_lane_bytes_total",
            "Tensor bytes moved on a lane instead of a stream (of those received and sent), by kind (push: received, "
            "pull: sent) and lane (tcp, shm).",
            ["model", "kind", "lane"],
            registry=registry,
        )
        self.confirms = Counter(
            "handoff_confirms_total", "Hand-offs confirmed by their decoder.", ["model"], registry=registry
        )
        self.expiries = Counter(
            "handoff_expired_total", "Hand-offs that expired unclaimed, memory freed.", ["model"], registry=registry
        )
        self.lease_returns = Counter(
            "handoff_lease_returns_total", "Claims ended without a confirm (broken, stalled, lapsed): back to the pool.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.cancels = Counter(
            "handoff_cancelled_total", "Hand-offs cancelled by the router.", ["model"], registry=registry
        )
        self.resharded_bytes = Counter(
            "handoff_resharded_bytes", "Bytes copied to cut hand-offs into another tensor-parallel size's shards "
            "(heads that move between ranks; frames that match are forwarded, not counted).", ["model"],
            registry=registry,
        )  # fmt: skip
        self.push_seconds = Histogram(
            "handoff_push_duration_seconds", "From a push's header to its commit.", ["model"],
            buckets=DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.pull_seconds = Histogram(
            "handoff_pull_duration_seconds", "From a pull's claim to the end of its stream.", ["model"],
            buckets=DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.wait_seconds = Histogram(
            "handoff_wait_for_decoder_seconds", "From a hand-off's commit to its (first) claim.", ["model"],
            buckets=DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.end_to_end_seconds = Histogram(
            "handoff_end_to_end_seconds", "From a push's header to its decoder's confirm.", ["model"],
            buckets=DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.streams = Gauge(
            "handoff_streams_in_flight", "Push and pull streams open now.", ["kind"], registry=registry
        )
        self.fleet_registered = Gauge(
            "handoff_fleet_registered",
            "1 while the broker is in its fleet's set (registered in etcd under a live lease; always, without "
            "--etcd); 0 while it is out of it: its lease lapsed and it has not registered again yet, or it drains.",
            registry=registry,
        )
        for kind in ("push", "pull"):
            self.streams.labels(kind)
        # What runs, as handoff_build_info{version, python, grpc} = 1, and the process's own RSS, CPU seconds and open
        # files (process_resident_memory_bytes, process_cpu_seconds_total, process_open_fds, ...: Linux's /proc), so
        # an operator watches RSS against the container's memory limit beside handoff_resident_bytes.
        Info("handoff_build", "The broker's release and what it runs on.", registry=registry).info(build_labels())
        ProcessCollector(registry=registry)

    def watch(self, stats: Callable[[], StoreStats]) -> None:
        """Export what the store holds, read at each scrape."""
        self.registry.register(_StoreCollector(stats))

    # -- what the store reports -----------------------------------------------------------------------------------

    def expired(self, model: str) -> None:
        self.expiries.labels(model).inc()

    def lease_returned(self, model: str) -> None:
        self.lease_returns.labels(model).inc()

    def cancelled(self, model: str) -> None:
        self.cancels.labels(model).inc()

    def claimed(self, model: str, waited: float | None) -> None:
        if waited is not None:
            self.wait_seconds.labels(model).observe(waited)

    def resharded(self, model: str, copied: int) -> None:
        self.resharded_bytes.labels(model).inc(copied)

    def confirmed(self, model: str, since_push: float) -> None:
        self.confirms.labels(model).inc()
        self.end_to_end_seconds.labels(model).observe(since_push)


def build_labels() -> dict[str, str]:
    """handoff_build_info's labels: this release, the Python and the grpcio it runs on."""
    import platform
    from importlib import metadata

    from handoff_client import __version__

    return {"version": __version__, "python": platform.python_version(), "grpc": metadata.version("grpcio")}


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._stats()
        held = GaugeMetricFamily("handoff_held", "Hand-offs held now, by state.", labels=["state"])
        for state, count in (("receiving", s.receiving), ("ready", s.ready), ("claimed", s.claimed)):
            held.add_metric([state], count)
        yield held
        yield GaugeMetricFamily(
            "handoff_resident_bytes", "Bytes reserved by the hand-offs held.", value=s.resident_bytes
        )
        yield GaugeMetricFamily(
            "handoff_capacity_bytes", "The most the broker may hold (--max-bytes).", value=s.max_bytes
        )
        yield GaugeMetricFamily("handoff_oldest_seconds", "Age of the oldest hand-off held.", value=s.oldest_seconds)
        yield GaugeMetricFamily("handoff_draining", "1 while the broker drains.", value=float(s.draining))


class MetricsServer(ThreadingHTTPServer):
    """/metrics over HTTP with bounded concurrency: at most `limit` connections are served at once (more are
    closed at once), and a connection that sends nothing for `timeout` seconds is dropped, so half-sent requests
    cannot pile up threads (prometheus_client's own server starts a thread per connection, with no timeout)."""

    daemon_threads = True

    def __init__(self, host: str, port: int, registry: CollectorRegistry, limit: int = 8, timeout: float = 5.0) -> None:
        handler = type("Handler", (MetricsHandler.factory(registry),), {"timeout": timeout})
        handler.log_message = lambda *args: None  # type: ignore[method-assign]  # (scrapes are not news)
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), handler)
        self._slots = threading.BoundedSemaphore(limit)

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # at the limit: refuse rather than queue a thread
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def serve_in_background(self) -> MetricsServer:
        threading.Thread(target=self.serve_forever, name="handoff-metrics", daemon=True).start()
        return self
