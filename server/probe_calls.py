"""Health and reflection on the broker's main port, open to callers without a token, without letting them take its
threads: at most PROBE_CALLS_LIMIT such health checks, and as many Watch and reflection streams, are open at once;
each waits at most PROBE_FIRST_MESSAGE_SECONDS for its request, and such a stream lives at most PROBE_STREAM_SECONDS.

grpcio's threaded server parks a worker thread on every unary call whose request message has not come, before any
handler runs and with no deadline; a server stream (Watch) or a bidi stream (reflection) holds one as long as it is
open. Health and reflection are open by design (probes have no token), so 300 header-only health checks took all
`--workers` threads, and with them GetStatus, health and every push. Now:

    a caller with a valid token (--tokens)      served as before, not counted (the fleet client and the CLI send
                                                theirs on every call: trusted peers)
    any other caller (every caller, without     takes one of PROBE_CALLS_LIMIT slots when the call is looked up
    --tokens)                                   (on grpcio's poll thread: no worker thread yet), a Check from the
                                                checks' slots, a Watch or reflection stream from the streams' own;
                                                past the limit the call is refused at once, RESOURCE_EXHAUSTED
                                                (BROKER_BUSY, counted), its request unread, taking a moment of a
                                                thread; its streams are cancelled after PROBE_STREAM_SECONDS

Invariant: a slot stands for a worker thread and is given back exactly once, when the call can hold none any more,
however it ends. So every method is registered as request-streaming (grpcio then runs the handler at once, whether
or not the message came, and always runs it: a unary handler never runs for a call cancelled before its message),
and the handler reads the message itself under a watch (server/watchdog.py) that cancels the call if it has not come
in PROBE_FIRST_MESSAGE_SECONDS. Check gives its slot back when its handler returns, however. Watch holds a thread
only while its request is awaited: its handler is non-blocking (grpcio's `experimental_non_blocking`), hands grpc_health
a `send_response_callback` and returns, and its slot goes back when the call ends (`context.add_callback`). Reflection,
a bidi stream grpcio may abandon mid-stream, holds its slot as admission's streams do (`HeldWhileRunning`): until the
call has ended and no thread is inside the handler; a client that stops reading keeps its thread in a send until the
stream's lifetime ends it.

Any peer may still keep the checks' slots taken (a header-only check every few seconds): probes belong on the health
port (server/health_port.py, `--health-port`), which serves health with no thread per call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_status import rpc_status
from handoff_client.protocol.errors import BrokerBusy, HandoffError, to_status

from .admission import Budget, HeldWhileRunning, Slot
from .auth import TokenTable, bearer
from .watchdog import Watchdog

PROBE_CALLS_LIMIT = 8
"""Health checks from callers without a valid token that may be open at once, and as many Watch and reflection
streams (a budget of their own, so streams held open do not refuse checks): a few probes and a grpcurl at a time.
Together at most half of admission's reserve (--workers // 8: 32 at the default 256), so a status with a valid token
and every push keep their threads however many such calls are opened (`probe_calls_limit` for fewer workers)."""
PROBE_FIRST_MESSAGE_SECONDS = 5.0
"""How long such a call may wait for its request message (and a reflection stream for each next one) before it is
cancelled: a probe sends its request with its headers; one that sends none would otherwise hold its thread for ever."""
PROBE_STREAM_SECONDS = 60.0
"""How long a Watch or reflection stream from a caller without a valid token may stay open: then the broker cancels it
(CANCELLED), so no peer holds the streams' slots (or a reflection stream's thread, its client not reading) for ever.
A Watch client opens a new one; a grpcurl session lasts seconds. Token holders' streams are not limited."""
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICES = (reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection")
"""Server reflection under both its names: `v1alpha` (grpcio-reflection's) and `v1`, which newer tools ask for
first. The two protocols' messages are the same on the wire, so one servicer answers both."""


def probe_calls_limit(workers: int) -> int:
    """The checks (and as many streams) a broker of `workers` threads lets callers without a token open:
    PROBE_CALLS_LIMIT, or a quarter of admission's reserve of threads (server/admission.py: workers // 8) where that
    is less, at least 1 (1 at --workers 8, 2 at 64), so checks and streams together take at most half of it."""
    return max(1, min(PROBE_CALLS_LIMIT, workers // 32))


class ProbeCalls(grpc.GenericRpcHandler):
    """The main port's health and reflection handlers, bounded for callers without a valid token (module docstring).
    `budget.taken` is how many such checks hold a slot now, `streams.taken` how many such streams."""

    def __init__(
        self,
        health_servicer: health.HealthServicer,
        reflected: tuple[str, ...],
        tokens: TokenTable | None,
        watchdog: Watchdog,
        on_refusal: Callable[[HandoffError], None],
        limit: int = PROBE_CALLS_LIMIT,
        first_message: float = PROBE_FIRST_MESSAGE_SECONDS,
        stream_seconds: float = PROBE_STREAM_SECONDS,
    ) -> None:
        self._health = health_servicer
        self._reflection = reflection.ReflectionServicer((*reflected, HEALTH_SERVICE, *REFLECTION_SERVICES))
        self._tokens = tokens
        self._watchdog = watchdog
        self._on_refusal = on_refusal
        self._first_message = first_message
        self.stream_seconds = stream_seconds
        self.budget = Budget("health checks without a token open (probes: ask --health-port)", limit)
        self.streams = Budget("health Watch and reflection streams without a token open (probes: ask --health-port)",
                              limit)  # fmt: skip
        self._trusted = Budget("health and reflection calls with a valid token", 1 << 40)  # (never full: not bounded)
        check = (health_pb2.HealthCheckRequest.FromString, health_pb2.HealthCheckResponse.SerializeToString)
        reflect = (reflection_pb2.ServerReflectionRequest.FromString,
                   reflection_pb2.ServerReflectionResponse.SerializeToString)  # fmt: skip
        self._methods: dict[str, tuple[Callable[[Slot, float | None], Callable], bool, tuple[Callable, Callable]]] = {
            f"/{HEALTH_SERVICE}/Check": (self._check, False, check),
            f"/{HEALTH_SERVICE}/Watch": (self._watch, True, check),
            **{f"/{name}/ServerReflectionInfo": (self._reflect, True, reflect) for name in REFLECTION_SERVICES},
        }

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        """Runs on grpcio's poll thread, before any worker thread is given the call."""
        method = self._methods.get(details.method)
        if method is None:
            return None
        behaviour, streaming, (deserialize, serialize) = method
        make = grpc.stream_stream_rpc_method_handler if streaming else grpc.stream_unary_rpc_method_handler
        token = bearer(details.invocation_metadata) if self._tokens is not None else ""
        if token and self._tokens is not None and self._tokens.authenticate(token) is not None:
            slot = self._trusted.take()
            return make(behaviour(slot, None), request_deserializer=deserialize, response_serializer=serialize)
        budget = self.streams if streaming else self.budget
        slot = budget.try_take()
        if slot is None:
            return make(self._refuse(budget))
        lifetime = self.stream_seconds if streaming else None
        return make(behaviour(slot, lifetime), request_deserializer=deserialize, response_serializer=serialize)

    def _refuse(self, budget: Budget) -> Callable:
        """A handler that ends the call with BROKER_BUSY at once, its request unread (counted like every refusal)."""
        error = BrokerBusy(budget.what, budget.limit)
        self._on_refusal(error)
        status = rpc_status.to_status(to_status(error))

        def abort(requests: object, context: grpc.ServicerContext) -> None:
            context.abort_with_status(status)

        return abort

    def _first(self, requests: Iterator[object], context: grpc.ServicerContext) -> object:
        """The call's one request, awaited at most `first_message` seconds (then the call is cancelled, and reading
        it raises); a call that ends without one is INVALID_ARGUMENT."""
        watch = self._watchdog.watch(context.cancel)
        watch.arm(self._first_message)
        try:
            request = next(requests, None)
        finally:
            watch.close()
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a unary call's request message never came")
        return request

    def _limit_life(self, context: grpc.ServicerContext, seconds: float | None) -> None:
        """Cancel the call after `seconds` (None: never), the watch let go of when the call ends."""
        if seconds is None:
            return
        watch = self._watchdog.watch(context.cancel)
        watch.arm(seconds)
        if not context.add_callback(watch.close):
            watch.close()  # (the call has ended already)

    def _check(self, slot: Slot, lifetime: None) -> Callable:
        def check(requests: Iterator[object], context: grpc.ServicerContext) -> object:
            with slot:  # (the handler always runs, and returns or raises: the slot goes back here)
                return self._health.Check(self._first(requests, context), context)

        return check

    def _watch(self, slot: Slot, lifetime: float | None) -> Callable:
        """Non-blocking: reads the request (holding the thread at most `first_message` seconds), hands grpc_health
        grpcio's `send_response_callback` (it sends each status from the thread that sets it) and returns; the slot
        goes back when the call ends."""

        def watch(requests: Iterator[object], context: grpc.ServicerContext, send: Callable[[object], None]) -> None:
            try:
                request = self._first(requests, context)
                self._limit_life(context, lifetime)
                if not context.add_callback(slot.give_back):
                    slot.give_back()  # (the call has ended already)
            except BaseException:
                slot.give_back()
                raise
            self._health.Watch(request, context, send)

        watch.experimental_non_blocking = True  # type: ignore[attr-defined]  (grpcio's flag: no thread while open)
        return watch

    def _reflect(self, slot: Slot, lifetime: float | None) -> Callable:
        def responses(requests: Iterator[object], context: grpc.ServicerContext) -> Iterator[object]:
            self._limit_life(context, lifetime)
            watch = self._watchdog.watch(context.cancel)
            try:
                yield from self._reflection.ServerReflectionInfo(watch.messages(requests, self._first_message), context)
            finally:
                watch.close()

        return self._held(slot, responses)

    @staticmethod
    def _held(slot: Slot, responses: Callable) -> Callable:
        """A server-streaming handler holding `slot` until its call has ended and no thread is inside it."""

        def stream(requests: Iterator[object], context: grpc.ServicerContext) -> Iterator[object]:
            held = HeldWhileRunning(slot, responses(requests, context))
            if not context.add_callback(held.call_ended):
                held.call_ended()  # (the call has ended already)
            return held

        return stream
