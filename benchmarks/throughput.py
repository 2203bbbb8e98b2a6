"""Throughput, side by side on the same payloads in one run: a hand-off through handoff-broker against what a user
would pick instead, and against the limits of this machine.

    python benchmarks/throughput.py            # 1, 16, 256 MiB and a Llama-3-8B hand-off (4k context, bf16)
    python benchmarks/throughput.py --quick    # 16 MiB alone, fewer runs (the test suite's smoke run)

Every path is three processes on this machine — a producer, a relay in the middle, a consumer — and every payload is
verified at the consumer (CRC32C against the producer's). Paths:
    memcpy x2     one process copies the payload twice: the copy limit
    tcp relay     raw sockets through a middle process, 4 MiB buffers, streaming through (the baseline: "x tcp relay")
    checked relay the same sockets doing a lane's duties and nothing else: 1 MiB frames on the TCP lane's wire, each
                  with a CRC32C, which the producer computes, the relay checks on the copy it keeps (until the transfer
                  ends, as a broker keeps a hand-off until its confirm) and forwards from another thread, and the
                  consumer checks on its destination; what checked store-and-forward costs in Python here, with no
                  control plane at all
    redis relay   RPUSH / BLPOP of 4 MiB values through redis-server (skipped when there is no redis-server)
    naive grpc    protobuf `bytes` chunks of 1 MiB, client-stream in, store, server-stream out
    tuned grpc    the best relay grpcio's Python API allows: 4 MiB messages of raw bytes (no protobuf), forwarded
                  untouched as they arrive, no checks; the ceiling for any design that keeps gRPC streams through
                  Python (the second baseline: "x tuned grpc")
    handoff       handoff-broker end to end: a pusher process, the broker, a puller process, the client library;
                  the pull is made before the push, so the broker streams the push through as it is checked; the
                  bytes on the gRPC streams (lanes=False)
    handoff tcp   the same with the bytes on the broker's TCP lane (docs/lanes.md), every frame checked the same
    handoff shm   the same on its shared-memory lane (pusher and puller on the broker's host), checked the same
Every process runs with `handoff_client.tune_allocator()`, as the broker does. Before each size's runs one untimed
hand-off of that size goes through the broker, as through any broker that has been serving. Throughput is bytes over
(consumer done - producer start), the median of --runs; the broker's CPU is read from /proc, seconds per GiB moved.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from _handoff_roles import PATHS
from _harness import (
    MiB,
    Services,
    arguments,
    cpu_now,
    cpu_since,
    finish,
    llama3_8b,
    manifest,
    model_name,
    port_from,
    relay_run,
    result,
    setting_up,
    spawn,
    wait_ready,
)

LLAMA3_8B_4K = llama3_8b("llama-3-8b-4k", 4096)


class Throughput:
    """One size's paths, run by run, every service started once for all sizes."""

    def __init__(self, services: Services, models: dict[str, dict], runs: int) -> None:
        self.services = services
        self.workdir = services.workdir
        self.runs = runs
        self.broker, self.target = services.broker(models)
        self.naive_port = services.naive_relay()
        self.redis_port = services.redis()

    def size(self, label: str, model: str, nbytes: int) -> dict:
        """Every path's MiB/s at one size, its ratios to the TCP relay and the tuned gRPC relay, and CPU per GiB."""
        rows: dict[str, list] = {"memcpy x2": [], "tcp relay": [], "checked relay": [], "naive grpc": [],
                                 "tuned grpc": [], "handoff": [], "handoff tcp": [], "handoff shm": []}  # fmt: skip
        if self.redis_port:
            rows["redis relay"] = []
        first_layer: list[float] = []
        cpu: dict[str, list] = {path: [] for path in PATHS}
        relay_cpu: list[float] = []  # the raw relay's own, per GiB: forwarding in the kernel, checking nothing
        checked_cpu: list[float] = []  # the checked relay's: what keeping and checking the bytes adds, in Python
        gib = nbytes / (1 << 30)
        port_file, checked_file = self.workdir / f"tcp-{label}.port", self.workdir / f"checked-{label}.port"
        relay = self.services.keep(spawn("tcp-relay", port_file, self.runs))
        checked = self.services.keep(spawn("checked-relay", checked_file, self.runs + 1))
        tcp_port, checked_port = port_from(port_file), port_from(checked_file)
        self.checked_once(checked_port, nbytes)  # untimed: its heap then holds the pages, as a serving broker's does
        self.handoff_once(model, f"{label}-warm-up")  # untimed: a serving broker has had hand-offs of this size
        for run in range(self.runs):
            r = result(spawn("memcpy", nbytes))
            rows["memcpy x2"].append(r["t1"] - r["t0"])
            consumer = spawn("tcp-consumer", tcp_port, nbytes)
            wait_ready(consumer)
            before = cpu_now(relay.pid)
            rows["tcp relay"].append(relay_run(spawn("tcp-producer", tcp_port, nbytes), consumer, nbytes)["seconds"])
            relay_cpu.append(cpu_since(relay.pid, before) / gib)
            before = cpu_now(checked.pid)
            rows["checked relay"].append(self.checked_once(checked_port, nbytes)["seconds"])
            checked_cpu.append(cpu_since(checked.pid, before) / gib)
            key = f"{label}-{run}"
            rows["naive grpc"].append(self.relayed("naive-grpc", self.naive_port, nbytes, key))
            rows["tuned grpc"].append(self.relayed("raw-grpc", self.naive_port, nbytes, key, settle=True))
            if self.redis_port:
                rows["redis relay"].append(self.relayed("redis", self.redis_port, nbytes, key))
            for path, name in PATHS.items():
                consumer = spawn("handoff-consumer", self.target, model, f"{key}-{path}", path)
                wait_ready(consumer)
                time.sleep(0.1)  # the pull is waiting at the broker before the push starts
                before = cpu_now(self.broker.pid)
                r = relay_run(spawn("handoff-producer", self.target, model, f"{key}-{path}", path), consumer, nbytes)
                rows[name].append(r["seconds"])
                cpu[path].append(cpu_since(self.broker.pid, before) / gib)
                if path == "stream":
                    first_layer.append((r["t_first"] - r["t0"]) / (r["t_end"] - r["t0"]))
        relay.wait(timeout=30)
        checked.wait(timeout=30)
        tcp, tuned = statistics.median(rows["tcp relay"]), statistics.median(rows["tuned grpc"])
        return {
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
            "pipelined_first_layer_at": statistics.median(first_layer),
        }

    def relayed(self, kind: str, port: int, nbytes: int, key: str, settle: bool = False) -> float:
        """One transfer through a relay's `kind`-producer and `kind`-consumer roles; `settle`: the pull waits at the
        relay before the push starts, as handoff's does."""
        consumer = spawn(f"{kind}-consumer", port, nbytes, key)
        wait_ready(consumer)
        if settle:
            time.sleep(0.1)
        return relay_run(spawn(f"{kind}-producer", port, nbytes, key), consumer, nbytes)["seconds"]

    def checked_once(self, port: int, nbytes: int) -> dict:
        consumer = spawn("checked-consumer", port, nbytes)
        wait_ready(consumer)
        return relay_run(spawn("checked-producer", port, nbytes), consumer, nbytes)

    def handoff_once(self, model: str, key: str) -> None:
        consumer = spawn("handoff-consumer", self.target, model, key)
        wait_ready(consumer)
        result(spawn("handoff-producer", self.target, model, key))
        result(consumer)


def report(results: dict) -> list[str]:
    lines = []
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
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__).parse_args(argv)
    runs, results = setting_up(args)
    # (--quick: one size, the smallest whose row reports the broker's CPU: each size costs its ~20 role processes)
    sizes = {"16 MiB": 16 * MiB} if args.quick else {"1 MiB": MiB, "16 MiB": 16 * MiB, "256 MiB": 256 * MiB}
    models = {model_name(label): manifest(model_name(label), n) for label, n in sizes.items()}
    if not args.quick:
        models[LLAMA3_8B_4K["model"]] = LLAMA3_8B_4K
    results["throughput"] = {}
    with tempfile.TemporaryDirectory() as tmp, Services(Path(tmp)) as services:
        bench = Throughput(services, models, runs)
        for label, nbytes in sizes.items():
            results["throughput"][label] = bench.size(label, model_name(label), nbytes)
        if not args.quick:
            results["throughput"]["Llama-3-8B, 4k ctx, bf16"] = bench.size("llama", LLAMA3_8B_4K["model"], 512 * MiB)
        results["notes"] += services.notes
    finish(results, report(results), args.json)
    return results


if __name__ == "__main__":
    main()
