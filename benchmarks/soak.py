"""An adversarial soak: a broker process at every limit a client can push against at once, while a good client
works through it and a prober asks for health and status.

    python benchmarks/soak.py --seconds 120          # by hand, a longer run (tests/test_soak.py runs a short one)

Attackers, each a few threads looping for the whole run:
    waiting pulls     pulls of hand-offs nobody pushes (past the waiting budget: BROKER_BUSY at once)
    silent pushes     push streams that never send their header (ended after --idle-timeout)
    stalled readers   pulls that read one chunk through a 64 KiB window and stop (revoked after --lease)
    tiny chunks       pushes of 1-byte chunks (refused past the store's chunk budget)
    bad numbers       a TP size of 2**31, a NaN ttl, a 100 KB tensor name, an id that is not UTF-8
Meanwhile a prober calls health and GetStatus every 0.25 s (1 s deadline each) and a good client pushes and pulls a
hand-off (retrying BROKER_BUSY as clients do). At the end: what the broker holds, the streams it still serves, its
threads (gRPC's pool keeps the threads it started, idle: at most --workers) and its RSS (trimmed once idle) against
their start. The broker runs with --workers 32, so its limits are reached with a few dozen calls.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from handoff_client import HandoffClient, HandoffError, RetryPolicy
from handoff_client._client import CHANNEL_OPTIONS
from handoff_client.protocol.errors import from_rpc_error
from handoff_client.protocol.frames import encode_chunk
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import decode_pull_response, identity, method_path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "demo-hybrid"
WORKERS = 32
PATIENT = RetryPolicy(attempts=40, initial_backoff=0.05, max_backoff=0.5)


def proc_status(pid: int) -> dict[str, int]:
    """RSS (bytes) and thread count of a process, from /proc."""
    text = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024
    threads = int(re.search(r"^Threads:\s+(\d+)", text, re.MULTILINE).group(1))
    return {"rss": rss, "threads": threads}


def streams_in_flight(metrics_url: str) -> int:
    """Push and pull streams the broker is serving, from its /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return int(sum(float(v) for v in re.findall(r"^handoff_streams_in_flight\{[^}]*\} (\S+)$", text, re.MULTILINE)))


class Soak:
    def __init__(self, address: str, contract) -> None:
        self.address = address
        self.contract = contract
        self.stop = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.probe_worst = 0.0
        self.probe_failures: list[str] = []
        self.good = 0
        self.good_failures: list[str] = []

    def note(self, what: str) -> None:
        with self.lock:
            self.outcomes[what] += 1

    def loop(self, attack: Callable[[grpc.Channel, int], None], name: str, threads: int) -> list[threading.Thread]:
        def run(index: int) -> None:
            with grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
                n = 0
                while not self.stop.is_set():
                    n += 1
                    try:
                        attack(channel, index * 1_000_000 + n)
                        self.note(f"{name}: ended")
                    except grpc.RpcError as e:
                        self.note(f"{name}: {type(from_rpc_error(e)).__name__}")
                    except HandoffError as e:
                        self.note(f"{name}: {type(e).__name__}")

        return [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]

    # -- the attacks ---------------------------------------------------------------------------------------------------

    def waiting_pull(self, channel: grpc.Channel, n: int) -> None:
        pull = channel.unary_stream(method_path("PullHandoff"), request_serializer=pb.PullRequest.SerializeToString)
        list(pull(pb.PullRequest(model=MODEL, handoff_id=f"never-{n}"), timeout=2))

    def silent_push(self, channel: grpc.Channel, n: int) -> None:
        push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity)

        def silence():  # sends nothing, not even a header: the broker ends it
            self.stop.wait(30)
            yield from ()

        push(silence(), timeout=30)

    def stalled_reader(self, channel: grpc.Channel, n: int) -> None:
        with HandoffClient(self.address, retry=PATIENT, timeout=10) as client:
            client.push(MODEL, f"stall-{n}", 1, self.tensors(n))
        with grpc.insecure_channel(self.address, options=[("grpc.http2.bdp_probe", 0)]) as narrow:
            pull = narrow.unary_stream(method_path("PullHandoff"), request_serializer=pb.PullRequest.SerializeToString,
                                       response_deserializer=decode_pull_response)  # fmt: skip
            stream = pull(pb.PullRequest(model=MODEL, handoff_id=f"stall-{n}"), timeout=30)
            next(stream), next(stream)
            self.stop.wait(4)  # past the 2 s lease: revoked; the hand-off goes back, and expires unclaimed
            stream.cancel()
        with HandoffClient(self.address, retry=PATIENT, timeout=10) as client:
            client.cancel(MODEL, f"stall-{n}")

    def tiny_chunks(self, channel: grpc.Channel, n: int) -> None:
        push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity)
        header = pb.PushHeader(model=MODEL, handoff_id=f"tiny-{n}", position=1, fingerprint=self.contract.fingerprint)
        memory = next(c for c in self.contract.carried if c.name.endswith("memory"))
        frames = [pb.PushRequest(header=header).SerializeToString()]
        frames += [encode_chunk(memory.name, i, b"\1") for i in range(20_000)]
        push(iter(frames), timeout=30)

    def bad_numbers(self, channel: grpc.Channel, n: int) -> None:
        pull = channel.unary_stream(method_path("PullHandoff"), request_serializer=identity)
        for request in (
            pb.PullRequest(model=MODEL, handoff_id="x", shard=pb.Shard(rank=0, size=2**31)).SerializeToString(),
            pb.PullRequest(model=MODEL).SerializeToString() + b"\x12\x02\xff\xfe",
        ):
            try:
                list(pull(request, timeout=2))
            except grpc.RpcError as e:
                self.note(f"bad numbers: {type(from_rpc_error(e)).__name__}")
        push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity)
        header = pb.PushHeader(model=MODEL, handoff_id=f"nan-{n}", position=1, fingerprint=self.contract.fingerprint,
                               ttl_seconds=float("nan"))  # fmt: skip
        frames = [pb.PushRequest(header=header).SerializeToString(), encode_chunk("x" * 100_000, 0, b"\0")]
        push(iter(frames), timeout=2)

    # -- the good client and the prober --------------------------------------------------------------------------------

    def tensors(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        filled = self.contract.at(1)
        return {c.name: rng.integers(0, 256, c.nbytes, dtype=np.uint8).view(c.numpy_dtype).reshape(c.shape)
                for c in filled.carried}  # fmt: skip

    def good_client(self) -> None:
        with HandoffClient(self.address, retry=PATIENT, timeout=20) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                tensors = self.tensors(-n % 2**31)
                try:
                    client.push(MODEL, f"good-{n}", 1, tensors)
                    got = client.pull(MODEL, f"good-{n}").state
                    assert all(got[k].tobytes() == v.tobytes() for k, v in tensors.items())
                    self.good += 1
                except HandoffError as e:
                    self.good_failures.append(f"{type(e).__name__}: {e.message}")
                self.stop.wait(0.5)

    def prober(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = channel.unary_unary(method_path("GetStatus"), request_serializer=pb.StatusRequest.SerializeToString,
                                         response_deserializer=pb.StatusResponse.FromString)  # fmt: skip
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    status(pb.StatusRequest(), timeout=1)
                except grpc.RpcError as e:
                    self.probe_failures.append(f"{e.code().name}: {e.details()}")
                self.probe_worst = max(self.probe_worst, time.monotonic() - started)
                self.stop.wait(0.25)


def run(seconds: float) -> dict:
    """Start a broker process, soak it for `seconds`, let it settle, and report."""
    command = [sys.executable, "-m", "handoff_broker", "--log-level", "ERROR", "serve", "--port", "0",
               "--metrics-port", "0", "--contracts", str(ROOT / "tests" / "manifests"), "--workers", str(WORKERS),
               "--max-bytes", "64MiB", "--idle-timeout", "2", "--lease", "2", "--ttl", "5", "--trim-after", "1"]  # fmt: skip
    broker = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = broker.stdout.readline()
        address = re.match(r"handoff-broker listening on (\S+);", line).group(1)
        metrics_port = re.search(r"metrics on :(\d+)/metrics", line).group(1)
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        with HandoffClient(address) as client:
            contract = client.get_contract(MODEL)
        start = proc_status(broker.pid)
        soak = Soak(address, contract)
        threads = [threading.Thread(target=soak.prober, daemon=True), threading.Thread(target=soak.good_client)]
        threads += soak.loop(soak.waiting_pull, "waiting pulls", 24)
        threads += soak.loop(soak.silent_push, "silent pushes", 8)
        threads += soak.loop(soak.stalled_reader, "stalled readers", 4)
        threads += soak.loop(soak.tiny_chunks, "tiny chunks", 2)
        threads += soak.loop(soak.bad_numbers, "bad numbers", 1)
        for t in threads:
            t.start()
        peak = dict(start)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            now = proc_status(broker.pid)
            peak = {k: max(peak[k], now[k]) for k in peak}
            time.sleep(0.5)
        soak.stop.set()
        for t in threads:
            t.join(40)
        settled = time.monotonic() + 20  # waits time out, revoked hand-offs expire (ttl 5 s), memory is trimmed
        with HandoffClient(address, timeout=5) as client:
            while True:
                status = client.status()
                end = proc_status(broker.pid)
                held = status.receiving + status.ready + status.claimed
                streams = streams_in_flight(metrics)
                if (held, streams) == (0, 0) and end["rss"] <= start["rss"] + (16 << 20) or time.monotonic() > settled:
                    break
                time.sleep(0.5)
        return {
            "seconds": seconds,
            "outcomes": dict(sorted(soak.outcomes.items())),
            "good_hand_offs": soak.good,
            "good_failures": soak.good_failures[:5],
            "probe_worst_seconds": round(soak.probe_worst, 3),
            "probe_failures": soak.probe_failures[:5],
            "held_at_end": held,
            "streams_in_flight_at_end": streams,
            "resident_bytes_at_end": status.resident_bytes,
            "threads": {"start": start["threads"], "peak": peak["threads"], "end": end["threads"], "workers": WORKERS},
            "rss_mib": {k: round(v["rss"] / 2**20) for k, v in (("start", start), ("peak", peak), ("end", end))},
        }
    finally:
        broker.terminate()
        broker.wait(timeout=20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.seconds), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
