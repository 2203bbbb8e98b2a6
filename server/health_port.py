"""The broker's health statuses, told from one place to the main port's health service and to the health port's.

The health port (`--health-port`) serves only `grpc.health.v1.Health` (Check and Watch), in plaintext, from a
grpc.aio server on an event loop of its own (one daemon thread): no call holds a thread, so no number of header-only
checks or open Watch streams can keep its answers from a probe, nor take the main port's worker threads. Kubernetes'
gRPC probes (plaintext only) and the image's HEALTHCHECK ask it. What it tells is only the statuses: "" (the broker
itself), handoff.v1.HandoffBroker and handoff.v1.Fleet (in its fleet's set), SERVING or NOT_SERVING, exactly as the
main port tells them; draining turns every one NOT_SERVING on both at once.

Invariant: every status is set through `Health`, which sets the main port's servicer and the health port's before it
returns, so the two never disagree for longer than a set takes. `HealthPort.close` leaves no port bound and no
thread running, whether the port served or its start failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .sockets import bind_error

T = TypeVar("T")

HEALTH_PORT_MAX_MESSAGE_BYTES = 4096
"""The largest request the health port reads: a HealthCheckRequest is a service name."""
HEALTH_PORT_STREAMS_PER_CONNECTION = 16
"""Concurrent calls one connection to the health port may have (a probe makes one at a time)."""
HEALTH_PORT_MAX_CALLS = 4096
"""Calls the health port serves at once, over all connections (past it, RESOURCE_EXHAUSTED at once): generous for
probes, which make one at a time, but Watch streams over many connections cannot grow its memory without bound."""
HEALTH_PORT_CONNECTION_AGE_SECONDS = 300
"""A connection to the health port is told to go (GOAWAY) after this long, and its calls then end within
HEALTH_PORT_CONNECTION_GRACE_SECONDS: a Watch client reconnects; no stream is held for ever."""
HEALTH_PORT_CONNECTION_GRACE_SECONDS = 30
ServingStatus = health_pb2.HealthCheckResponse.ServingStatus


class HealthPort:
    """A plaintext grpc.aio server of the health service alone, on `host:port` (0: any free one), bound when made,
    serving from `start`; its statuses are set by `Health`."""

    def __init__(self, host: str, port: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="handoff-health-port", daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        try:
            self.servicer, self.port = self._run(self._bind(address))
        except BaseException:
            self.close()
            raise
        if self.port == 0:
            self.close()
            why = bind_error(host, port) or "gRPC could not bind it"
            raise OSError(f"cannot listen for health (--health-port) on {host}:{port}: {why}")

    async def _bind(self, address: str) -> tuple[health.aio.HealthServicer, int]:
        servicer = health.aio.HealthServicer()
        self._server = grpc.aio.server(maximum_concurrent_rpcs=HEALTH_PORT_MAX_CALLS, options=[
            ("grpc.so_reuseport", 0),  # a taken port fails the start, naming it
            ("grpc.max_receive_message_length", HEALTH_PORT_MAX_MESSAGE_BYTES),
            ("grpc.max_concurrent_streams", HEALTH_PORT_STREAMS_PER_CONNECTION),
            ("grpc.max_connection_age_ms", HEALTH_PORT_CONNECTION_AGE_SECONDS * 1000),
            ("grpc.max_connection_age_grace_ms", HEALTH_PORT_CONNECTION_GRACE_SECONDS * 1000),
        ])  # fmt: skip
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self._server)
        try:
            return servicer, self._server.add_insecure_port(address)
        except RuntimeError:  # (grpcio raises "Failed to bind", or returns 0 in older releases)
            return servicer, 0

    def _run(self, work: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run `work` on the port's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout)

    def start(self) -> None:
        assert self._server is not None
        self._run(self._server.start())

    def set(self, service: str, status: ServingStatus) -> None:
        if not self._loop.is_closed():  # (once closed, nothing is told: a second stop, say)
            self._run(self.servicer.set(service, status))

    def enter_graceful_shutdown(self) -> None:
        if not self._loop.is_closed():
            self._run(self.servicer.enter_graceful_shutdown())

    def close(self) -> None:
        """Stop serving (calls in flight cancelled), let go of the port, end the loop's thread. Idempotent."""
        if self._loop.is_closed():
            return
        if self._server is not None:
            server, self._server = self._server, None
            with contextlib.suppress(Exception):  # (stopping as best it can: the loop still ends below)
                self._run(server.stop(None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._thread.is_alive():  # (a callback on the loop never returned: its daemon thread is left to the exit)
            return
        self._loop.close()


class Health:
    """The broker's health statuses, set on the main port's servicer (`servicer`) and on the health port's, if any."""

    def __init__(self, port: HealthPort | None = None) -> None:
        self.servicer = health.HealthServicer()
        self.port = port

    def set(self, service: str, status: ServingStatus) -> None:
        self.servicer.set(service, status)
        if self.port is not None:
            self.port.set(service, status)

    def enter_graceful_shutdown(self) -> None:
        """Every status NOT_SERVING on both ports, for good (draining)."""
        self.servicer.enter_graceful_shutdown()
        if self.port is not None:
            self.port.enter_graceful_shutdown()
