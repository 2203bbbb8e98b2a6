"""The gRPC baselines: a relay process serving the naive relay (protobuf `bytes` chunks of 1 MiB, client-stream in,
store, server-stream out), the tuned relay (4 MiB raw messages forwarded untouched as they arrive, no checks: the
best grpcio's Python API allows) and the floor (handoff's three calls carrying the same bytes to methods that do
nothing), with the producer and consumer roles that drive them. Run through `_roles.py`."""

from __future__ import annotations

import json
import queue
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np
from _harness import RELAY_BUFFER, MiB, crc, destination, payload

FLOOR_PAYLOAD = bytes(64 << 10)


def identity(message: bytes) -> bytes:
    return message


def _drained(requests, context) -> bytes:
    for _ in requests:
        pass
    return b""


def role_naive_grpc_relay(port_file: str) -> None:
    import grpc
    from handoff_client.protocol.messages import handoff_pb2 as pb

    held: dict[str, list[bytes]] = {}
    done: dict[str, threading.Event] = {}
    lock = threading.Lock()

    def event(key: str) -> threading.Event:
        with lock:
            return done.setdefault(key, threading.Event())

    def push(requests, context):
        key, chunks = "", []
        for request in requests:
            if request.HasField("header"):
                key = request.header.handoff_id
            else:
                chunks.append(request.chunk.data)
        held[key] = chunks
        event(key).set()
        return pb.PushResponse(handoff_id=key)

    def pull(request, context):
        event(request.handoff_id).wait()
        for data in held.pop(request.handoff_id):
            yield pb.PullResponse(chunk=pb.Chunk(data=data))

    streams: dict[bytes, queue.SimpleQueue] = {}

    def stream(key: bytes) -> queue.SimpleQueue:
        with lock:
            return streams.setdefault(key, queue.SimpleQueue())

    def raw_push(requests, context):  # the first message names the stream; the rest go through untouched
        frames = stream(next(requests))
        for frame in requests:
            frames.put(frame)
        frames.put(None)
        return b""

    def raw_pull(key, context):
        frames = stream(key)
        while (frame := frames.get()) is not None:
            yield frame
        with lock:
            del streams[key]

    server = grpc.server(futures.ThreadPoolExecutor(8), options=[("grpc.max_receive_message_length", 64 * MiB)])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "naive.Relay",
                {
                    "Push": grpc.stream_unary_rpc_method_handler(
                        push, pb.PushRequest.FromString, pb.PushResponse.SerializeToString
                    ),
                    "Pull": grpc.unary_stream_rpc_method_handler(
                        pull, pb.PullRequest.FromString, pb.PullResponse.SerializeToString
                    ),
                    "RawPush": grpc.stream_unary_rpc_method_handler(raw_push, identity, identity),
                    "RawPull": grpc.unary_stream_rpc_method_handler(raw_pull, identity, identity),
                    # The floor: handoff's three calls (a 2-message client stream, a 3-message server stream, a
                    # unary confirm) with the same bytes and no work at all.
                    "FloorPush": grpc.stream_unary_rpc_method_handler(_drained, identity, identity),
                    "FloorPull": grpc.unary_stream_rpc_method_handler(
                        lambda request, ctx: iter((b"h", FLOOR_PAYLOAD, b"e")), identity, identity
                    ),
                    "FloorConfirm": grpc.unary_unary_rpc_method_handler(lambda request, ctx: b"", identity, identity),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def naive_channel(port: int):
    import grpc
    from handoff_client.protocol.messages import handoff_pb2 as pb

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 * MiB)])
    push = channel.stream_unary("/naive.Relay/Push", pb.PushRequest.SerializeToString, pb.PushResponse.FromString)
    pull = channel.unary_stream("/naive.Relay/Pull", pb.PullRequest.SerializeToString, pb.PullResponse.FromString)
    return channel, push, pull, pb


def naive_push(push, pb, key: str, data: bytes) -> None:
    def requests():
        yield pb.PushRequest(header=pb.PushHeader(handoff_id=key))
        for at in range(0, len(data), MiB):
            yield pb.PushRequest(chunk=pb.Chunk(data=data[at : at + MiB]))

    push(requests())


def naive_pull(pull, pb, key: str, out: np.ndarray) -> None:
    got = 0
    for response in pull(pb.PullRequest(handoff_id=key)):
        data = response.chunk.data
        out[got : got + len(data)] = np.frombuffer(data, np.uint8)
        got += len(data)


def role_naive_grpc_producer(port: int, nbytes: int, key: str) -> None:
    _, push, _, pb = naive_channel(port)
    data = payload(nbytes).tobytes()
    t0 = time.monotonic()
    naive_push(push, pb, key, data)
    print(json.dumps({"t0": t0}))


def role_naive_grpc_consumer(port: int, nbytes: int, key: str) -> None:
    _, _, pull, pb = naive_channel(port)
    out = destination(nbytes)
    print("ready", flush=True)
    naive_pull(pull, pb, key, out)
    print(json.dumps({"t1": time.monotonic(), "crc": crc(out)}))


def role_raw_grpc_producer(port: int, nbytes: int, key: str) -> None:
    """The tuned gRPC relay: 4 MiB messages of an 8-byte offset and the payload, no protobuf, no checks."""
    channel, *_ = naive_channel(port)
    push = channel.stream_unary("/naive.Relay/RawPush", identity, identity)
    data = memoryview(payload(nbytes))

    def frames():
        yield key.encode()
        for at in range(0, nbytes, RELAY_BUFFER):
            yield b"".join((at.to_bytes(8, "little"), data[at : at + RELAY_BUFFER]))

    t0 = time.monotonic()
    push(frames())
    print(json.dumps({"t0": t0}))


def role_raw_grpc_consumer(port: int, nbytes: int, key: str) -> None:
    channel, *_ = naive_channel(port)
    pull = channel.unary_stream("/naive.Relay/RawPull", identity, identity)
    out = destination(nbytes)
    frames = pull(key.encode())
    print("ready", flush=True)
    for frame in frames:
        at = int.from_bytes(frame[:8], "little")
        out[at : at + len(frame) - 8] = np.frombuffer(frame, np.uint8, offset=8)
    print(json.dumps({"t1": time.monotonic(), "crc": crc(out)}))
