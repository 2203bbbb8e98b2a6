"""The baselines' role processes, no handoff-broker in them: two copies in one process, a raw TCP relay, a checked
relay (a lane's duties and nothing else) and Redis. Each role prints one JSON line ("t0" when its producer started,
"t1" and "crc" when its consumer is done); a consumer prints "ready" first, once connected and its destination
touched. Run through `_roles.py` (role `tcp-relay` is `role_tcp_relay`, and so on)."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from pathlib import Path

import numpy as np
from _harness import RELAY_BUFFER, MiB, Redis, crc, destination, payload

CHECKED_FRAME = 1 * MiB
# Free bytes the checked relay's heap keeps: more than the largest payload, as a broker keeps up to its --max-bytes.
RELAY_KEEP = 1 << 30


def role_memcpy(nbytes: int) -> None:
    """The copy limit: one process copies the payload twice, into pages touched beforehand."""
    src = payload(nbytes)
    mid, out = np.empty_like(src), np.empty_like(src)
    mid[:] = 0
    out[:] = 0  # touch the pages first: we time copies, not page faults
    t0 = time.monotonic()
    np.copyto(mid, src)
    np.copyto(out, mid)
    t1 = time.monotonic()
    print(json.dumps({"t0": t0, "t1": t1, "crc": crc(out)}))


def role_tcp_relay(port_file: str, runs: int) -> None:
    """Raw sockets through a middle process, 4 MiB buffers, streaming through: `runs` transfers, then exit."""
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


def role_checked_relay(port_file: str, runs: int) -> None:
    """The TCP lane's wire (handoff_client.protocol.lane: its socket settings, frame headers and end marker) between two
    raw sockets: receives and checks on one thread, forwards on another, as the broker's push and pipelined pull do."""
    from handoff_client import tune_allocator
    from handoff_client.protocol.lane import read_header, recv_into_exact, send_end, send_frame, tune

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
    from handoff_client.protocol.lane import send_end, send_frame, tune

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
    from handoff_client.protocol.lane import read_header, recv_into_exact, tune

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


def role_redis_producer(port: int, nbytes: int, key: str) -> None:
    """RPUSH of 4 MiB values through redis-server."""
    data = payload(nbytes).tobytes()
    r = Redis(port)
    t0 = time.monotonic()
    for at in range(0, nbytes, RELAY_BUFFER):
        r.command(b"RPUSH", key.encode(), data[at : at + RELAY_BUFFER])
    print(json.dumps({"t0": t0}))


def role_redis_consumer(port: int, nbytes: int, key: str) -> None:
    """BLPOP of the producer's values into the destination."""
    out = destination(nbytes)
    r = Redis(port)
    print("ready", flush=True)
    got = 0
    while got < nbytes:
        _, value = r.command(b"BLPOP", key.encode(), b"30")
        out[got : got + len(value)] = np.frombuffer(value, np.uint8)
        got += len(value)
    print(json.dumps({"t1": time.monotonic(), "crc": crc(out)}))
