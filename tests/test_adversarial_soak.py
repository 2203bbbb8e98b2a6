"""The lanes under attack and under load at once (issue 27), against a TLS broker in its own process: idle lane
connections, lane pulls cancelled after their header, sealed frame headers that lie about their length, pushes
waiting for room, and descriptor pressure (1,100 idle connections to the gRPC port, so the broker's sockets are
numbered past 1,024). Throughout, health answers within a second and a good client's striped lane hand-offs
complete; the broker's RSS stays within --max-bytes x 1.25 plus BASE, and at the end it holds only what was left
held on purpose."""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections import Counter

import grpc
import numpy as np
from broker_process import BrokerProcess
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from grpc_health.v1 import health_pb2, health_pb2_grpc
from handoff_client import HandoffClient, HandoffError, RetryPolicy
from handoff_client.protocol.contract import Carried, Contract
from handoff_client.protocol.errors import from_rpc_error
from handoff_client.protocol.lane import FRAME, new_capability, open_lane
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.seal import lane_key, receive_salt, sealed_opening
from handoff_client.protocol.wire import decode_pull_response, identity, method_path

MiB = 1 << 20
SECONDS = 20.0
MAX_BYTES = 128 * MiB
BASE = 192 * MiB  # the broker idle (~70 MiB) plus gRPC's and TLS's buffers for ~1,200 connections and 64 threads
GOOD = Contract("good", 2, 64, (Carried("g", 0, 1024, 1024, "float32"),))  # 4 MiB
FILLER = Contract("filler", 2, 64, (Carried("f", 0, 4096, 4096, "float32"),))  # 64 MiB, held all along
WAITER = Contract("waiter", 2, 64, (Carried("w", 0, 5120, 4096, "float32"),))  # 80 MiB: never fits beside FILLER
LIAR = Contract("liar", 2, 64, (Carried("l", 0, 2048, 1024, "float32"),))  # 8 MiB, announced and never sent
PATIENT = RetryPolicy(attempts=20, initial_backoff=0.05, max_backoff=0.5)


class Soak:
    def __init__(self, broker: BrokerProcess) -> None:
        self.broker = broker
        self.options = broker.client_options
        self.stop = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.probe_worst = 0.0
        self.probe_failures: list[str] = []
        self.good = 0
        self.good_failures: list[str] = []
        self.rss_peak = 0
        self.waiter = np.ones((5120, 4096), np.float32)  # (one array for every waiting push)

    def note(self, what: str) -> None:
        with self.lock:
            self.outcomes[what] += 1

    def channel(self) -> grpc.Channel:
        credentials = grpc.ssl_channel_credentials(self.options["tls_root_certificates"])
        return grpc.secure_channel(self.broker.address, credentials,
                                   options=[("grpc.ssl_target_name_override", "localhost")])  # fmt: skip

    def client(self, **options: object) -> HandoffClient:
        return HandoffClient(self.broker.address, **self.options, **options)

    # -- the attacks --------------------------------------------------------------------------------------------------

    def idle_lane_connections(self, port: int) -> None:
        """64 connections to the lane port that never send a byte, each opened again once the broker closes it."""
        held: list[socket.socket] = []
        while not self.stop.is_set():
            held = [s for s in held if _open(s)]
            while len(held) < 64:
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:
                    break
            self.stop.wait(0.2)
        for s in held:
            s.close()

    def cancelled_lane_pulls(self, n: int) -> None:
        """Pull a hand-off offering a lane, read the header, cancel; the claim goes back for the next."""
        with self.channel() as channel:
            pull = channel.unary_stream(method_path("PullHandoff"), request_serializer=identity,
                                        response_deserializer=decode_pull_response)  # fmt: skip
            while not self.stop.is_set():
                request = pb.PullRequest(model=GOOD.model, handoff_id=f"bait-{n}", lane_capability=new_capability())
                stream = pull(request.SerializeToString(), timeout=10)
                try:
                    next(stream)
                    self.note("cancelled lane pulls: header read")
                except grpc.RpcError as e:
                    self.note(f"cancelled lane pulls: {from_rpc_error(e).reason}")
                stream.cancel()

    def lying_headers(self, port: int, n: int) -> None:
        """A push whose sealed lane announces the whole tensor in one frame, sends 100 bytes, and goes silent."""
        with self.client(timeout=10) as client:
            push = client._channel.stream_unary(method_path("PushHandoff"), request_serializer=identity,
                                                response_deserializer=pb.PushResponse.FromString)  # fmt: skip
            k = 0
            while not self.stop.is_set():
                k += 1
                capability = new_capability()
                header = pb.PushHeader(model=LIAR.model, handoff_id=f"lie-{n}-{k}", position=1,
                                       fingerprint=LIAR.fingerprint, lane_capability=capability)  # fmt: skip
                call = push.future(iter([pb.PushRequest(header=header).SerializeToString()]), timeout=10)
                try:
                    with open_lane("127.0.0.1", port, sealed_opening(capability), timeout=5) as lane:
                        key = lane_key(capability, "push", receive_salt(lane))  # (the broker's salt follows READY)
                        sealed = AESGCM(key).encrypt(bytes(12), FRAME.pack(0, 0, 8 * MiB, 0), None)
                        lane.sendall(sealed + b"x" * 100)
                        self.stop.wait(1.0)
                except OSError as e:
                    self.note(f"lying headers: lane {type(e).__name__}")
                try:
                    call.result()
                except grpc.RpcError as e:
                    self.note(f"lying headers: {from_rpc_error(e).reason}")

    def waiting_push(self, n: int) -> None:
        """A stream push of 80 MiB that cannot fit beside the filler: it waits for room, sending what it may."""
        tensors = {"w": self.waiter}
        while not self.stop.is_set():
            try:
                with self.client(timeout=8, lanes=False, retry=RetryPolicy(attempts=1)) as client:
                    client.push(WAITER.model, f"wait-{n}", 1, tensors)
                self.note("waiting pushes: taken")
            except HandoffError as e:
                self.note(f"waiting pushes: {e.reason}")

    # -- the good client and the prober -------------------------------------------------------------------------------

    def good_client(self) -> None:
        rng = np.random.default_rng(0)
        with self.client(timeout=20, retry=PATIENT, lane_connections=2) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                tensors = {"g": rng.standard_normal((1024, 1024), np.float32)}
                try:
                    client.push(GOOD.model, f"good-{n}", 1, tensors)
                    got = client.pull(GOOD.model, f"good-{n}").state
                    assert got["g"].tobytes() == tensors["g"].tobytes()
                    self.good += 1
                except HandoffError as e:
                    self.good_failures.append(f"{e.reason}: {e.message}")

    def prober(self) -> None:
        with self.channel() as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.RpcError as e:
                    self.probe_failures.append(f"{e.code().name}: {e.details()}")
                self.probe_worst = max(self.probe_worst, time.monotonic() - started)
                self.rss_peak = max(self.rss_peak, self.broker.rss())
                self.stop.wait(0.2)


def _open(sock: socket.socket) -> bool:
    """Whether the broker still holds the connection open (nothing to read, not closed)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def test_the_lanes_under_attack_and_load_at_once_keep_the_broker_answering_serving_and_bounded(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(4096, hard) if hard != resource.RLIM_INFINITY else 4096
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))  # (the broker inherits it)
    args = ("--max-bytes", str(MAX_BYTES), "--workers", "64", "--idle-timeout", "3", "--lease", "2",
            "--no-shared-memory-lane", "--lane-min-bytes", "1", "--trim-after", "1")  # fmt: skip
    pressure: list[socket.socket] = []
    try:
        with BrokerProcess(tmp_path, [GOOD, FILLER, WAITER, LIAR], *args, tls=True) as broker:
            soak = Soak(broker)
            host, grpc_port = broker.address.rsplit(":", 1)
            for _ in range(min(1100, wanted - 300)):  # descriptor pressure: the broker's lane sockets come after these
                pressure.append(socket.create_connection((host, int(grpc_port)), timeout=5))
            with soak.client(timeout=30) as client:
                port = client.lane().port
                client.push(FILLER.model, "filler", 1, {"f": np.zeros((4096, 4096), np.float32)})
                for n in range(4):
                    client.push(GOOD.model, f"bait-{n}", 1, {"g": np.zeros((1024, 1024), np.float32)})
            threads = [threading.Thread(target=soak.prober), threading.Thread(target=soak.good_client),
                       threading.Thread(target=soak.idle_lane_connections, args=(port,))]  # fmt: skip
            threads += [threading.Thread(target=soak.cancelled_lane_pulls, args=(n,)) for n in range(4)]
            threads += [threading.Thread(target=soak.lying_headers, args=(port, n)) for n in range(2)]
            threads += [threading.Thread(target=soak.waiting_push, args=(n,)) for n in range(8)]
            for t in threads:
                t.start()
            soak.stop.wait(SECONDS)
            soak.stop.set()
            for t in threads:
                t.join(30)
            with soak.client(timeout=10) as client:
                status = client.status()
            report = {"outcomes": dict(soak.outcomes), "good": soak.good, "good_failures": soak.good_failures[:3],
                      "probe_worst_s": round(soak.probe_worst, 3), "probe_failures": soak.probe_failures[:3],
                      "rss_peak_mib": soak.rss_peak // MiB, "bound_mib": (MAX_BYTES * 5 // 4 + BASE) // MiB,
                      "held_at_end": (status.receiving, status.ready, status.claimed)}  # fmt: skip
            print(report)
    finally:
        for s in pressure:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert soak.probe_failures == [] and soak.probe_worst < 1.0, report
    assert soak.good_failures == [] and soak.good >= 5, report
    assert soak.rss_peak <= MAX_BYTES * 5 // 4 + BASE, report
    assert {"cancelled lane pulls: header read", "lying headers: LANE_BROKEN"} <= set(soak.outcomes), report
    assert status.receiving == 0 and status.claimed == 0, report  # the filler and the baits are all that is left
