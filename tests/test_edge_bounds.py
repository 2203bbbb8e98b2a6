"""What one unauthenticated peer can make a broker hold, measured on real broker processes (tests/broker_process.py),
as the broker's monitor and the OOM killer see it: a caller without a valid token is refused before any of its
request is read (server/auth.py), so neither a large unary request nor one whose message never comes costs the
broker more than its HTTP/2 window and a moment of a thread."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import pytest
from broker_process import BrokerProcess, admin_token_file
from handoff_broker.auth import hash_token
from handoff_client import HandoffClient
from handoff_client.protocol.contract import Carried, Contract
from handoff_client.protocol.wire import method_path

MiB = 1 << 20
TINY = Contract("tiny", 64, 64, (Carried("k", 0, 64, 16, "float32"),))


@pytest.fixture
def secured(tmp_path: Path):
    """A broker with tokens and a 64 MiB --max-bytes, and the admin token."""
    tokens = str(admin_token_file(tmp_path))
    with BrokerProcess(tmp_path, [TINY], "--tokens", tokens, "--max-bytes", "64MiB", "--grace", "0") as broker:
        yield broker


def _raw(channel: grpc.Channel, name: str, *, streaming: bool = False):
    """A call of `name` that sends what it is given, as it is (bytes in, bytes out)."""
    make = channel.stream_unary if streaming else channel.unary_unary
    return make(method_path(name), request_serializer=lambda b: b, response_deserializer=lambda b: b)


def test_unauthenticated_unary_calls_of_63_mib_are_not_read(secured):
    """8 GetStatus calls with no token, 63 MiB each, at once: refused UNAUTHENTICATED, and the broker grows less
    than 32 MiB. grpcio read each whole before the token was checked: 64 -> 453 MiB RSS."""
    options = [("grpc.max_send_message_length", 128 * MiB), ("grpc.max_receive_message_length", 128 * MiB)]
    body = b"\x7a" + b"\x80\x80\x80\x1f" + bytes(63 * MiB)  # (field 15, length-delimited, 63 MiB: parses, if read)
    time.sleep(0.5)
    before = secured.rss()
    codes: list[grpc.StatusCode] = []
    peak = [0]

    def call() -> None:
        with grpc.insecure_channel(secured.address, options=options) as channel:
            try:
                _raw(channel, "GetStatus")(body, timeout=20)
            except grpc.RpcError as e:
                codes.append(e.code())

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], secured.rss())
        time.sleep(0.02)
    grown = max(peak[0], secured.rss()) - before
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 8
    assert grown < 32 * MiB, f"8 unauthenticated 63 MiB calls grew the broker {grown / MiB:.0f} MiB"


def test_header_only_calls_without_a_token_hold_no_thread_and_status_answers(secured):
    """300 GetStatus calls with no token whose request message never comes, on 3 connections: each is refused at
    once, the broker's threads stay bounded, and GetStatus with a valid token answers within 1 s throughout. grpcio
    parked a worker thread on each, waiting for the message: at --workers 256, status waited out its deadline."""
    never = threading.Event()

    def silent():  # a request stream that sends its headers and never a message
        never.wait()
        yield b""

    channels = [grpc.insecure_channel(secured.address) for _ in range(3)]
    calls = [_raw(channels[n % 3], "GetStatus", streaming=True).future(silent(), timeout=30) for n in range(300)]
    try:
        with HandoffClient(secured.address, token="admin", timeout=1) as admin:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                started = time.monotonic()
                admin.status()
                assert time.monotonic() - started < 1.0
                time.sleep(0.2)
        assert secured.threads() < 100, f"{secured.threads()} threads in the broker"
        refused = [call.exception(5) for call in calls]
        assert all(e is not None and e.code() == grpc.StatusCode.UNAUTHENTICATED for e in refused)
    finally:
        never.set()
        for channel in channels:
            channel.close()


def test_get_lanes_respects_a_token_scoped_to_models(start_broker, tmp_path):
    """GetLanes (the shared-memory lane's socket path, the host's boot id) answered a token scoped to one model
    whatever it asked about; now a scoped token names one of its models, as every call on one model does."""
    from handoff_broker.auth import TokenTable
    from handoff_client.protocol.messages import handoff_pb2 as pb

    path = tmp_path / "scoped.json"
    entry = {"name": "demo-only", "sha256": hash_token("scoped"), "roles": ["prefill"], "models": ["demo-hybrid"]}
    path.write_text(json.dumps({"tokens": [entry]}))
    broker = start_broker(tokens=TokenTable.load(path))
    metadata = (("authorization", "Bearer scoped"),)
    with grpc.insecure_channel(broker.address) as channel:
        lanes = channel.unary_unary(
            method_path("GetLanes"),
            request_serializer=pb.LanesRequest.SerializeToString,
            response_deserializer=pb.LanesResponse.FromString,
        )
        for model in ("", "every-dtype"):
            with pytest.raises(grpc.RpcError) as refused:
                lanes(pb.LanesRequest(model=model), timeout=5, metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, model
        assert lanes(pb.LanesRequest(model="demo-hybrid"), timeout=5, metadata=metadata).lanes
    with HandoffClient(broker.address, token="scoped") as client:  # (the client names the model it moves)
        assert client.lane(model="demo-hybrid") is not None
