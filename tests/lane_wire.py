"""Speaking the lanes' wire by hand (docs/lanes.md), for the tests of the TCP lane and its striping: a push's or a
pull's gRPC call offering a lane, and the frames a lane carries."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import numpy as np
from handoff_client import HandoffClient
from handoff_client.protocol.contract import Carried, Contract
from handoff_client.protocol.errors import from_rpc_error
from handoff_client.protocol.frames import crc32c
from handoff_client.protocol.lane import new_capability, read_header, recv_exact
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import decode_pull_response, identity, method_path
from support import open_channel

ROWS, COLS = 1024, 1024  # 4 MiB a tensor in float32: well past the lane's 1 MiB floor
LARGE = Contract("large", ROWS + 1, 64, tuple(Carried(f"k{i}", i, ROWS, COLS, "float32") for i in range(4)))
TCP_ONLY = {"shared_memory_lane": False}  # a broker whose clients on its own host take the TCP lane


def lane_port(broker) -> int:
    with HandoffClient(broker.address) as client:
        lane = client.lane()
    assert lane is not None
    return lane.port


def lane_frames(tensors: dict[str, np.ndarray], chunk: int = 1 << 20) -> list[tuple[int, int, memoryview]]:
    """(tensor index, offset, bytes) of every `chunk` of LARGE's tensors, in order."""
    frames = []
    for index, carried in enumerate(LARGE.carried):
        payload = memoryview(tensors[carried.name].reshape(-1).view(np.uint8))
        frames += [(index, at, payload[at : at + chunk]) for at in range(0, carried.nbytes, chunk)]
    return frames


def push_call(client: HandoffClient, handoff_id: str, capability: bytes, **fields: object):
    """A push of LARGE at position 1 whose header offers a lane; its future."""
    header = pb.PushHeader(model="large", handoff_id=handoff_id, position=1, fingerprint=LARGE.fingerprint,
                           lane_capability=capability, **fields)  # fmt: skip
    push = client._channel.stream_unary(method_path("PushHandoff"), request_serializer=identity,
                                        response_deserializer=pb.PushResponse.FromString)  # fmt: skip
    return push.future(iter([pb.PushRequest(header=header).SerializeToString()]), timeout=30)


def result(call) -> pb.PushResponse:
    """A push call's response; its error as our exception."""
    try:
        return call.result()
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None


def claimed_on_a_lane(client: HandoffClient, broker, tensors: dict[str, np.ndarray], **fields: object):
    """Push `r` whole, then claim it by hand offering a lane: (the capability, the open stream, its header)."""
    client.push("large", "r", 1, tensors)
    capability = new_capability()
    stream = pull_call(broker.address, "r", capability, **fields)
    return capability, stream, next(stream)


def pull_call(address: str, handoff_id: str, capability: bytes, model: str = "large", **fields: object) -> Iterator:
    """An open pull stream offering a lane (`lane_kind` 0 means TCP); decoded, not acted on. Errors come as our
    exceptions."""
    channel = open_channel(address)
    pull = channel.unary_stream(method_path("PullHandoff"), request_serializer=pb.PullRequest.SerializeToString,
                                response_deserializer=decode_pull_response)  # fmt: skip
    request = pb.PullRequest(model=model, handoff_id=handoff_id, lane_capability=capability, **fields)
    return _translated(pull(request, timeout=30), channel)


def _translated(stream, channel) -> Iterator:
    try:
        yield from stream
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    finally:
        channel.close()


def read_frames(lane: socket.socket) -> int:
    """Read a lane to its end marker, checking each frame's CRC32C; the bytes received."""
    total = 0
    while not (frame := read_header(lane)).end:
        data = recv_exact(lane, frame.length)
        assert crc32c(data) == frame.crc
        total += frame.length
    return total
