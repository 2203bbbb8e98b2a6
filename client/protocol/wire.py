"""The service's methods and messages as the .proto declares them, and the conversions to our types.

Method paths come from the generated descriptor, so a renamed or added RPC in the .proto shows up here without a
hand-kept list (tests/test_wire.py checks the servicer implements every one).
"""

from __future__ import annotations

from google.protobuf import message_factory

from .contract import Carried, Contract
from .frames import ChunkFrame, decode_chunk, encode_chunk
from .messages import handoff_pb2 as pb
from .shards import Shard, as_shard

SERVICE = pb.DESCRIPTOR.services_by_name["HandoffBroker"]
SERVICE_NAME = SERVICE.full_name

WIRE_VERSION = 1
"""Increment when a change to the .proto breaks an existing peer (renumbered field, changed meaning); never for an
added field or RPC."""


def method_path(name: str) -> str:
    """The HTTP/2 path of one of the service's RPCs, e.g. /handoff.v1.HandoffBroker/PushHandoff."""
    return f"/{SERVICE_NAME}/{SERVICE.methods_by_name[name].name}"


def message_classes(name: str) -> tuple[type, type]:
    """The generated request and response classes of one of the service's RPCs, as its descriptor names them."""
    method = SERVICE.methods_by_name[name]
    return message_factory.GetMessageClass(method.input_type), message_factory.GetMessageClass(method.output_type)


def contract_to_proto(contract: Contract) -> pb.Contract:
    return pb.Contract(
        model=contract.model,
        ctx=contract.ctx,
        hidden=contract.hidden,
        carried=[
            pb.Carried(
                name=c.name,
                layer=c.layer,
                rows=c.rows,
                cols=c.cols,
                dtype=c.dtype,
                heads=c.heads,
                head_dim=c.head_dim,
                rows_are_positions=c.rows_are_positions,
            )
            for c in contract.carried
        ],
        fingerprint=contract.fingerprint,
    )


def contract_from_proto(message: pb.Contract) -> Contract:
    carried = tuple(
        Carried(c.name, c.layer, c.rows, c.cols, c.dtype, c.heads, c.head_dim, c.rows_are_positions)
        for c in message.carried
    )
    return Contract(message.model, message.ctx, message.hidden, carried)


def shard_to_proto(shard: Shard) -> pb.Shard | None:
    """The wire's shard: absent for the whole hand-off."""
    return None if shard.whole else pb.Shard(rank=shard.rank, size=shard.size)


def shard_from_proto(
    model: str, message: pb.PushHeader | pb.PullRequest | pb.ConfirmRequest | pb.PushProgressRequest
) -> Shard:
    """A request's shard; an absent one (or size 0, as a peer that leaves the field unset sends) is the whole."""
    if not message.HasField("shard") or message.shard.size == 0:
        return as_shard(model, None)
    return as_shard(model, (message.shard.rank, message.shard.size))


def decode_push_request(frame: bytes) -> pb.PushHeader | ChunkFrame | Malformed:
    """A push stream's message: a header, a chunk (parsed in place), or why it is neither.

    Never raises: an exception in a gRPC deserializer ends the call with a bare INTERNAL, and a malformed message
    deserves INVALID_ARGUMENT with a reason.
    """
    chunk = decode_chunk(frame)
    if chunk is not None:
        return chunk
    try:
        request = pb.PushRequest.FromString(frame)
    except Exception as e:  # noqa: BLE001 - any parse failure is the sender's
        return Malformed(f"a push message that is not a PushRequest: {e}")
    kind = request.WhichOneof("kind")
    if kind == "header":
        return request.header
    if kind == "chunk":
        return _reframed(request.chunk) or Malformed("a chunk that cannot be re-framed")
    return Malformed("a push message with neither a header nor a chunk")


def decode_pull_response(frame: bytes) -> pb.PullHeader | pb.PullEnd | ChunkFrame:
    """A pull stream's message: the header, a chunk (parsed in place) or the end."""
    chunk = decode_chunk(frame)
    if chunk is not None:
        return chunk
    response = pb.PullResponse.FromString(frame)
    kind = response.WhichOneof("kind")
    if kind == "header":
        return response.header
    if kind == "end":
        return response.end
    if kind == "chunk":
        return _reframed(response.chunk)  # type: ignore[return-value]
    raise ValueError("a pull message with neither a header, a chunk nor an end")


def _reframed(chunk: pb.Chunk) -> ChunkFrame | None:
    """A chunk some encoder framed differently (other field order, defaults written), in the canonical frame the
    fast path reads, so the broker can forward it verbatim like any other."""
    return decode_chunk(encode_chunk(chunk.tensor, chunk.offset, chunk.data, chunk.crc32c))


class Malformed:
    """A message that could not be read, and why."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def identity(frame: bytes) -> bytes:
    """The serializer for frames that are already wire bytes."""
    return frame
