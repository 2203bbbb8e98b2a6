"""What the lanes' openings cost a broker under the attacks of issue 27, each against a baseline of the same run.

    python benchmarks/lane_openings.py            # prints one JSON object

    idle connections    a TCP lane push and pull of 16 MiB, alone and beside 80 idle connections to the lane port
                        (more than the 64 openings the broker reads at once); broker --idle-timeout 30 s
    cancelled pulls     the slowest health check among 24 'pull offered a lane, read its header, cancel' calls on a
                        broker of 8 workers, against the slowest of 24 health checks alone
    out of descriptors  a broker process's CPU over 2 s idle, and over 2 s with its descriptor limit at what it holds
                        plus 4 and 32 connections waiting in the lane port's backlog

Tests guard each (tests/test_lane_openings.py); this prints the figures. Before the fixes: each lane call beside
the idle connections waited out --idle-timeout (30 s); health stopped answering at the 9th cancelled pull; the broker
out of descriptors spun 1.35 s of CPU in 2 s (issue 27: 1.7-2.95 s a 3 s).
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from handoff_broker import BrokerConfig, build_server
from handoff_client import HandoffClient
from handoff_client.protocol.contract import Carried, Contract
from handoff_client.protocol.lane import new_capability
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import decode_pull_response, method_path

LARGE = Contract("large", 1025, 64, tuple(Carried(f"k{i}", i, 1024, 1024, "float32") for i in range(4)))  # 16 MiB
TENSORS = {c.name: np.ones(c.shape, np.float32) for c in LARGE.carried}


def broker(**overrides: object):
    config = BrokerConfig(host="127.0.0.1", port=0, contracts={"large": LARGE}, idle_timeout=30.0,
                          max_bytes=256 << 20, shared_memory_lane=False, **overrides)  # fmt: skip
    started, _ = build_server(config)
    return started.start()


def hand_off_seconds(client: HandoffClient, handoff_id: str) -> float:
    started = time.monotonic()
    client.push("large", handoff_id, 1, TENSORS)
    client.pull("large", handoff_id)
    return time.monotonic() - started


def idle_connections() -> dict:
    b = broker()
    try:
        with HandoffClient(b.address, timeout=60) as client:
            alone = [hand_off_seconds(client, f"alone-{n}") for n in range(5)]
            idle = [socket.create_connection(("127.0.0.1", client.lane().port)) for _ in range(80)]
            try:
                beside = [hand_off_seconds(client, f"beside-{n}") for n in range(5)]
            finally:
                for sock in idle:
                    sock.close()
    finally:
        b.stop(grace=0.2)
    return {"alone_seconds": round(statistics.median(alone), 3), "beside_80_idle_seconds": round(
        statistics.median(beside), 3), "ratio": round(statistics.median(beside) / statistics.median(alone), 2)}  # fmt: skip


def health_seconds(channel: grpc.Channel) -> float:
    started = time.monotonic()
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return time.monotonic() - started


def cancelled_pulls() -> dict:
    b = broker(workers=8)
    try:
        with HandoffClient(b.address) as client, grpc.insecure_channel(b.address) as channel:
            client.push("large", "r", 1, TENSORS)
            alone = max(health_seconds(channel) for _ in range(24))
            pull = channel.unary_stream(method_path("PullHandoff"), request_serializer=pb.PullRequest.SerializeToString,
                                        response_deserializer=decode_pull_response)  # fmt: skip
            worst = 0.0
            for _ in range(24):
                stream = pull(pb.PullRequest(model="large", handoff_id="r", lane_capability=new_capability()))
                next(stream)
                stream.cancel()
                worst = max(worst, health_seconds(channel))
    finally:
        b.stop(grace=0.2)
    return {"worst_health_alone_seconds": round(alone, 4), "worst_health_seconds": round(worst, 4),
            "ratio": round(worst / alone, 1)}  # fmt: skip


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def out_of_descriptors() -> dict:
    command = [sys.executable, "-m", "handoff_broker", "--log-level", "ERROR", "serve", "--port", "0",
               "--metrics-port", "-1", "--no-shared-memory-lane"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    idle: list[socket.socket] = []
    try:
        address = re.match(r"handoff-broker listening on (\S+);", process.stdout.readline()).group(1)
        with HandoffClient(address) as client:
            port = client.lane().port
        time.sleep(0.5)
        before = cpu_seconds(process.pid)
        time.sleep(2.0)
        idle_cpu = cpu_seconds(process.pid) - before
        held = len(os.listdir(f"/proc/{process.pid}/fd"))
        _, hard = resource.prlimit(process.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (held + 4, hard))
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
        time.sleep(0.5)
        before = cpu_seconds(process.pid)
        time.sleep(2.0)
        starved_cpu = cpu_seconds(process.pid) - before
    finally:
        for sock in idle:
            sock.close()
        process.terminate()
        process.wait(timeout=20)
    return {"idle_cpu_seconds_in_2s": round(idle_cpu, 3), "out_of_descriptors_cpu_seconds_in_2s": round(starved_cpu, 3),
            "difference_seconds": round(starved_cpu - idle_cpu, 3)}  # fmt: skip


def main() -> int:
    report = {"idle_connections": idle_connections(), "cancelled_pulls": cancelled_pulls(),
              "out_of_descriptors": out_of_descriptors()}  # fmt: skip
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
