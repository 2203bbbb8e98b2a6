"""The gRPC face of the store: proto in, domain calls, proto out, and every error mapped to a status here, once.

The servicer's methods are the .proto's RPCs by name; server/rpc.py registers them from the service descriptor and
maps what they raise to statuses.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator

import grpc
from handoff_client.protocol.errors import (
    MAX_FIELD_CHARS,
    BrokerBusy,
    HandoffError,
    LaneBroken,
    MalformedRequest,
    MessageTooLarge,
    WaitTimedOut,
    bounded,
)
from handoff_client.protocol.frames import ChunkFrame
from handoff_client.protocol.lane import OPENING_TIMEOUT
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import Malformed, contract_to_proto, shard_from_proto

from .admission import Admission, HeldWhileRunning
from .auth import authorize_lanes, authorize_model, may_see
from .lane_calls import (
    LaneCall,
    check_lane_request,
    lane_for_pull,
    lane_offers,
    received_chunks,
    send_chunks,
    send_lane_end,
)
from .lanes import LaneListener
from .metrics import Metrics
from .pull_stream import PullProgress, audit_stream, pull_header
from .restarts import Incarnation
from .rpc import mapped, mapped_stream
from .store import Store
from .watchdog import Watchdog

logger = logging.getLogger(__name__)

MAX_WAIT_SECONDS = 300.0
"""The longest a pull waits for its push, or a push for room, when the caller set no deadline."""

DEADLINE_MARGIN = 0.05
"""Seconds before the caller's deadline at which a wait gives up, so the caller hears why rather than a bare
DEADLINE_EXCEEDED."""


def _wait_budget(context: grpc.ServicerContext) -> float:
    remaining = context.time_remaining()
    if remaining is None:
        return MAX_WAIT_SECONDS
    return max(0.0, min(remaining - DEADLINE_MARGIN, MAX_WAIT_SECONDS))


class HandoffBrokerServicer:
    """The RPCs of handoff.v1.HandoffBroker."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        admission: Admission,
        watchdog: Watchdog,
        *,
        max_message_bytes: int = 64 << 20,
        idle_timeout: float = 30.0,
        lanes: LaneListener | None = None,
        lane_min_bytes: int = 0,
        shm_lane_min_bytes: int = 0,
        incarnation: str = "",
    ) -> None:
        self.store = store
        # Said by PushResponse, StatusResponse and LanesResponse; a pull naming another is refused (restarts.py).
        self.incarnation = Incarnation(incarnation)
        self.metrics = metrics
        self.admission = admission
        self.watchdog = watchdog
        self.max_message_bytes = max_message_bytes
        self.idle_timeout = idle_timeout
        # How long a call waits for its lane's connections once it needs them: the opening deadline, which the client
        # keeps too, so both give a lane that cannot open up at once and the bytes go on the stream.
        self._opening_timeout = min(idle_timeout, OPENING_TIMEOUT)
        self.lanes = lanes
        # What GetLanes and each pull's header offer: fixed for the broker's life, as its listeners are.
        self.offers = [] if lanes is None else lane_offers(lanes, lane_min_bytes, shm_lane_min_bytes, max_message_bytes)

    def _model_label(self, model: str | None) -> str:
        """A model label from the fixed set served; anything a caller made up is "unknown" (bounded cardinality)."""
        return model if model in self.store.contracts else "unknown"

    def _refused(self, rpc: str, error: HandoffError) -> None:
        logger.info("%s refused: %s %s", rpc, error.reason, error.message)
        self._count_refusal(error)

    def _count_refusal(self, error: HandoffError) -> None:
        self.metrics.rejections.labels(self._model_label(error.model), error.reason).inc()

    @mapped
    def ListContracts(
        self, request: pb.ListContractsRequest, context: grpc.ServicerContext
    ) -> pb.ListContractsResponse:
        models = [m for m in sorted(self.store.contracts) if may_see(m)]
        return pb.ListContractsResponse(contracts=[contract_to_proto(self.store.contracts[m]) for m in models])

    @mapped
    def GetContract(self, request: pb.GetContractRequest, context: grpc.ServicerContext) -> pb.Contract:
        authorize_model(request.model)
        return contract_to_proto(self.store.contract(request.model))

    @mapped
    def PushHandoff(self, requests: Iterator[object], context: grpc.ServicerContext) -> pb.PushResponse:
        """A stream slot for the call's life; a client silent for `idle_timeout` (before its header or after) has
        its call cancelled by the watchdog."""
        with self.admission.streams.take():
            watch = self.watchdog.watch(context.cancel)
            try:
                return self._push(watch.messages(requests, self.idle_timeout), context)
            finally:
                watch.close()

    def _push(self, requests: Iterator[object], context: grpc.ServicerContext) -> pb.PushResponse:
        header = next(requests, None)
        if not isinstance(header, pb.PushHeader):
            why = header.why if isinstance(header, Malformed) else "a push must start with its header"
            raise MalformedRequest(why)
        authorize_model(header.model)
        lane = None
        if header.lane_capability:
            if self.lanes is None:
                raise LaneBroken(header.model, "this broker offers no lane (GetLanes lists none): push on the stream")
            lane = LaneCall(self.lanes, header.lane_capability, header.model, header.lane_connections)
            context.add_callback(lane.interrupt)  # a call that ends (its client gone) ends its lane too

        def interrupt() -> None:
            context.cancel()
            if lane is not None:
                lane.interrupt()

        started = time.monotonic()
        model = self._model_label(header.model)
        outcome = "refused"
        self.metrics.streams.labels("push").inc()
        try:
            waiting = None if header.no_wait else self.admission.waiting_for_room()
            try:  # past the waiting budgets, a push short of room is refused at once instead of waiting
                session = self.store.begin_push(
                    header.model,
                    header.handoff_id,
                    header.position,
                    header.fingerprint,
                    wait=_wait_budget(context),
                    ttl=header.ttl_seconds,
                    no_wait=waiting is None,
                    interrupt=interrupt,
                    is_active=context.is_active,
                    resumable=header.resumable,
                    resume=header.resume,
                    shard=shard_from_proto(header.model, header),
                )
            finally:
                if waiting is not None:
                    waiting.give_back()
            try:
                if lane is not None:
                    frames = lane.open(self._opening_timeout, session.contract.nbytes, "push")
                    for chunk in received_chunks(frames, session.contract, header.model, self.idle_timeout,
                                                 self.max_message_bytes, session.check_frame):  # fmt: skip
                        session.add(chunk)
                for message in requests:  # (after a lane, nothing more may come)
                    if lane is not None:
                        raise MalformedRequest("a push on a lane sends nothing on the stream but its header")
                    if isinstance(message, ChunkFrame):
                        if len(message.frame) > self.max_message_bytes:
                            raise MessageTooLarge(header.model, len(message.frame), self.max_message_bytes)
                        session.add(message)
                    elif isinstance(message, Malformed):
                        raise MalformedRequest(message.why, header.model)
                    else:
                        raise MalformedRequest("a push has one header; a second one came", header.model)
                if header.resumable and not session.complete:
                    # grpcio can end a broken client stream as if it had closed cleanly: a resumable push that
                    # ends short is kept for its resume either way (and a live caller still hears what is missing).
                    session.suspend()
                result = session.finish()
            except (grpc.RpcError, LaneBroken):
                session.suspend()  # the stream broke: a resumable push waits for its retry, any other is freed
                raise
            except BaseException:
                session.abort()
                raise
            outcome = "duplicate" if result.duplicate else "committed"
        except grpc.RpcError:
            outcome = "broken"
            raise
        except HandoffError as e:  # every refusal of a push names its hand-off, as the .proto promises
            outcome = "broken" if isinstance(e, LaneBroken) else outcome
            e.fields.setdefault("handoff_id", bounded(header.handoff_id, MAX_FIELD_CHARS))
            raise
        finally:
            if lane is not None:
                lane.close()
            self.metrics.streams.labels("push").dec()
            self.metrics.pushes.labels(model, outcome).inc()
        elapsed = time.monotonic() - started
        self.metrics.bytes_in.labels(model).inc(result.bytes)
        if lane is not None:
            self.metrics.lane_bytes.labels(model, "push", lane.kind).inc(result.bytes)
        self.metrics.push_seconds.labels(model).observe(elapsed)
        logger.info(
            "push %s/%s %s: %d bytes in %d chunks%s, %.1f ms", header.model, header.handoff_id, outcome,
            result.bytes, result.chunks, f" on its {lane.kind} lane" if lane else "", elapsed * 1000,
        )  # fmt: skip
        return pb.PushResponse(
            handoff_id=header.handoff_id,
            bytes=result.bytes,
            chunks=result.chunks,
            digest=result.digest,
            duplicate=result.duplicate,
            incarnation=self.incarnation.value,
        )

    @mapped_stream
    def PullHandoff(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        authorize_model(request.model)
        self.incarnation.refuse_now(request)  # a ticket's `n` of another incarnation (before it may wait for a push)
        progress = PullProgress()
        # The stream slot is held while the call may hold a thread: given back once the call has ended and no thread
        # runs its handler (a generator grpcio abandons mid-send is closed only when collected), never before.
        held = HeldWhileRunning(
            self.admission.streams.take(request.model), self._pull_stream(request, context, progress)
        )
        progress.held = held
        # In flight from its admission, a pull waiting for its push included, until its stream slot is given back.
        self.metrics.streams.labels("pull").inc()
        held.on_release(self.metrics.streams.labels("pull").dec)
        if not context.add_callback(held.call_ended):  # the caller is already gone
            held.close()
            return iter(())
        return held

    def _pull_stream(
        self, request: pb.PullRequest, context: grpc.ServicerContext, progress: PullProgress
    ) -> Iterator[bytes]:
        try:
            if self.lanes is not None and request.lane_capability:  # checked now; registered if a lane is offered
                check_lane_request(self.lanes, request.lane_capability, request.lane_connections, request.model)
            yield from self._pull(request, context, progress)
        finally:
            if progress.lane is not None:
                progress.lane.close()

    def _pull(self, request: pb.PullRequest, context: grpc.ServicerContext, progress: PullProgress) -> Iterator[bytes]:
        if not (math.isfinite(request.wait_seconds) and request.wait_seconds >= 0):
            raise MalformedRequest(f"wait_seconds must be finite and >= 0, got {request.wait_seconds!r}", request.model)
        wait = _wait_budget(context)
        if request.wait_seconds:
            wait = min(wait, request.wait_seconds)
        wait, restarted = self.incarnation.wait_for(request, wait)  # a ticket's `e` of another one (restarts.py)
        if request.audit:  # a read that claims nothing (pull_stream.audit_stream)
            shard = shard_from_proto(request.model, request)
            yield from audit_stream(self.store, request, shard, wait, context, self.admission.waiting)
            return

        def interrupt() -> None:  # a stream whose end is on its way has nothing left to cut short
            if not progress.ending:
                context.cancel()
                if progress.lane is not None:
                    progress.lane.interrupt()

        waiting = self.admission.waiting.try_take()
        try:  # past the waiting budget, a pull whose push has not begun is refused at once instead of waiting
            claim = self.store.claim(
                request.model,
                request.handoff_id,
                wait if waiting is not None else 0.0,
                context.is_active,
                interrupt=interrupt,
                supersedes=request.supersedes,
                shard=shard_from_proto(request.model, request),
            )
        except WaitTimedOut as e:
            self.metrics.pulls.labels(self._model_label(request.model), "refused").inc()
            if restarted and (waiting is not None or not wait):  # (its grace over; else it was only busy)
                raise self.incarnation.restarted(request) from e
            if waiting is None:
                budget = self.admission.waiting
                raise BrokerBusy(budget.what, budget.limit, request.model) from e
            raise
        except HandoffError:
            self.metrics.pulls.labels(self._model_label(request.model), "refused").inc()
            raise
        finally:
            if waiting is not None:
                waiting.give_back()
        started = time.monotonic()
        model = self._model_label(claim.model)

        def ended() -> None:  # however the call ends: a stream broken before its end returns the claim at once
            self.store.release(claim, progress.sent_all)
            self.metrics.pulls.labels(model, "delivered" if progress.sent_all else "broken").inc()

        if not context.add_callback(ended):  # the caller is already gone: the claim goes back at once
            ended()
            return
        offer = None
        if self.lanes is not None and request.lane_capability:
            offer = lane_for_pull(self.offers, request.lane_kind, claim.nbytes)
            if offer is not None:  # registered before the header names it: the client's opening finds it at once
                lane = LaneCall(self.lanes, request.lane_capability, request.model, request.lane_connections)
                progress.lane = lane
                context.add_callback(lane.interrupt)  # a call that ends (its client gone) ends its lane too
        yield pull_header(claim, request.shard, offer)
        frames = progress.lane.open(self._opening_timeout, claim.nbytes, "pull") if progress.lane is not None else None
        fed = 0
        while True:
            chunks, digest = self.store.feed(claim, fed, _wait_budget(context))
            if frames is not None:
                for _ in send_chunks(frames, chunks, claim.model):
                    self.store.note_streamed(claim)
            else:
                for chunk in chunks:
                    yield chunk.frame if isinstance(chunk.frame, bytes) else bytes(chunk.frame)  # (pushed on a lane)
                    self.store.note_streamed(claim)
            fed += len(chunks)
            if digest is not None:
                break
        if frames is not None:
            send_lane_end(frames, claim.model)
        progress.ending = True
        yield pb.PullResponse(end=pb.PullEnd(digest=digest)).SerializeToString()
        progress.sent_all = True
        elapsed = time.monotonic() - started
        self.metrics.bytes_out.labels(model).inc(claim.nbytes)
        if progress.lane is not None:
            self.metrics.lane_bytes.labels(model, "pull", progress.lane.kind).inc(claim.nbytes)
        self.metrics.pull_seconds.labels(model).observe(elapsed)
        on_lane = f" on its {progress.lane.kind} lane" if progress.lane is not None else ""
        logger.info(
            "pull %s/%s streamed to claim %d: %d bytes%s, %.1f ms",
            claim.model, claim.handoff_id, claim.generation, claim.nbytes, on_lane, elapsed * 1000,
        )  # fmt: skip

    @mapped
    def ConfirmHandoff(self, request: pb.ConfirmRequest, context: grpc.ServicerContext) -> pb.ConfirmResponse:
        authorize_model(request.model)
        self.store.confirm(request.model, request.handoff_id, request.claim, shard_from_proto(request.model, request))
        logger.info("confirmed %s/%s by claim %d", request.model, request.handoff_id, request.claim)
        return pb.ConfirmResponse()

    @mapped
    def CancelHandoff(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelResponse:
        authorize_model(request.model)
        cancelled = self.store.cancel(request.model, request.handoff_id)
        logger.info("cancel %s/%s: %s", request.model, request.handoff_id, "freed" if cancelled else "nothing held")
        return pb.CancelResponse(cancelled=cancelled)

    @mapped
    def GetStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        stats = self.store.stats()
        return pb.StatusResponse(
            receiving=stats.receiving,
            ready=stats.ready,
            claimed=stats.claimed,
            resident_bytes=stats.resident_bytes,
            max_bytes=stats.max_bytes,
            oldest_seconds=stats.oldest_seconds,
            tombstones=stats.tombstones,
            draining=stats.draining,
            incarnation=self.incarnation.value,
            contracts=[contract_to_proto(self.store.contracts[m]) for m in sorted(self.store.contracts) if may_see(m)],
        )

    @mapped
    def GetLanes(self, request: pb.LanesRequest, context: grpc.ServicerContext) -> pb.LanesResponse:
        authorize_lanes(request.model)
        return pb.LanesResponse(lanes=self.offers, incarnation=self.incarnation.value)

    @mapped
    def GetPushProgress(self, request: pb.PushProgressRequest, context: grpc.ServicerContext) -> pb.PushProgress:
        authorize_model(request.model)
        committed, position, ranges = self.store.progress(
            request.model, request.handoff_id, shard_from_proto(request.model, request)
        )
        tensors = [
            pb.TensorProgress(tensor=name, received=[pb.ByteRange(offset=o, length=n) for o, n in held])
            for name, held in ranges
            if held
        ]
        return pb.PushProgress(tensors=tensors, complete=committed, position=position)
