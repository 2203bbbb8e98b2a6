"""A small hand-off's round trip, in one run: push then pull of 64 KiB through handoff-broker (push, pull and
confirm), against the gRPC floor — handoff's three calls (a 2-message client stream, a 3-message server stream, a
unary confirm) carrying the same bytes to a server that does nothing, what grpcio itself costs — and against one
empty unary call, the raw TCP relay, the naive gRPC relay and Redis.

    python benchmarks/latency.py            # 300 round trips of each
    python benchmarks/latency.py --quick    # 50

Each kind is one client process doing its round trips back to back; p50 and p99 of each, and each p50 as a multiple
of the gRPC floor's (the baseline).
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
from _grpc_relay import identity, naive_channel, naive_pull, naive_push
from _handoff_roles import tensors_of
from _harness import Redis, Services, arguments, finish, manifest, payload, port_from, result, setting_up, spawn

MODEL = "bench-64kib"
NBYTES = 64 << 10


def role_latency(kind: str, endpoint: str, nbytes: int, iterations: int) -> None:
    """Push then pull of a small payload, `iterations` times, in one process: per-iteration seconds."""
    data = payload(nbytes)
    out = np.empty(nbytes, np.uint8)
    seconds = []
    if kind == "handoff":
        from handoff_client import HandoffClient

        client = HandoffClient(endpoint)
        tensors = tensors_of(client.get_contract(MODEL))
        for i in range(iterations):
            t = time.perf_counter()
            client.push(MODEL, f"lat-{i}", 1, tensors)
            client.pull(MODEL, f"lat-{i}")
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
        r = Redis(int(endpoint))
        raw = data.tobytes()
        for i in range(iterations):
            t = time.perf_counter()
            r.command(b"RPUSH", f"lat-{i}".encode(), raw)
            r.command(b"BLPOP", f"lat-{i}".encode(), b"5")
            seconds.append(time.perf_counter() - t)
    elif kind == "grpc-floor":
        channel, *_ = naive_channel(int(endpoint))
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
        channel, *_ = naive_channel(int(endpoint))
        call = channel.unary_unary("/naive.Relay/FloorConfirm", identity, identity)
        for _ in range(iterations):
            t = time.perf_counter()
            call(b"")
            seconds.append(time.perf_counter() - t)
    elif kind == "naive-grpc":
        _, push, pull, pb = naive_channel(int(endpoint))
        raw = data.tobytes()
        for i in range(iterations):
            t = time.perf_counter()
            naive_push(push, pb, f"lat-{i}", raw)
            naive_pull(pull, pb, f"lat-{i}", out)
            seconds.append(time.perf_counter() - t)
    print(json.dumps({"seconds": seconds}))


def measure(services: Services, iterations: int) -> dict:
    """p50 and p99 of each kind's round trips, and each p50 against the gRPC floor's."""
    _, target = services.broker({MODEL: manifest(MODEL, NBYTES)})
    naive_port, redis_port = services.naive_relay(), services.redis()
    port_file = services.workdir / "tcp-latency.port"
    relay = services.keep(spawn("tcp-relay", port_file, iterations))
    kinds = {"tcp relay": ("tcp", port_from(port_file)), "naive grpc": ("naive-grpc", naive_port),
             "grpc floor": ("grpc-floor", naive_port), "grpc 1 call": ("grpc-call", naive_port),
             "handoff": ("handoff", target)}  # fmt: skip
    if redis_port:
        kinds["redis relay"] = ("redis", redis_port)
    figures = {}
    for label, (kind, endpoint) in kinds.items():
        seconds = sorted(result(spawn("latency", kind, endpoint, NBYTES, iterations))["seconds"])
        figures[label] = {
            "p50_ms": 1000 * seconds[len(seconds) // 2],
            "p99_ms": 1000 * seconds[min(len(seconds) - 1, int(len(seconds) * 0.99))],
        }
    relay.wait(timeout=30)
    floor = figures["grpc floor"]["p50_ms"]
    for row in figures.values():
        row["vs_floor"] = row["p50_ms"] / floor
    return figures


def report(results: dict) -> list[str]:
    lines = ["\nsmall hand-off, push then pull (64 KiB)   p50 ms    p99 ms   p50 x grpc floor"]
    for name, figures in results["latency"].items():
        lines.append(f"  {name:<14} {figures['p50_ms']:>24.2f} {figures['p99_ms']:>9.2f} {figures['vs_floor']:>18.2f}")
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__).parse_args(argv)
    _, results = setting_up(args)
    with tempfile.TemporaryDirectory() as tmp, Services(Path(tmp)) as services:
        results["latency"] = measure(services, 50 if args.quick else 300)
        results["notes"] += services.notes
    finish(results, report(results), args.json)
    return results


if __name__ == "__main__":
    main()
