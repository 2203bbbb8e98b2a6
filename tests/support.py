"""Raw wire access for tests that must send what the client library would refuse to."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import grpc
from handoff_client import Contract, HandoffClient, HandoffError, UnknownHandoff
from handoff_client._client import CHANNEL_OPTIONS
from handoff_client.protocol.errors import from_rpc_error
from handoff_client.protocol.frames import encode_chunk
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import decode_pull_response, identity, method_path


def header_frame(
    contract: Contract,
    handoff_id: str,
    position: int = 1,
    fingerprint: str | None = None,
    shard: tuple[int, int] | None = None,
) -> bytes:
    header = pb.PushHeader(
        model=contract.model,
        handoff_id=handoff_id,
        position=position,
        fingerprint=contract.fingerprint if fingerprint is None else fingerprint,
        shard=pb.Shard(rank=shard[0], size=shard[1]) if shard else None,
    )
    return pb.PushRequest(header=header).SerializeToString()


def chunk_frames(contract: Contract, tensors: dict, chunk_bytes: int) -> list[bytes]:
    """Every tensor in `tensors` cut into chunks of `chunk_bytes` (any byte boundary), in contract order."""
    frames = []
    for c in contract.carried:
        if c.name not in tensors:
            continue
        payload = memoryview(tensors[c.name].reshape(-1).view("uint8"))
        for offset in range(0, c.nbytes, chunk_bytes):
            frames.append(encode_chunk(c.name, offset, payload[offset : offset + chunk_bytes]))
    return frames


def raw_push(target: str, frames: Iterable[bytes], timeout: float = 10) -> pb.PushResponse:
    """Send frames as they are; a failure comes back as our exception, as the client library would raise it."""
    with open_channel(target) as channel:
        push = channel.stream_unary(
            method_path("PushHandoff"), request_serializer=identity, response_deserializer=pb.PushResponse.FromString
        )
        try:
            return push(iter(frames), timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None


def open_channel(target: str) -> grpc.Channel:
    """A channel set up as the client library sets up its own."""
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)


def raw_pull(
    channel: grpc.Channel,
    model: str,
    handoff_id: str,
    timeout: float = 10,
    shard: tuple[int, int] | None = None,
    audit: bool = False,
) -> Iterator[object]:
    """An open pull stream (an audit read's with `audit`) whose messages are decoded but not acted on (no confirm)."""
    pull = channel.unary_stream(
        method_path("PullHandoff"),
        request_serializer=pb.PullRequest.SerializeToString,
        response_deserializer=decode_pull_response,
    )
    wire_shard = pb.Shard(rank=shard[0], size=shard[1]) if shard else None
    return pull(pb.PullRequest(model=model, handoff_id=handoff_id, shard=wire_shard, audit=audit), timeout=timeout)


def raises_handoff_error(call, *args, **kwargs) -> HandoffError:
    try:
        call(*args, **kwargs)
    except HandoffError as e:
        return e
    raise AssertionError(f"{call} did not raise")


def broker_holds(
    address: str, model: str, handoff_id: str, at_least: int, shard: tuple[int, int] | None = None
) -> Callable[[], bool]:
    """Whether the broker at `address` holds `at_least` bytes of a push under way (asked afresh on each call)."""

    def holds() -> bool:
        with HandoffClient(address, timeout=5) as client:
            try:
                progress = client.push_progress(model, handoff_id, shard=shard)
            except UnknownHandoff:
                return False
        return sum(r.length for t in progress.tensors for r in t.received) >= at_least

    return holds
