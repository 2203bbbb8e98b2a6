"""The gRPC plumbing of the service, in one place: how each RPC of the .proto is registered (its codec, its kind
of streaming), how a request that does not parse becomes INVALID_ARGUMENT, and how every error a handler raises
becomes its status — ours by their reason (handoff_client/protocol/errors.py maps each to its code and details, once),
anything else a logged INTERNAL.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc
from grpc_status import rpc_status
from handoff_client.protocol.errors import HandoffError, InternalError, MalformedRequest, to_status
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import SERVICE, Malformed, decode_push_request, identity, message_classes

from .store.holdings import check_id

logger = logging.getLogger("handoff_broker.service")


class Refusals(Protocol):
    """The servicer, as the error mapping sees it: told of each refusal (to count and log it)."""

    def _refused(self, rpc: str, error: HandoffError) -> None: ...


def check_request(request: object) -> None:
    """What every request must be before its handler runs: one that did not parse is MALFORMED_REQUEST, and one
    that names a hand-off names it by the one rule (1-256 printable characters: `check_id`), whichever RPC it is."""
    if isinstance(request, Malformed):
        raise MalformedRequest(request.why)
    descriptor = getattr(request, "DESCRIPTOR", None)
    if descriptor is not None and "handoff_id" in descriptor.fields_by_name:
        check_id(getattr(request, "model", "") or None, request.handoff_id)  # type: ignore[attr-defined]


def abort_with(context: grpc.ServicerContext, error: HandoffError) -> None:
    context.abort_with_status(rpc_status.to_status(to_status(error)))


def mapped(method: Callable) -> Callable:
    """Turn our errors into their statuses and anything else into a logged INTERNAL, for a unary-response RPC."""

    @functools.wraps(method)
    def handler(self: Refusals, request: object, context: grpc.ServicerContext) -> object:
        try:
            check_request(request)
            return method(self, request, context)
        except HandoffError as e:
            self._refused(method.__name__, e)
            abort_with(context, e)
        except grpc.RpcError:  # the client went away mid-stream; nobody is left to tell
            logger.info("%s: the client's stream broke", method.__name__)
            context.abort(grpc.StatusCode.CANCELLED, "the client's stream broke")
        except Exception:
            logger.exception("%s failed", method.__name__)
            abort_with(context, InternalError())
        return None  # not reached: abort raises

    return handler


def mapped_stream(method: Callable) -> Callable:
    """As `mapped`, for a server-streaming RPC: errors raised while streaming end the stream with their status."""

    @functools.wraps(method)
    def handler(self: Refusals, request: object, context: grpc.ServicerContext) -> Iterator[object]:
        try:
            check_request(request)
            yield from method(self, request, context)
        except HandoffError as e:
            self._refused(method.__name__, e)
            abort_with(context, e)
        except Exception:
            logger.exception("%s failed", method.__name__)
            abort_with(context, InternalError())

    return handler


_CODECS: dict[str, tuple[Callable, Callable]] = {
    # method: (request deserializer, response serializer) where the fast chunk codec replaces the generated one
    "PushHandoff": (decode_push_request, pb.PushResponse.SerializeToString),
    "PullHandoff": (None, identity),
}


def _lenient(request_class: type) -> Callable[[bytes], object]:
    """A deserializer that never raises: a request that does not parse (an id that is not UTF-8, say) becomes
    Malformed, which the handler answers with INVALID_ARGUMENT — grpcio would end it with a bare INTERNAL."""

    def parse(data: bytes) -> object:
        try:
            return request_class.FromString(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the sender's
            return Malformed(f"the request is not a valid {request_class.__name__}: {e}")

    return parse


def rpc_handler(servicer: object) -> grpc.GenericRpcHandler:
    """The service's handlers, one per RPC of the descriptor, each of the streaming kind the .proto declares."""
    handlers = {}
    for method in SERVICE.methods:
        request_class, response_class = message_classes(method.name)
        deserialize, serialize = _CODECS.get(method.name, (None, response_class.SerializeToString))
        deserialize = deserialize or _lenient(request_class)
        behaviour = getattr(servicer, method.name)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(behaviour, request_deserializer=deserialize, response_serializer=serialize)
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)
