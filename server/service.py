"""The gRPC face of the store: proto in, domain calls, proto out, and every error mapped to a status here, once.

The servicer's methods are the .proto's RPCs by name; `rpc_handler` registers them from the service descriptor, with
the fast chunk codec (handoff_client/_frames.py) on the two streaming RPCs and the generated classes elsewhere.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator

import grpc
from google.protobuf import message_factory
from grpc_status import rpc_status

from handoff_client._errors import HandoffError, InternalError, MalformedRequest, to_status
from handoff_client._frames import ChunkFrame
from handoff_client._proto import handoff_pb2 as pb
from handoff_client._wire import SERVICE, Malformed, contract_to_proto, decode_push_request, identity

from .store import Claim, Store

logger = logging.getLogger(__name__)

MAX_WAIT_SECONDS = 300.0
"""The longest a pull waits for its push, or a push for room, when the caller set no deadline."""

DEADLINE_MARGIN = 0.05
"""Seconds before the caller's deadline at which a wait gives up, so the caller hears why rather than a bare
DEADLINE_EXCEEDED."""


def _abort(context: grpc.ServicerContext, error: HandoffError) -> None:
    context.abort_with_status(rpc_status.to_status(to_status(error)))


def _mapped(method: Callable) -> Callable:
    """Turn our errors into their statuses and anything else into a logged INTERNAL, for a unary-response RPC."""

    @functools.wraps(method)
    def handler(self: HandoffBrokerServicer, request: object, context: grpc.ServicerContext) -> object:
        try:
            return method(self, request, context)
        except HandoffError as e:
            _log_refusal(method.__name__, e)
            _abort(context, e)
        except grpc.RpcError:  # the client went away mid-stream; nobody is left to tell
            logger.info("%s: the client's stream broke", method.__name__)
            context.abort(grpc.StatusCode.CANCELLED, "the client's stream broke")
        except Exception:
            logger.exception("%s failed", method.__name__)
            _abort(context, InternalError())
        return None  # not reached: abort raises

    return handler


def _mapped_stream(method: Callable) -> Callable:
    """As `_mapped`, for a server-streaming RPC: errors raised while streaming end the stream with their status."""

    @functools.wraps(method)
    def handler(self: HandoffBrokerServicer, request: object, context: grpc.ServicerContext) -> Iterator[object]:
        try:
            yield from method(self, request, context)
        except HandoffError as e:
            _log_refusal(method.__name__, e)
            _abort(context, e)
        except Exception:
            logger.exception("%s failed", method.__name__)
            _abort(context, InternalError())

    return handler


def _log_refusal(rpc: str, error: HandoffError) -> None:
    logger.info("%s refused: %s %s", rpc, error.reason, error.message)


def _wait_budget(context: grpc.ServicerContext) -> float:
    remaining = context.time_remaining()
    if remaining is None:
        return MAX_WAIT_SECONDS
    return max(0.0, min(remaining - DEADLINE_MARGIN, MAX_WAIT_SECONDS))


class HandoffBrokerServicer:
    """The RPCs of handoff.v1.HandoffBroker."""

    def __init__(self, store: Store) -> None:
        self.store = store

    @_mapped
    def ListContracts(self, request: pb.ListContractsRequest, context: grpc.ServicerContext) -> pb.ListContractsResponse:
        contracts = [contract_to_proto(self.store.contracts[m]) for m in sorted(self.store.contracts)]
        return pb.ListContractsResponse(contracts=contracts)

    @_mapped
    def GetContract(self, request: pb.GetContractRequest, context: grpc.ServicerContext) -> pb.Contract:
        return contract_to_proto(self.store.contract(request.model))

    @_mapped
    def PushHandoff(self, requests: Iterator[object], context: grpc.ServicerContext) -> pb.PushResponse:
        header = next(requests, None)
        if not isinstance(header, pb.PushHeader):
            why = header.why if isinstance(header, Malformed) else "a push must start with its header"
            raise MalformedRequest(why)
        session = self.store.begin_push(
            header.model,
            header.handoff_id,
            header.position,
            header.fingerprint,
            wait=_wait_budget(context),
            ttl=header.ttl_seconds,
            no_wait=header.no_wait,
            interrupt=context.cancel,
        )
        try:
            for message in requests:
                if isinstance(message, ChunkFrame):
                    session.add(message)
                elif isinstance(message, Malformed):
                    raise MalformedRequest(message.why, header.model)
                else:
                    raise MalformedRequest("a push has one header; a second one came", header.model)
            outcome = session.finish()
        except BaseException:
            session.abort()
            raise
        logger.info(
            "pushed %s/%s: %d bytes in %d chunks%s",
            header.model,
            header.handoff_id,
            outcome.bytes,
            outcome.chunks,
            " (a byte-identical repeat)" if outcome.duplicate else "",
        )
        return pb.PushResponse(
            handoff_id=header.handoff_id,
            bytes=outcome.bytes,
            chunks=outcome.chunks,
            digest=outcome.digest,
            duplicate=outcome.duplicate,
        )

    @_mapped_stream
    def PullHandoff(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        claim = self.store.claim(
            request.model,
            request.handoff_id,
            _wait_budget(context),
            context.is_active,
            interrupt=context.cancel,
            supersedes=request.supersedes,
        )
        progress = _Progress()
        # Runs however the call ends: a stream that broke before its end returns the claim to the pool at once.
        context.add_callback(lambda: self.store.release(claim, progress.sent_all))
        yield _pull_header(claim)
        fed = 0
        while True:
            chunks, digest = self.store.feed(claim, fed, _wait_budget(context))
            for chunk in chunks:
                yield chunk.frame
            fed += len(chunks)
            if digest is not None:
                break
        yield pb.PullResponse(end=pb.PullEnd(digest=digest)).SerializeToString()
        progress.sent_all = True
        logger.info("streamed %s/%s to claim %d", claim.model, claim.handoff_id, claim.generation)

    @_mapped
    def ConfirmHandoff(self, request: pb.ConfirmRequest, context: grpc.ServicerContext) -> pb.ConfirmResponse:
        self.store.confirm(request.model, request.handoff_id, request.claim)
        logger.info("confirmed %s/%s by claim %d", request.model, request.handoff_id, request.claim)
        return pb.ConfirmResponse()

    @_mapped
    def CancelHandoff(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelResponse:
        cancelled = self.store.cancel(request.model, request.handoff_id)
        logger.info("cancel %s/%s: %s", request.model, request.handoff_id, "freed" if cancelled else "nothing held")
        return pb.CancelResponse(cancelled=cancelled)


    @_mapped
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
            contracts=[contract_to_proto(self.store.contracts[m]) for m in sorted(self.store.contracts)],
        )


class _Progress:
    __slots__ = ("sent_all",)

    def __init__(self) -> None:
        self.sent_all = False


def _pull_header(claim: Claim) -> bytes:
    header = pb.PullHeader(
        model=claim.model,
        handoff_id=claim.handoff_id,
        position=claim.position,
        fingerprint=claim.fingerprint,
        claim=claim.generation,
        bytes=claim.nbytes,
        chunks=claim.chunks,
    )
    return pb.PullResponse(header=header).SerializeToString()


_CODECS: dict[str, tuple[Callable, Callable]] = {
    # method: (request deserializer, response serializer) where the fast chunk codec replaces the generated one
    "PushHandoff": (decode_push_request, pb.PushResponse.SerializeToString),
    "PullHandoff": (pb.PullRequest.FromString, identity),
}


def rpc_handler(servicer: HandoffBrokerServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, one per RPC of the descriptor, each of the streaming kind the .proto declares."""
    handlers = {}
    for method in SERVICE.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        deserialize, serialize = _CODECS.get(method.name, (request_class.FromString, response_class.SerializeToString))
        behaviour = getattr(servicer, method.name)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(behaviour, request_deserializer=deserialize, response_serializer=serialize)
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)
