"""Health and reflection, open to callers without a token, cannot take the broker's threads (#37 item 1), measured on
real broker processes (tests/broker_process.py): on the main port such calls hold at most PROBE_CALLS_LIMIT worker
threads (server/probe_calls.py) and the rest are refused at once; the health port (server/health_port.py) answers
probes with no thread per call. grpcio parked a worker thread on every header-only unary call, and a Watch stream
holds one while open: 300 of either took every `--workers` thread, and GetStatus and health stopped answering."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from broker_process import BrokerProcess, admin_token_file
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.reflection_pb2 import ServerReflectionRequest, ServerReflectionResponse
from handoff_broker.app import BrokerConfig, build_server
from handoff_broker.auth import TokenTable
from handoff_broker.probe_calls import PROBE_CALLS_LIMIT, PROBE_FIRST_MESSAGE_SECONDS
from handoff_client import HandoffClient
from handoff_client.protocol.contract import Carried, Contract
from test_claims import wait_until

TINY = Contract("tiny", 64, 64, (Carried("k", 0, 64, 16, "float32"),))
CHECK = "/grpc.health.v1.Health/Check"
REFLECT = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
SERVING = health_pb2.HealthCheckResponse.SERVING
REFUSAL = (
    f"the broker already has {PROBE_CALLS_LIMIT} health Watch and reflection streams without a token open (probes: ask "
    "--health-port), its limit; retry shortly"
)


@pytest.fixture
def secured(tmp_path: Path):
    """A broker with tokens, its default 256 workers and a health port; the admin token is `admin`."""
    tokens = str(admin_token_file(tmp_path))
    with BrokerProcess(tmp_path, [TINY], "--tokens", tokens, "--health-port", "0", "--grace", "0") as broker:
        yield broker


def _check(address: str, metadata: tuple | None = None, timeout: float = 1) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout, metadata=metadata).status


def _answers_throughout(broker: BrokerProcess, seconds: float) -> None:
    """For `seconds`: GetStatus with a valid token, health with it on the main port, and health on the health port
    (no token) each answer within 1 s."""
    with HandoffClient(broker.address, token="admin", timeout=1) as admin:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for ask in (admin.status, lambda: _check(broker.address, (("authorization", "Bearer admin"),)),
                        lambda: _check(f"127.0.0.1:{broker.health_port}")):  # fmt: skip
                started = time.monotonic()
                ask()
                assert time.monotonic() - started < 1.0
            time.sleep(0.2)


def _codes(calls: list[grpc.Future], timeout: float) -> list[grpc.StatusCode | None]:
    return [None if (e := call.exception(timeout)) is None else e.code() for call in calls]


def _held_open(make: Callable[[grpc.Channel], grpc.Future], count: int, address: str) -> tuple[list, Callable]:
    """`count` calls made by `make` on 3 connections to `address`; and what closes the connections."""
    own = [("grpc.use_local_subchannel_pool", 1)]  # (3 connections: channels alike share one otherwise)
    channels = [grpc.insecure_channel(address, options=own) for _ in range(3)]
    calls = [make(channels[n % 3]) for n in range(count)]
    return calls, lambda: [channel.close() for channel in channels]


def test_header_only_health_checks_without_a_token_take_a_few_threads(secured):
    """300 health checks with no token whose request never comes, on 3 connections: PROBE_CALLS_LIMIT of them hold
    a thread, for at most PROBE_FIRST_MESSAGE_SECONDS, and the rest are refused at once (RESOURCE_EXHAUSTED); status
    with a token and health answer within 1 s throughout, the broker's threads stay bounded, and once the calls
    ended their slots are back. grpcio parked a worker thread on each: at --workers 256, status and health waited
    out their deadlines."""
    never = threading.Event()

    def silent():  # a request stream that sends its headers and never a message
        never.wait()
        yield b""

    before = secured.threads()
    raw = lambda channel: channel.stream_unary(CHECK, request_serializer=bytes, response_deserializer=bytes)
    calls, close = _held_open(lambda channel: raw(channel).future(silent(), timeout=30), 300, secured.address)
    started = time.monotonic()
    try:
        _answers_throughout(secured, 3)
        assert secured.threads() < 100, f"{before} -> {secured.threads()} threads"  # (idle pool threads included)
        codes = _codes(calls, PROBE_FIRST_MESSAGE_SECONDS + 5)  # (the held ones: cancelled by the broker)
        assert time.monotonic() - started < PROBE_FIRST_MESSAGE_SECONDS + 3
        # (a call that came after a held one was cancelled may take its slot: more than the limit may be held)
        assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 300 - 3 * PROBE_CALLS_LIMIT
        assert _check(secured.address) == SERVING  # (the slots are back)
    finally:
        never.set()
        close()


def test_open_watch_streams_without_a_token_take_a_few_threads(secured):
    """256 health Watch streams with no token held open: PROBE_CALLS_LIMIT are served, the rest refused at once;
    status with a token and health answer within 1 s throughout, a health check with no token too (the checks'
    slots are their own: it was refused, seen), and once the streams are cancelled (by their client) every slot is
    back: as many streams are served again. Each held a worker thread while open (101 threads, seen)."""
    request = health_pb2.HealthCheckRequest()
    watch = lambda channel: health_pb2_grpc.HealthStub(channel).Watch(request, timeout=30)
    before = secured.threads()
    streams, close = _held_open(watch, 256, secured.address)
    try:
        _answers_throughout(secured, 2)
        assert secured.threads() < 100, f"{before} -> {secured.threads()} threads"  # (idle pool threads included)
        served = [stream for stream in streams if not stream.done()]
        refused = [stream for stream in streams if stream.done()]
        assert len(served) == PROBE_CALLS_LIMIT
        assert {(s.code(), s.details()) for s in refused} == {(grpc.StatusCode.RESOURCE_EXHAUSTED, REFUSAL)}
        assert all(next(stream).status == SERVING for stream in served)
        assert _check(secured.address) == SERVING
        for stream in served:
            stream.cancel()
    finally:
        close()
    deadline = time.monotonic() + 10  # (the slots come back as the broker sees the cancels: polled, not slept on)
    while True:
        again, close = _held_open(watch, PROBE_CALLS_LIMIT, secured.address)
        try:
            if all(next(stream, None) is not None for stream in again):
                break
            assert time.monotonic() < deadline, [s.code() for s in again if s.done()]
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the slots did not come back in 10 s"
        finally:
            close()
        time.sleep(0.1)


def test_watch_streams_with_a_token_hold_no_thread(tmp_path):
    """Health Watch streams with a valid token (not counted) on a broker of 8 worker threads, more streams than
    threads: each is answered, and a health check with the token still answers within 3 s. Each Watch held a worker
    thread for its whole life (grpc_health's blocking iterator): the 9th stream waited out its deadline (seen)."""
    tokens = str(admin_token_file(tmp_path))
    token = (("authorization", "Bearer admin"),)
    with BrokerProcess(tmp_path, [TINY], "--tokens", tokens, "--workers", "8", "--grace", "0") as broker:
        request = health_pb2.HealthCheckRequest()
        watch = lambda channel: health_pb2_grpc.HealthStub(channel).Watch(request, timeout=30, metadata=token)
        streams, close = _held_open(watch, 24, broker.address)
        try:
            assert all(next(stream).status == SERVING for stream in streams)
            assert _check(broker.address, token, timeout=3) == SERVING  # (a loaded machine's margin)
        finally:
            close()


def test_streams_without_a_token_end_after_their_lifetime(tmp_path):
    """A Watch and a reflection stream with no token are cancelled by the broker once PROBE_STREAM_SECONDS (1 s here)
    has passed, and their slots are back; a Watch with a valid token is not limited."""
    tokens = TokenTable.load(admin_token_file(tmp_path))
    config = BrokerConfig(contracts={"tiny": TINY}, port=0, lanes=False, tokens=tokens)
    broker, port = build_server(config)
    broker.probe_calls.stream_seconds = 1.0
    with broker, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        trusted = stub.Watch(request, timeout=30, metadata=(("authorization", "Bearer admin"),))
        probe = stub.Watch(request, timeout=30)
        reflect = channel.stream_stream(REFLECT, request_serializer=ServerReflectionRequest.SerializeToString,
                                        response_deserializer=ServerReflectionResponse.FromString)  # fmt: skip
        asked = threading.Event()

        def asking():  # one question, then the stream kept open, asking nothing more
            yield ServerReflectionRequest(list_services="")
            asked.wait(30)

        listing = reflect(asking(), timeout=30)
        started = time.monotonic()
        assert (next(probe).status, next(trusted).status) == (SERVING, SERVING)
        assert next(listing).list_services_response.service
        for stream in (probe, listing):
            with pytest.raises(grpc.RpcError) as ended:
                next(stream)
            assert ended.value.code() == grpc.StatusCode.CANCELLED
        assert 0.8 < time.monotonic() - started < PROBE_FIRST_MESSAGE_SECONDS - 1  # (its lifetime, not its idle watch)
        asked.set()
        wait_until(lambda: broker.probe_calls.streams.taken == 0)  # (as the broker's handler threads see the cancels)
        assert not trusted.done()
        trusted.cancel()


def test_the_health_port_mirrors_the_main_ports_statuses_and_stops_whole(tmp_path):
    """The health port tells "", the service and the fleet's status as the main port does, turns NOT_SERVING with
    it when the broker drains, and after stop no port is left bound and no thread running; a health port (or a lane
    port) that cannot be bound stops the start, naming --health-port (--lane-port), and leaves nothing behind either."""
    before = {t.name for t in threading.enumerate()}
    broker, _ = build_server(BrokerConfig(contracts={"tiny": TINY}, port=0, health_port=0, lanes=False, etcd=None))
    broker.start()
    ports = (broker.port, broker.health_port)
    for service in ("", "handoff.v1.HandoffBroker", "handoff.v1.Fleet"):
        request = health_pb2.HealthCheckRequest(service=service)
        answers = []
        for port in ports:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                answers.append(health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status)
        assert answers == [SERVING, SERVING], service
    channel = grpc.insecure_channel(f"127.0.0.1:{broker.health_port}")
    watching = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
    assert next(watching).status == SERVING
    stopping = threading.Thread(target=broker.stop, args=(0.5,))
    stopping.start()
    assert next(watching).status == health_pb2.HealthCheckResponse.NOT_SERVING
    stopping.join()
    channel.close()
    with socket.socket() as free:
        free.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (past TIME_WAIT: only a listener refuses it)
        free.bind(("127.0.0.1", ports[1]))  # (let go of)
        free.listen()
        with pytest.raises(OSError, match="--health-port"):
            build_server(BrokerConfig(contracts={"tiny": TINY}, port=0, health_port=ports[1], lanes=False))
        with pytest.raises(OSError, match="--lane-port"):  # (the watchdog's thread was left running: seen)
            build_server(BrokerConfig(contracts={"tiny": TINY}, port=0, lane_port=ports[1], shared_memory_lane=False))
    time.sleep(0.2)
    left = {t.name for t in threading.enumerate()} - before
    assert not {name for name in left if name.startswith(("handoff-health", "handoff-watchdog"))}, left


def test_the_health_command_asks_the_health_port_in_plaintext_beside_a_tls_broker(tmp_path):
    """`handoff-broker health --health-port` asks the broker's health port on --target's host, in plaintext,
    whatever TLS the environment names for the main port (the image's HEALTHCHECK runs it so)."""
    with BrokerProcess(tmp_path, [TINY], "--health-port", "0", "--grace", "0", tls=True) as broker:
        (tmp_path / "ca.pem").write_bytes(broker.client_options["tls_root_certificates"])
        env = {**os.environ, "HANDOFF_TLS_CA": str(tmp_path / "ca.pem"), "HANDOFF_TLS_SERVER_NAME": "localhost"}
        command = [sys.executable, "-m", "handoff_broker", "health", "--target", broker.address]
        run = lambda *extra: subprocess.run([*command, *extra], env=env, capture_output=True, text=True, timeout=30,
                                            check=False)  # fmt: skip
        main, port = run(), run("--health-port", str(broker.health_port))
        assert (main.returncode, port.returncode) == (0, 0), (main.stderr, port.stderr)
        assert port.stdout.strip().endswith(f":{broker.health_port}: SERVING")
