"""Side by side, on the same payloads, in one run: how fast a hand-off crosses handoff-broker, against what a user
would pick instead.

    python benchmarks/bench.py                 # 1, 16, 256 MiB, a Llama-3-8B hand-off (4k context, bf16), and
                                               # Llama-3-8B at 32k context after prompts of 512, 2k and 8k tokens
    python benchmarks/bench.py --quick         # small sizes, fewer runs (the test suite's smoke run)
    python benchmarks/bench.py --json out.json

Every path is three processes on this machine — a producer, a relay in the middle, a consumer — and every payload is
verified at the consumer (CRC32C against the producer's). Paths:
    memcpy x2     one process copies the payload twice: the copy limit
    tcp relay     raw sockets through a middle process, 4 MiB buffers, streaming through
    checked relay the same sockets doing a lane's duties and nothing else: 1 MiB frames on the TCP lane's wire, each
                  with a CRC32C, which the producer computes, the relay checks on the copy it keeps (until the transfer
                  ends, as a broker keeps a hand-off until its confirm) and forwards from another thread, and the
                  consumer checks on its destination; what checked store-and-forward costs in Python here, with no
                  control plane at all
    redis relay   RPUSH / BLPOP of 4 MiB values through redis-server (skipped when there is no redis-server)
    naive grpc    protobuf `bytes` chunks of 1 MiB, client-stream in, store, server-stream out
    tuned grpc    the best relay grpcio's Python API allows, as measured when this project began: 4 MiB messages of
                  raw bytes (no protobuf), forwarded untouched as they arrive, no checks, no checksums; the ceiling
                  for any design that keeps gRPC streams through Python
    handoff       handoff-broker end to end: a pusher process, the broker, a puller process, the client library;
                  the pull is made before the push, so the broker streams the push through as it is checked; the
                  bytes on the gRPC streams (lanes=False)
    handoff tcp   the same with the bytes on the broker's TCP lane (docs/lanes.md), every frame checked the same
    handoff shm   the same on its shared-memory lane (pusher and puller on the broker's host), checked the same
    grpc floor    (latency only) handoff's three calls - a 2-message client stream, a 3-message server stream, a
                  unary confirm - carrying the same bytes to a server that does nothing: what grpcio itself costs
    grpc 1 call   (latency only) one empty unary call to that server: what grpcio costs per call on this machine
    padded        (prompt rows) the same hand-off under a contract without `rows_are_positions`: every cache moved
                  at its full context, as the project did before hand-offs carried only their filled rows
Every consumer allocates and touches its destination before the clock starts, as a decoder's preallocated cache is
(handoff pulls `into=` it). Every process runs with `handoff_client.tune_allocator()`, as the broker does: received
gRPC messages then reuse mapped pages (it speeds the naive gRPC relay as much as handoff; TCP and Redis allocate
nothing per message). Before each size's runs one untimed hand-off of that size goes through the broker, as through
any broker that has been serving: it keeps the pages confirmed hand-offs leave for the next pushes (the memory
figures show a fresh broker's first hand-off too). Throughput is bytes over (consumer done - producer start), the
median of --runs. Ratios hold only within one run on one machine: single runs vary by tens of percent on a shared
2-core box.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MiB = 1 << 20
RELAY_BUFFER = 4 * MiB
FLOOR_PAYLOAD = bytes(64 << 10)
HANDOFF_PATHS = {"stream": "handoff", "tcp": "handoff tcp", "shm": "handoff shm"}  # the client's path: its row


def identity(message: bytes) -> bytes:
    return message


def _drained(requests, context) -> bytes:
    for _ in requests:
        pass
    return b""


HERE = Path(__file__).resolve()


# -- payloads -------------------------------------------------------------------------------------------------------


def payload(nbytes: int, seed: int = 1) -> np.ndarray:
    """Deterministic bytes that every process can make for itself."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def destination(nbytes: int) -> np.ndarray:
    """A consumer's buffer, allocated and touched before the clock starts, as a decoder's preallocated cache is:
    every path pays the same first-touch page faults (or none), outside the measurement."""
    out = np.empty(nbytes, np.uint8)
    out.fill(0)
    return out


def crc(buffer) -> int:
    from handoff_client._frames import crc32c

    return crc32c(memoryview(buffer).cast("B"))


def manifest(model: str, nbytes: int) -> dict:
    """A contract of `nbytes` in bfloat16 tensors of at most 8 MiB, two a layer (a key and a value cache)."""
    rows_total = nbytes // (1024 * 2)
    per = min(rows_total, 4096)
    carried, layer, left = [], 0, rows_total
    while left > 0:
        for kind in ("k_cache", "v_cache"):
            if left <= 0:
                break
            rows = min(per, left)
            carried.append(
                {
                    "name": f"layers.{layer}.self_attn.{kind}",
                    "layer": layer,
                    "rows": rows,
                    "cols": 1024,
                    "dtype": "bfloat16",
                    "heads": 8,
                    "head_dim": 128,
                }
            )
            left -= rows
        layer += 1
    return {"model": model, "ctx": 1 << 20, "hidden": 4096, "carried": carried}


def llama3_8b(model: str, ctx: int, layers: int = 32, positional: bool = False) -> dict:
    """Llama-3-8B's carried state over `ctx` positions (bf16, 8 KV heads of 128 a layer); `positional`: the caches
    marked `rows_are_positions` (a hand-off carries the rows its prompt filled), as contract-from-config marks them."""
    marker = {"rows_are_positions": True} if positional else {}
    return {
        "model": model,
        "ctx": ctx,
        "hidden": 4096,
        "carried": [
            {
                "name": f"layers.{i}.self_attn.{kind}",
                "layer": i,
                "rows": ctx,
                "cols": 8 * 128,
                "dtype": "bfloat16",
                "heads": 8,
                "head_dim": 128,
                **marker,
            }
            for i in range(layers)
            for kind in ("k_cache", "v_cache")
        ],
    }


LLAMA3_8B_4K = llama3_8b("llama-3-8b-4k", 4096)


# -- process roles (run as `bench.py role ...`; each prints one JSON line) -------------------------------------------


def role_tcp_relay(port_file: str, runs: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(server.getsockname()[1]))
    buffer = bytearray(RELAY_BUFFER)
    view = memoryview(buffer)
    for _ in range(runs):
        peers = {}
        while len(peers) < 2:
            conn, _ = server.accept()
            peers[conn.recv(1)] = conn
        src, dst = peers[b"P"], peers[b"C"]
        while n := src.recv_into(buffer):
            dst.sendall(view[:n])
        src.close()
        dst.close()


def role_tcp_producer(port: int, nbytes: int) -> None:
    data = memoryview(payload(nbytes))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"P")
    t0 = time.monotonic()
    for at in range(0, nbytes, RELAY_BUFFER):
        sock.sendall(data[at : at + RELAY_BUFFER])
    sock.close()
    print(json.dumps({"t0": t0}))


def role_tcp_consumer(port: int, nbytes: int) -> None:
    out = destination(nbytes)
    view = memoryview(out)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"C")
    print("ready", flush=True)
    got = 0
    while got < nbytes:
        got += sock.recv_into(view[got:], min(RELAY_BUFFER, nbytes - got))
    t1 = time.monotonic()
    print(json.dumps({"t1": t1, "crc": crc(out)}))


CHECKED_FRAME = 1 * MiB
# Free bytes the checked relay's heap keeps: more than the largest payload, as a broker keeps up to its --max-bytes.
RELAY_KEEP = 1 << 30


def role_checked_relay(port_file: str, runs: int) -> None:
    """The TCP lane's wire (handoff_client._lane: its socket settings, frame headers and end marker) between two
    raw sockets: receives and checks on one thread, forwards on another, as the broker's push and pipelined pull do."""
    from handoff_client import tune_allocator
    from handoff_client._lane import read_header, recv_into_exact, send_end, send_frame, tune

    tune_allocator(keep=RELAY_KEEP, mmap_threshold=32 * MiB)  # as the broker: pages a transfer freed serve the next
    crc(b"")  # (its module imported before any clock starts)
    checked: queue.SimpleQueue = queue.SimpleQueue()  # (socket, header, frame) to forward, to the end's header
    forwarded: queue.SimpleQueue = queue.SimpleQueue()  # each run's socket, once its end marker is sent

    def forward() -> None:  # one thread for every run: a thread per run would leave the CPU reading to clock ticks
        while True:
            dst, header, frame = checked.get()
            if header.end:
                send_end(dst)
                forwarded.put(dst)
            else:
                send_frame(dst, header.index, header.offset, memoryview(frame), header.crc)

    threading.Thread(target=forward, daemon=True).start()
    server = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(server.getsockname()[1]))
    for _ in range(runs):
        peers = {}
        while len(peers) < 2:
            conn, _ = server.accept()
            tune(conn)
            peers[conn.recv(1)] = conn
        src, dst = peers[b"P"], peers[b"C"]
        kept: list[np.ndarray] = []
        while not (header := read_header(src)).end:
            frame = np.empty(header.length, np.uint8)
            recv_into_exact(src, memoryview(frame))
            if crc(frame) != header.crc:
                raise RuntimeError("a frame failing its CRC32C")
            kept.append(frame)
            checked.put((dst, header, frame))
        checked.put((dst, header, None))
        forwarded.get()
        kept.clear()
        src.close()
        dst.close()


def role_checked_producer(port: int, nbytes: int) -> None:
    from handoff_client._lane import send_end, send_frame, tune

    data = memoryview(payload(nbytes))
    crc(b"")
    sock = socket.create_connection(("127.0.0.1", port))
    tune(sock)
    sock.sendall(b"P")
    t0 = time.monotonic()
    for at in range(0, nbytes, CHECKED_FRAME):
        frame = data[at : at + CHECKED_FRAME]
        send_frame(sock, 0, at, frame, crc(frame))
    send_end(sock)
    sock.close()
    print(json.dumps({"t0": t0}))


def role_checked_consumer(port: int, nbytes: int) -> None:
    from handoff_client._lane import read_header, recv_into_exact, tune

    out = destination(nbytes)
    view = memoryview(out)
    crc(b"")
    sock = socket.create_connection(("127.0.0.1", port))
    tune(sock)
    sock.sendall(b"C")
    print("ready", flush=True)
    while not (header := read_header(sock)).end:
        landing = view[header.offset : header.offset + header.length]
        recv_into_exact(sock, landing)
        if crc(landing) != header.crc:
            raise RuntimeError("a frame failing its CRC32C")
    t1 = time.monotonic()
    print(json.dumps({"t1": t1, "crc": crc(out)}))


def role_memcpy(nbytes: int) -> None:
    src = payload(nbytes)
    mid, out = np.empty_like(src), np.empty_like(src)
    mid[:] = 0
    out[:] = 0  # touch the pages first: we time copies, not page faults
    t0 = time.monotonic()
    np.copyto(mid, src)
    np.copyto(out, mid)
    t1 = time.monotonic()
    print(json.dumps({"t0": t0, "t1": t1, "crc": crc(out)}))


def _resp(*parts: bytes) -> bytes:
    return b"".join([f"*{len(parts)}\r\n".encode()] + [b"$%d\r\n%s\r\n" % (len(p), p) for p in parts])


class _Redis:
    """Just enough of RESP for RPUSH and BLPOP."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb", buffering=RELAY_BUFFER)

    def command(self, *parts: bytes) -> object:
        self.sock.sendall(_resp(*parts))
        return self._read()

    def _read(self) -> object:
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind in (b"+", b":"):
            return rest
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            return [self._read() for _ in range(int(rest))]
        raise RuntimeError(line)


def role_redis_producer(port: int, nbytes: int, key: str) -> None:
    data = payload(nbytes).tobytes()
    r = _Redis(port)
    t0 = time.monotonic()
    for at in range(0, nbytes, RELAY_BUFFER):
        r.command(b"RPUSH", key.encode(), data[at : at + RELAY_BUFFER])
    print(json.dumps({"t0": t0}))


def role_redis_consumer(port: int, nbytes: int, key: str) -> None:
    out = destination(nbytes)
    r = _Redis(port)
    print("ready", flush=True)
    got = 0
    while got < nbytes:
        _, value = r.command(b"BLPOP", key.encode(), b"30")
        out[got : got + len(value)] = np.frombuffer(value, np.uint8)
        got += len(value)
    print(json.dumps({"t1": time.monotonic(), "crc": crc(out)}))


def role_naive_grpc_relay(port_file: str) -> None:
    import grpc

    from handoff_client._proto import handoff_pb2 as pb

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


def _naive_channel(port: int):
    import grpc

    from handoff_client._proto import handoff_pb2 as pb

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 * MiB)])
    push = channel.stream_unary("/naive.Relay/Push", pb.PushRequest.SerializeToString, pb.PushResponse.FromString)
    pull = channel.unary_stream("/naive.Relay/Pull", pb.PullRequest.SerializeToString, pb.PullResponse.FromString)
    return channel, push, pull, pb


def _naive_push(push, pb, key: str, data: bytes) -> None:
    def requests():
        yield pb.PushRequest(header=pb.PushHeader(handoff_id=key))
        for at in range(0, len(data), MiB):
            yield pb.PushRequest(chunk=pb.Chunk(data=data[at : at + MiB]))

    push(requests())


def _naive_pull(pull, pb, key: str, out: np.ndarray) -> None:
    got = 0
    for response in pull(pb.PullRequest(handoff_id=key)):
        data = response.chunk.data
        out[got : got + len(data)] = np.frombuffer(data, np.uint8)
        got += len(data)


def role_naive_grpc_producer(port: int, nbytes: int, key: str) -> None:
    _, push, _, pb = _naive_channel(port)
    data = payload(nbytes).tobytes()
    t0 = time.monotonic()
    _naive_push(push, pb, key, data)
    print(json.dumps({"t0": t0}))


def role_naive_grpc_consumer(port: int, nbytes: int, key: str) -> None:
    _, _, pull, pb = _naive_channel(port)
    out = destination(nbytes)
    print("ready", flush=True)
    _naive_pull(pull, pb, key, out)
    print(json.dumps({"t1": time.monotonic(), "crc": crc(out)}))


def role_raw_grpc_producer(port: int, nbytes: int, key: str) -> None:
    """The tuned gRPC relay: 4 MiB messages of an 8-byte offset and the payload, no protobuf, no checks."""
    channel, *_ = _naive_channel(port)
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
    channel, *_ = _naive_channel(port)
    pull = channel.unary_stream("/naive.Relay/RawPull", identity, identity)
    out = destination(nbytes)
    frames = pull(key.encode())
    print("ready", flush=True)
    for frame in frames:
        at = int.from_bytes(frame[:8], "little")
        out[at : at + len(frame) - 8] = np.frombuffer(frame, np.uint8, offset=8)
    print(json.dumps({"t1": time.monotonic(), "crc": crc(out)}))


def _tensors(contract, seed: int = 1) -> dict[str, np.ndarray]:
    data = payload(contract.nbytes, seed)
    tensors, at = {}, 0
    for c in contract.carried:
        tensors[c.name] = data[at : at + c.nbytes].view(c.numpy_dtype).reshape(c.shape)
        at += c.nbytes
    return tensors


def _chunk_bytes() -> int | None:
    """--chunk-bytes, or None: the client's own choice for each path."""
    chosen = os.environ.get("BENCH_CHUNK_BYTES")
    return int(chosen) if chosen else None


def _lanes(path: str) -> dict[str, bool]:
    """The client's settings for a path: "stream", "tcp" (the TCP lane) or "shm" (the shared-memory lane)."""
    return {"lanes": path != "stream", "shared_memory": path == "shm"}


def role_handoff_producer(target: str, model: str, key: str, path: str = "stream") -> None:
    from handoff_client import HandoffClient

    with HandoffClient(target, chunk_bytes=_chunk_bytes(), **_lanes(path)) as client:
        tensors = _tensors(client.get_contract(model))
        t0 = time.monotonic()
        client.push(model, key, 1, tensors)
        print(json.dumps({"t0": t0, "t_end": time.monotonic()}))


def _caches(contract) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The decoder's whole caches as one touched buffer, each tensor a view of it at its declared shape."""
    out = destination(contract.nbytes)
    into, at = {}, 0
    for c in contract.carried:
        into[c.name] = out[at : at + c.nbytes].view(c.numpy_dtype).reshape(c.shape)
        at += c.nbytes
    return out, into


def role_handoff_consumer(target: str, model: str, key: str, path: str = "stream") -> None:
    from handoff_client import HandoffClient

    with HandoffClient(target, **_lanes(path)) as client:
        out, into = _caches(client.get_contract(model))
        print("ready", flush=True)
        pulled = client.pull_tensors(model, key, timeout=120, into=into)
        first = None
        for _ in pulled:
            first = first or time.monotonic()
        t1 = time.monotonic()
        print(json.dumps({"t1": t1, "t_first": first, "crc": crc(out)}))


def role_prompt_producer(target: str, model: str, key: str, position: str) -> None:
    """A prefill after a prompt of `position` tokens: pushes its whole cache arrays; what crosses is up to the
    contract (only the filled rows where they are marked as positions)."""
    from handoff_client import HandoffClient

    with HandoffClient(target, chunk_bytes=_chunk_bytes(), timeout=600) as client:
        contract = client.get_contract(model)
        tensors = _tensors(contract)
        filled = contract.at(int(position))
        digest = _filled_crc(filled, tensors)
        t0 = time.monotonic()
        result = client.push(model, key, int(position), tensors)
        print(json.dumps({"t0": t0, "t_end": time.monotonic(), "bytes": result.bytes, "crc": digest}))


def role_prompt_consumer(target: str, model: str, key: str) -> None:
    """A decoder pulling into its whole preallocated caches: the first rows filled, the rest untouched."""
    from handoff_client import HandoffClient

    with HandoffClient(target, timeout=600) as client:
        contract = client.get_contract(model)
        _, into = _caches(contract)
        print("ready", flush=True)
        handoff = client.pull(model, key, timeout=600, into=into)
        t1 = time.monotonic()
        print(json.dumps({"t1": t1, "crc": _filled_crc(contract.at(handoff.position), handoff.state)}))


def _filled_crc(filled, tensors: dict[str, np.ndarray]) -> int:
    """CRC32C over each tensor's filled rows in contract order (the bytes a prefix hand-off must deliver)."""
    from crc32c import crc32c  # (the package itself: it continues a CRC from a previous value)

    value = 0
    for c in filled.carried:
        value = crc32c(np.ascontiguousarray(tensors[c.name][: c.rows]).reshape(-1).view(np.uint8), value)
    return value


def role_handoff_rank(target: str, model: str, key: str, side: str, rank: int, tp: int) -> None:
    """One rank of a TP engine, a process of its own as in vLLM or SGLang, pushing or pulling its shard of one
    hand-off. It prints "ready" once prepared (a pusher has its shard in memory) and a pusher starts on a line read
    from stdin, so every rank starts together."""
    from handoff_client import HandoffClient, Shard, shard_arrays

    with HandoffClient(target, chunk_bytes=_chunk_bytes()) as client:
        contract = client.get_contract(model)
        mine = shard_arrays(contract, _tensors(contract), Shard(rank, tp), pushing=True) if side == "push" else None
        print("ready", flush=True)
        if side == "push":
            sys.stdin.readline()
        t0 = first = time.monotonic()
        if side == "push":
            client.push(model, key, 1, mine, shard=(rank, tp))
        else:
            first = None
            for _ in client.pull_tensors(model, key, shard=(rank, tp), timeout=120):
                first = first or time.monotonic()
        print(json.dumps({"t0": t0, "t1": time.monotonic(), "t_first": first}))


def role_handoff_pairs(target: str, model: str, pairs: int, side: str, prefix: str) -> None:
    """`pairs` threads, each pushing (or pulling) one hand-off; per-thread start and end times."""
    from handoff_client import HandoffClient

    with HandoffClient(target, chunk_bytes=_chunk_bytes()) as client:
        contract = client.get_contract(model)
        tensors = _tensors(contract)
        if side == "pull":
            print("ready", flush=True)

        def one(i: int) -> tuple[float, float]:
            start = time.monotonic()
            if side == "push":
                client.push(model, f"{prefix}-{i}", 1, tensors)
            else:
                client.pull(model, f"{prefix}-{i}", timeout=120)
            return start, time.monotonic()

        with futures.ThreadPoolExecutor(pairs) as pool:
            times = list(pool.map(one, range(pairs)))
    print(json.dumps({"times": times}))


def role_latency(kind: str, endpoint: str, nbytes: int, iterations: int) -> None:
    """Push then pull of a small payload, `iterations` times, in one process: per-iteration seconds."""
    data = payload(nbytes)
    out = np.empty(nbytes, np.uint8)
    seconds = []
    if kind == "handoff":
        from handoff_client import HandoffClient

        client = HandoffClient(endpoint)
        model = "bench-64kib"
        tensors = _tensors(client.get_contract(model))
        for i in range(iterations):
            t = time.perf_counter()
            client.push(model, f"lat-{i}", 1, tensors)
            client.pull(model, f"lat-{i}")
            seconds.append(time.perf_counter() - t)
    elif kind == "tcp":
        port = int(endpoint)
        for _ in range(iterations):
            t = time.perf_counter()
            p = socket.create_connection(("127.0.0.1", port))
            p.sendall(b"P")
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"C")
            p.sendall(memoryview(data))
            p.close()
            got, view = 0, memoryview(out)
            while got < nbytes:
                got += c.recv_into(view[got:])
            c.close()
            seconds.append(time.perf_counter() - t)
    elif kind == "redis":
        r = _Redis(int(endpoint))
        raw = data.tobytes()
        for i in range(iterations):
            t = time.perf_counter()
            r.command(b"RPUSH", f"lat-{i}".encode(), raw)
            r.command(b"BLPOP", f"lat-{i}".encode(), b"5")
            seconds.append(time.perf_counter() - t)
    elif kind == "grpc-floor":
        channel, *_ = _naive_channel(int(endpoint))
        push = channel.stream_unary("/naive.Relay/FloorPush", identity, identity)
        pull = channel.unary_stream("/naive.Relay/FloorPull", identity, identity)
        confirm = channel.unary_unary("/naive.Relay/FloorConfirm", identity, identity)
        raw = data.tobytes()
        for _ in range(iterations):
            t = time.perf_counter()
            push(iter((b"h", raw)))
            for message in pull(b""):
                out[: len(message)] = np.frombuffer(message, np.uint8)
            confirm(b"")
            seconds.append(time.perf_counter() - t)
    elif kind == "grpc-call":
        channel, *_ = _naive_channel(int(endpoint))
        call = channel.unary_unary("/naive.Relay/FloorConfirm", identity, identity)
        for _ in range(iterations):
            t = time.perf_counter()
            call(b"")
            seconds.append(time.perf_counter() - t)
    elif kind == "naive-grpc":
        _, push, pull, pb = _naive_channel(int(endpoint))
        raw = data.tobytes()
        for i in range(iterations):
            t = time.perf_counter()
            _naive_push(push, pb, f"lat-{i}", raw)
            _naive_pull(pull, pb, f"lat-{i}", out)
            seconds.append(time.perf_counter() - t)
    print(json.dumps({"seconds": seconds}))


ROLES = {name[len("role_") :].replace("_", "-"): fn for name, fn in globals().items() if name.startswith("role_")}


# -- the orchestra --------------------------------------------------------------------------------------------------


def _spawn(*args: object, fed: bool = False) -> subprocess.Popen:
    """A role process; `fed`: with a pipe to its stdin (a role that waits there for the line that starts it)."""
    stdin = subprocess.PIPE if fed else None
    return subprocess.Popen(
        [sys.executable, str(HERE), *map(str, args)], stdin=stdin, stdout=subprocess.PIPE, text=True
    )


def _result(process: subprocess.Popen, timeout: float = 600) -> dict:
    out, _ = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"{process.args[2:]} failed ({process.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def _wait_ready(process: subprocess.Popen) -> None:
    line = process.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"{process.args[2:]} did not get ready: {line!r}")


def _port_from(path: Path, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no port in {path}")
        time.sleep(0.01)
    return int(path.read_text())


@dataclass(frozen=True)
class CpuReading:
    """A process's CPU time at one moment, read two ways: each of its live threads' run time in nanoseconds
    (/proc/PID/task/TID/schedstat), and the whole process's in clock ticks (/proc/PID/stat: 10 ms apiece, but
    counting the threads that have exited too)."""

    threads: dict[int, int]
    ticks: float


def _cpu_now(pid: int) -> CpuReading:
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            threads[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # (exited as we read, or no schedstats in this kernel)
            pass
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return CpuReading(threads, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))


def _cpu_since(pid: int, before: CpuReading) -> float:
    """CPU seconds the process spent since `before`: to the nanosecond (its threads' run times since, a thread started
    since counting whole) where those add up to the process's own clock-tick count within two ticks; else that
    count, which also holds the threads that exited meanwhile (one started and gone within the run is in no list)."""
    now = _cpu_now(pid)
    ticks = now.ticks - before.ticks
    threads = sum(ns - before.threads.get(tid, 0) for tid, ns in now.threads.items()) / 1e9
    return threads if abs(threads - ticks) <= 2 / os.sysconf("SC_CLK_TCK") else ticks


def _rss(pid: int) -> tuple[int, int]:
    text = Path(f"/proc/{pid}/status").read_text()
    grab = lambda key: int(re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024  # noqa: E731
    return grab("VmRSS"), grab("VmHWM")


def _reset_peak(pid: int) -> None:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass


def _relay_run(producer: subprocess.Popen, consumer: subprocess.Popen, nbytes: int) -> dict:
    c, p = _result(consumer), _result(producer)
    if c["crc"] != crc(payload(nbytes)):
        raise RuntimeError("the consumer's bytes differ from the producer's")
    return {"seconds": c["t1"] - p["t0"], **{k: v for k, v in {**p, **c}.items() if k.startswith("t")}}


class Bench:
    def __init__(self, workdir: Path, runs: int) -> None:
        self.workdir = workdir
        self.runs = runs
        self.results: dict = {"machine": _machine(), "throughput": {}, "latency": {}, "concurrency": {}, "notes": []}
        self.redis_port: int | None = None
        self._processes: list[subprocess.Popen] = []

    def start_services(self, models: dict[str, dict]) -> None:
        contracts = self.workdir / "contracts"
        contracts.mkdir()
        for name, manifest_json in models.items():
            (contracts / f"{name}.json").write_text(json.dumps(manifest_json))
        broker = subprocess.Popen(
            [sys.executable, "-m", "handoff_broker.cli", "--log-level", "WARNING", "serve", "--port", "0",
             "--metrics-port", "-1", "--contracts", str(contracts),
             "--shared-memory-lane-min-bytes", "1MiB"],  # (each lane's row on that lane, from the lanes' 1 MiB floor)
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._processes.append(broker)
        self.broker = broker
        self.target = re.match(r"handoff-broker listening on (\S+);", broker.stdout.readline()).group(1)
        self.broker_base_rss = _rss(broker.pid)[0]
        naive_port = self.workdir / "naive.port"
        self._processes.append(_spawn("naive-grpc-relay", naive_port))
        self.naive_port = _port_from(naive_port)
        redis = shutil.which("redis-server")
        if redis:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self._processes.append(subprocess.Popen(
                [redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--proto-max-bulk-len", "512mb", "--client-output-buffer-limit", "normal 0 0 0"],
                stdout=subprocess.DEVNULL,
            ))  # fmt: skip
            deadline = time.monotonic() + 10
            while True:
                try:
                    _Redis(port).command(b"PING")
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            self.redis_port = port
        else:
            self.results["notes"].append("redis relay skipped: no redis-server on PATH (apt-get install redis-server)")

    def stop(self) -> None:
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()

    def throughput(self, label: str, model: str, nbytes: int) -> None:
        rows: dict[str, list] = {"memcpy x2": [], "tcp relay": [], "checked relay": [], "naive grpc": [],
                                 "tuned grpc": [], "handoff": [], "handoff tcp": [], "handoff shm": []}  # fmt: skip
        if self.redis_port:
            rows["redis relay"] = []
        extra: dict[str, list] = {"first_layer_fraction": []}
        cpu: dict[str, list] = {path: [] for path in HANDOFF_PATHS}
        relay_cpu: list[float] = []  # the raw relay's own, per GiB: forwarding in the kernel, checking nothing
        checked_cpu: list[float] = []  # the checked relay's: what keeping and checking the bytes adds, in Python
        port_file, checked_file = self.workdir / f"tcp-{label}.port", self.workdir / f"checked-{label}.port"
        relay = _spawn("tcp-relay", port_file, self.runs)
        checked = _spawn("checked-relay", checked_file, self.runs + 1)
        tcp_port, checked_port = _port_from(port_file), _port_from(checked_file)
        self.checked_once(checked_port, nbytes)  # untimed: its heap then holds the pages, as a serving broker's does
        self.handoff_once(model, f"{label}-warm-up")  # untimed: a serving broker has had hand-offs of this size
        for run in range(self.runs):
            r = _result(_spawn("memcpy", nbytes))
            rows["memcpy x2"].append(r["t1"] - r["t0"])
            consumer = _spawn("tcp-consumer", tcp_port, nbytes)
            _wait_ready(consumer)
            before = _cpu_now(relay.pid)
            rows["tcp relay"].append(_relay_run(_spawn("tcp-producer", tcp_port, nbytes), consumer, nbytes)["seconds"])
            relay_cpu.append(_cpu_since(relay.pid, before) / (nbytes / (1 << 30)))
            before = _cpu_now(checked.pid)
            rows["checked relay"].append(self.checked_once(checked_port, nbytes)["seconds"])
            checked_cpu.append(_cpu_since(checked.pid, before) / (nbytes / (1 << 30)))
            key = f"{label}-{run}"
            consumer = _spawn("naive-grpc-consumer", self.naive_port, nbytes, key)
            _wait_ready(consumer)
            rows["naive grpc"].append(
                _relay_run(_spawn("naive-grpc-producer", self.naive_port, nbytes, key), consumer, nbytes)["seconds"]
            )
            consumer = _spawn("raw-grpc-consumer", self.naive_port, nbytes, key)
            _wait_ready(consumer)
            time.sleep(0.1)  # the pull is waiting at the relay before the push starts, as handoff's is
            rows["tuned grpc"].append(
                _relay_run(_spawn("raw-grpc-producer", self.naive_port, nbytes, key), consumer, nbytes)["seconds"]
            )
            if self.redis_port:
                consumer = _spawn("redis-consumer", self.redis_port, nbytes, key)
                _wait_ready(consumer)
                rows["redis relay"].append(
                    _relay_run(_spawn("redis-producer", self.redis_port, nbytes, key), consumer, nbytes)["seconds"]
                )
            for path, name in HANDOFF_PATHS.items():
                consumer = _spawn("handoff-consumer", self.target, model, f"{key}-{path}", path)
                _wait_ready(consumer)
                time.sleep(0.1)  # the pull is waiting at the broker before the push starts
                before = _cpu_now(self.broker.pid)
                r = _relay_run(_spawn("handoff-producer", self.target, model, f"{key}-{path}", path), consumer, nbytes)
                rows[name].append(r["seconds"])
                cpu[path].append(_cpu_since(self.broker.pid, before) / (nbytes / (1 << 30)))
                if path == "stream":
                    extra["first_layer_fraction"].append((r["t_first"] - r["t0"]) / (r["t_end"] - r["t0"]))
        relay.wait(timeout=30)
        checked.wait(timeout=30)
        tcp, tuned = statistics.median(rows["tcp relay"]), statistics.median(rows["tuned grpc"])
        self.results["throughput"][label] = {
            "bytes": nbytes,
            "paths": {
                name: {
                    "mib_s": nbytes / MiB / statistics.median(times),
                    "vs_tcp": tcp / statistics.median(times),
                    "vs_tuned_grpc": tuned / statistics.median(times),
                }
                for name, times in rows.items()
            },
            "broker_cpu_s_per_gib": {path: statistics.median(seconds) for path, seconds in cpu.items()},
            "relay_cpu_s_per_gib": statistics.median(relay_cpu),
            "checked_relay_cpu_s_per_gib": statistics.median(checked_cpu),
            "pipelined_first_layer_at": statistics.median(extra["first_layer_fraction"]),
        }

    def prompts(self, label: str, model: str, padded: str, ctx: int, positions: list[int]) -> None:
        """Time to the decoder's KV after prompts of each length: the hand-off end to end (push start to the pull
        returning, into the decoder's whole caches), against the same hand-off padded to the full context and
        against the TCP relay moving the same filled bytes. The padded hand-off moves the same bytes at any prompt
        length, so it runs once per run."""
        rows: dict[str, list] = {f"{p} tokens": [] for p in positions}
        tcp: dict[str, list] = {f"{p} tokens": [] for p in positions}
        filled: dict[str, int] = {}
        padded_times: list[float] = []
        port_file = self.workdir / f"tcp-{model}.port"
        relay = _spawn("tcp-relay", port_file, self.runs * len(positions))
        tcp_port = _port_from(port_file)

        def through(model_name: str, key: str, position: int) -> tuple[float, int]:
            consumer = _spawn("prompt-consumer", self.target, model_name, key)
            _wait_ready(consumer)
            time.sleep(0.1)  # the pull is waiting at the broker before the push starts
            p, c = _result(_spawn("prompt-producer", self.target, model_name, key, position)), _result(consumer)
            if p["crc"] != c["crc"]:
                raise RuntimeError("the decoder's filled rows differ from the prefill's")
            return c["t1"] - p["t0"], p["bytes"]

        for run in range(self.runs):
            for position in positions:
                name = f"{position} tokens"
                seconds, filled[name] = through(model, f"{model}-{position}-{run}", position)
                rows[name].append(seconds)
                consumer = _spawn("tcp-consumer", tcp_port, filled[name])
                _wait_ready(consumer)
                producer = _spawn("tcp-producer", tcp_port, filled[name])
                tcp[name].append(_relay_run(producer, consumer, filled[name])["seconds"])
            padded_times.append(through(padded, f"{padded}-{run}", positions[0])[0])
        relay.wait(timeout=60)
        full = statistics.median(padded_times)
        self.results["prompts"] = {
            "label": label,
            "ctx": ctx,
            "padded_seconds": full,
            "rows": {
                name: {
                    "bytes": filled[name],
                    "seconds": statistics.median(times),
                    "x_faster_than_padded": full / statistics.median(times),
                    "vs_tcp": statistics.median(tcp[name]) / statistics.median(times),
                }
                for name, times in rows.items()
            },
        }

    def checked_once(self, port: int, nbytes: int) -> dict:
        consumer = _spawn("checked-consumer", port, nbytes)
        _wait_ready(consumer)
        return _relay_run(_spawn("checked-producer", port, nbytes), consumer, nbytes)

    def handoff_once(self, model: str, key: str) -> None:
        consumer = _spawn("handoff-consumer", self.target, model, key)
        _wait_ready(consumer)
        _result(_spawn("handoff-producer", self.target, model, key))
        _result(consumer)

    def peak_memory(self, model: str, nbytes: int) -> None:
        """On the fresh broker, before anything else: push whole, then pull, twice. The first time the broker holds
        all of it in pages it has never had (its peak RSS against the bytes held); the second time in the pages the
        first left it. Its CPU per GiB for both, when it is not sharing two cores with a pusher and a puller."""
        _reset_peak(self.broker.pid)
        base = _rss(self.broker.pid)[0]
        cpu_per_gib, held_rss = [], 0
        for run in ("cold", "warm"):
            before = _cpu_now(self.broker.pid)
            _result(_spawn("handoff-producer", self.target, model, f"held-{run}"))
            cpu_push = _cpu_since(self.broker.pid, before)
            held_rss = held_rss or _rss(self.broker.pid)[0]
            consumer = _spawn("handoff-consumer", self.target, model, f"held-{run}")
            _wait_ready(consumer)
            before = _cpu_now(self.broker.pid)
            _result(consumer)
            cpu_per_gib.append((cpu_push + _cpu_since(self.broker.pid, before)) / (nbytes / (1 << 30)))
        peak = _rss(self.broker.pid)[1]
        self.results["memory"] = {
            "bytes_held": nbytes,
            "rss_before_mib": base / MiB,
            "rss_holding_mib": held_rss / MiB,
            "peak_rss_mib": peak / MiB,
            "rss_kept_after_mib": _rss(self.broker.pid)[0] / MiB,
            "peak_over_base_vs_held": (peak - base) / nbytes,
            "broker_cpu_s_per_gib_push_then_pull": cpu_per_gib[0],
            "broker_cpu_s_per_gib_push_then_pull_warm": cpu_per_gib[1],
        }

    def latency(self, nbytes: int, iterations: int) -> None:
        port_file = self.workdir / "tcp-latency.port"
        relay = _spawn("tcp-relay", port_file, iterations)
        kinds = {"tcp relay": ("tcp", _port_from(port_file)), "naive grpc": ("naive-grpc", self.naive_port),
                 "grpc floor": ("grpc-floor", self.naive_port), "grpc 1 call": ("grpc-call", self.naive_port),
                 "handoff": ("handoff", self.target)}  # fmt: skip
        if self.redis_port:
            kinds["redis relay"] = ("redis", self.redis_port)
        for label, (kind, endpoint) in kinds.items():
            seconds = sorted(_result(_spawn("latency", kind, endpoint, nbytes, iterations))["seconds"])
            self.results["latency"][label] = {
                "p50_ms": 1000 * seconds[len(seconds) // 2],
                "p99_ms": 1000 * seconds[min(len(seconds) - 1, int(len(seconds) * 0.99))],
            }
        relay.wait(timeout=30)

    def resharding(self, model: str, nbytes: int) -> None:
        """The same hand-off pushed and pulled whole, at equal TP sizes, and resharded 4 -> 2 (the broker copies);
        every rank a process of its own, all pushing ranks starting together, timed from the first push's start to
        the last pull's end; and when the first decode rank had its first tensor, as a fraction of the push's
        duration (equal TP sizes stream through; a reshard is cut as the push arrives)."""
        rows, firsts = {}, {}
        for push_tp, pull_tp in ((1, 1), (2, 2), (4, 2)):
            times, first = [], []
            for run in range(self.runs):
                key = f"tp-{push_tp}-{pull_tp}-{run}"
                pullers = [_spawn("handoff-rank", self.target, model, key, "pull", r, pull_tp) for r in range(pull_tp)]
                pushers = [_spawn("handoff-rank", self.target, model, key, "push", r, push_tp, fed=True)
                           for r in range(push_tp)]  # fmt: skip
                for process in pullers + pushers:
                    _wait_ready(process)
                for pusher in pushers:
                    pusher.stdin.write("go\n")
                    pusher.stdin.flush()
                pushed, pulled = [_result(p) for p in pushers], [_result(p) for p in pullers]
                start, pushed_at = min(r["t0"] for r in pushed), max(r["t1"] for r in pushed)
                times.append(max(r["t1"] for r in pulled) - start)
                first.append((min(r["t_first"] for r in pulled) - start) / (pushed_at - start))
            rows[f"{push_tp} -> {pull_tp}"] = nbytes / MiB / statistics.median(times)
            firsts[f"{push_tp} -> {pull_tp}"] = statistics.median(first)
        whole = rows["1 -> 1"]
        self.results["resharding"] = {
            "bytes": nbytes,
            "paths": {
                name: {"mib_s": mib_s, "vs_whole": mib_s / whole, "first_tensor_at": firsts[name]}
                for name, mib_s in rows.items()
            },
        }

    def concurrency(self, model: str, nbytes: int, levels: list[int]) -> None:
        for pairs in levels:
            prefix = f"conc-{pairs}"
            pullers = _spawn("handoff-pairs", self.target, model, pairs, "pull", prefix)
            _wait_ready(pullers)
            pushers = _spawn("handoff-pairs", self.target, model, pairs, "push", prefix)
            pulled, pushed = _result(pullers)["times"], _result(pushers)["times"]
            start = min(t for t, _ in pushed)
            end = max(t for _, t in pulled)
            per_pair = [nbytes / MiB / (pulled[i][1] - pushed[i][0]) for i in range(pairs)]
            self.results["concurrency"][pairs] = {
                "aggregate_mib_s": pairs * nbytes / MiB / (end - start),
                "slowest_pair_mib_s": min(per_pair),
                "fastest_pair_mib_s": max(per_pair),
            }


def _machine() -> dict:
    cpu = "unknown"
    try:
        cpu = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE).group(1)
    except (OSError, AttributeError):
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": sys.version.split()[0]}


def report(results: dict) -> str:
    lines = [
        f"machine: {results['machine']['cpus']} cpus, {results['machine']['cpu']}, Python {results['machine']['python']}"
    ]
    if results.get("quick"):
        lines.insert(0, "QUICK RUN: a smoke test of the benchmark itself (small sizes, few runs); not measurements")
    for label, row in results["throughput"].items():
        lines.append(f"\n{label} ({row['bytes'] / MiB:.0f} MiB)           MiB/s    x tcp relay   x tuned grpc")
        for name, figures in row["paths"].items():
            lines.append(
                f"  {name:<14} {figures['mib_s']:>10.0f}    {figures['vs_tcp']:>6.2f}       {figures['vs_tuned_grpc']:>6.2f}"
            )
        if row["bytes"] < 16 * MiB:  # a few milliseconds: fixed costs per call, and clock skew between processes
            lines.append("  (broker CPU and pipelining are reported from 16 MiB up: below, fixed costs dominate them)")
            continue
        cpu = row["broker_cpu_s_per_gib"]
        lines.append(
            f"  broker CPU, s per GiB moved: {cpu['stream']:.2f} on the streams, {cpu['tcp']:.2f} on the TCP lane, "
            f"{cpu['shm']:.2f} on the shared-memory lane (the raw TCP relay: {row['relay_cpu_s_per_gib']:.2f}, the "
            f"checked relay: {row['checked_relay_cpu_s_per_gib']:.2f}); "
            f"pipelined pull had its first tensor at "
            f"{100 * row['pipelined_first_layer_at']:.1f}% of the push's duration"
        )
    if "prompts" in results:
        r = results["prompts"]
        lines.append(
            f"\n{r['label']}: prefill push to decoder's KV     MiB     ms   x faster than padded   x tcp relay"
        )
        for name, figures in r["rows"].items():
            lines.append(
                f"  {name:<12} {figures['bytes'] / MiB:>34.0f} {1000 * figures['seconds']:>6.0f}"
                f" {figures['x_faster_than_padded']:>22.1f} {figures['vs_tcp']:>13.2f}"
            )
        lines.append(f"  padded to the full {r['ctx']} context (any prompt): {1000 * r['padded_seconds']:.0f} ms")
    if results["latency"]:
        lines.append("\nsmall hand-off, push then pull (64 KiB)   p50 ms    p99 ms")
        for name, figures in results["latency"].items():
            lines.append(f"  {name:<14} {figures['p50_ms']:>24.2f} {figures['p99_ms']:>9.2f}")
    if results["concurrency"]:
        lines.append("\nconcurrent pusher/puller pairs (handoff)   aggregate MiB/s   slowest pair   fastest pair")
        for pairs, figures in results["concurrency"].items():
            lines.append(
                f"  {pairs:>3} pairs {figures['aggregate_mib_s']:>33.0f} {figures['slowest_pair_mib_s']:>14.0f}"
                f" {figures['fastest_pair_mib_s']:>14.0f}"
            )
    if "resharding" in results:
        r = results["resharding"]
        lines.append(
            f"\ntensor-parallel ranks, prefill TP -> decode TP ({r['bytes'] / MiB:.0f} MiB)   MiB/s   x whole"
            "   first tensor at"
        )
        for name, figures in r["paths"].items():
            lines.append(
                f"  {name:<10} {figures['mib_s']:>36.0f} {figures['vs_whole']:>9.2f}"
                f" {100 * figures['first_tensor_at']:>14.1f}% of the push"
            )
    if "memory" in results:
        m = results["memory"]
        lines.append(
            f"\nbroker memory holding {m['bytes_held'] / MiB:.0f} MiB: RSS {m['rss_before_mib']:.0f} MiB before, "
            f"{m['rss_holding_mib']:.0f} MiB holding, peak {m['peak_rss_mib']:.0f} MiB "
            f"(peak - before = {m['peak_over_base_vs_held']:.2f} x the bytes held), {m['rss_kept_after_mib']:.0f} MiB "
            f"kept after for the next pushes (until --trim-after idle)\nbroker CPU for a push then its pull, one at a "
            f"time: {m['broker_cpu_s_per_gib_push_then_pull']:.2f} s per GiB into a fresh broker, "
            f"{m['broker_cpu_s_per_gib_push_then_pull_warm']:.2f} s per GiB into the pages the first one left"
        )
    lines += [f"note: {n}" for n in results["notes"]]
    return "\n".join(lines)


SECTIONS = ("memory", "throughput", "prompts", "latency", "resharding", "concurrency")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ROLES:
        from handoff_client import tune_allocator

        tune_allocator()  # every path's processes run with the allocator settings the broker sets for itself
        fn = ROLES[argv[0]]
        annotations = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
        kinds = {k: int for k in ("port", "nbytes", "runs", "iterations", "pairs", "rank", "tp")}
        fn(*[kinds.get(name, str)(value) for name, value in zip(annotations, argv[1:])])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and few runs (CI's smoke run)")
    parser.add_argument("--runs", type=int, help="runs per path and size (median reported); default 3, quick 2")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--chunk-bytes", type=int, help="the handoff client's chunk size (default: the client's own)")
    parser.add_argument("--only", choices=SECTIONS, action="append",
                        help="run only this section (repeatable; default: every one)")  # fmt: skip
    args = parser.parse_args(argv)
    only = set(args.only or SECTIONS)
    if args.chunk_bytes:
        os.environ["BENCH_CHUNK_BYTES"] = str(args.chunk_bytes)
    runs = args.runs or (2 if args.quick else 3)
    sizes = (
        {"1 MiB": MiB, "16 MiB": 16 * MiB} if args.quick else {"1 MiB": MiB, "16 MiB": 16 * MiB, "256 MiB": 256 * MiB}
    )
    models = {f"bench-{label.replace(' ', '').lower()}": manifest(f"bench-{label.replace(' ', '').lower()}", n)
              for label, n in sizes.items()}  # fmt: skip
    models["bench-64kib"] = manifest("bench-64kib", 64 << 10)
    if not args.quick:
        models[LLAMA3_8B_4K["model"]] = LLAMA3_8B_4K
    # Time to the decoder's KV by prompt length: Llama-3-8B at 32k (quick: two of its layers at 4k, a smoke run).
    prompt_ctx, prompt_layers = (4096, 2) if args.quick else (32768, 32)
    positions = [512, 2048] if args.quick else [512, 2048, 8192]
    models["llama-3-8b-prompts"] = llama3_8b("llama-3-8b-prompts", prompt_ctx, prompt_layers, positional=True)
    models["llama-3-8b-padded"] = llama3_8b("llama-3-8b-padded", prompt_ctx, prompt_layers)
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(Path(tmp), runs)
        bench.results["quick"] = args.quick
        try:
            bench.start_services(models)
            big = max(sizes.values())
            if "memory" in only:
                bench.peak_memory(f"bench-{[k for k, v in sizes.items() if v == big][0].replace(' ', '').lower()}", big)
            if "throughput" in only:
                for label, nbytes in sizes.items():
                    bench.throughput(label, f"bench-{label.replace(' ', '').lower()}", nbytes)
                if not args.quick:
                    bench.throughput("Llama-3-8B, 4k ctx, bf16", LLAMA3_8B_4K["model"], 512 * MiB)
            if "prompts" in only:
                bench.prompts(
                    f"Llama-3-8B{' (2 layers)' if args.quick else ''}, {prompt_ctx // 1024}k ctx",
                    "llama-3-8b-prompts", "llama-3-8b-padded", prompt_ctx, positions,
                )  # fmt: skip
            if "latency" in only:
                bench.latency(64 << 10, 50 if args.quick else 300)
            if "resharding" in only:
                bench.resharding(
                    "bench-256mib" if not args.quick else "bench-16mib", 256 * MiB if not args.quick else 16 * MiB
                )
            if "concurrency" in only:
                bench.concurrency(
                    "bench-16mib" if not args.quick else "bench-1mib",
                    16 * MiB if not args.quick else MiB,
                    [1, 4] if args.quick else [1, 4, 16],
                )
        finally:
            bench.stop()
    print(report(bench.results))
    if args.json:
        Path(args.json).write_text(json.dumps(bench.results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
