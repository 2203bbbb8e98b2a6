"""No one gets in where they do not belong: TLS and mutual TLS with certificates made at test time, and bearer
tokens whose roles and models decide which calls go through. Health stays open for probes; tokens never reach
the logs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from certs import Authority
from conftest import assert_same_bits, seeded_tensors
from grpc_health.v1 import health_pb2, health_pb2_grpc
from handoff_broker.auth import TokenTable, hash_token
from handoff_client import (
    NO_RETRY,
    BrokerUnavailable,
    HandoffClient,
    MessageTooLarge,
    PermissionDenied,
    Unauthenticated,
)
from support import raises_handoff_error

MODEL = "every-dtype"


@pytest.fixture(scope="module")
def pki():
    ca, rogue = Authority("handoff test CA"), Authority("someone else's CA")
    return {
        "ca": ca,
        "server": ca.issue("localhost", server=True),
        "client": ca.issue("decode-worker", server=False),
        "rogue_client": rogue.issue("decode-worker", server=False),
    }


def round_trip(client: HandoffClient, contracts, handoff_id: str = "r") -> None:
    tensors = seeded_tensors(contracts[MODEL])
    client.push(MODEL, handoff_id, 1, tensors)
    assert_same_bits(client.pull(MODEL, handoff_id).state, tensors)


def test_tls_serves_who_trusts_its_ca_and_refuses_plaintext(start_broker, pki, contracts):
    broker = start_broker(tls_cert=pki["server"].cert, tls_key=pki["server"].key)
    with HandoffClient(broker.address, tls_root_certificates=pki["ca"].pem, tls_server_name="localhost") as client:
        round_trip(client, contracts)
    with HandoffClient(broker.address, timeout=2, retry=NO_RETRY) as plaintext:
        assert isinstance(raises_handoff_error(plaintext.get_contract, MODEL), BrokerUnavailable)
    other = Authority("not the broker's CA")
    with HandoffClient(broker.address, timeout=2, tls_root_certificates=other.pem, retry=NO_RETRY) as doubting:
        assert isinstance(raises_handoff_error(doubting.get_contract, MODEL), BrokerUnavailable)


def test_mutual_tls_admits_only_clients_with_a_certificate_from_its_ca(start_broker, pki, contracts):
    broker = start_broker(tls_cert=pki["server"].cert, tls_key=pki["server"].key, tls_client_ca=pki["ca"].pem)
    trusted = {"tls_root_certificates": pki["ca"].pem, "tls_server_name": "localhost"}
    with HandoffClient(broker.address, tls_certificate_chain=pki["client"].cert, tls_private_key=pki["client"].key,
                       **trusted) as client:  # fmt: skip
        round_trip(client, contracts)
    rogue = pki["rogue_client"]
    with HandoffClient(broker.address, timeout=2, retry=NO_RETRY, tls_certificate_chain=rogue.cert,
                       tls_private_key=rogue.key, **trusted) as impostor:  # fmt: skip
        assert isinstance(raises_handoff_error(impostor.get_contract, MODEL), BrokerUnavailable)
    with HandoffClient(broker.address, timeout=2, retry=NO_RETRY, **trusted) as anonymous:
        assert isinstance(raises_handoff_error(anonymous.get_contract, MODEL), BrokerUnavailable)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    entries = [
        {"name": "prefill-pool", "sha256": hash_token("prefill-secret"), "roles": ["prefill"]},
        {"name": "decode-pool", "sha256": hash_token("decode-secret"), "roles": ["decode"]},
        {"name": "ops", "sha256": hash_token("admin-secret"), "roles": ["admin"]},
        {"name": "demo-only", "sha256": hash_token("scoped-secret"), "roles": ["prefill", "decode"],
         "models": ["demo-hybrid"]},
    ]  # fmt: skip
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": entries}))
    return path


def test_tokens_decide_who_may_push_pull_and_read_status(start_broker, token_file, contracts, caplog):
    caplog.set_level(logging.DEBUG)
    broker = start_broker(tokens=TokenTable.load(token_file))
    address = broker.address
    with HandoffClient(address, retry=NO_RETRY) as nobody:
        error = raises_handoff_error(nobody.get_contract, MODEL)
        assert isinstance(error, Unauthenticated) and error.code is grpc.StatusCode.UNAUTHENTICATED
        assert "no bearer token" in error.message
    with HandoffClient(address, token="guessed", retry=NO_RETRY) as guesser:
        assert "an unknown bearer token" in raises_handoff_error(guesser.get_contract, MODEL).message
    tensors = seeded_tensors(contracts[MODEL])
    with (
        HandoffClient(address, token="prefill-secret") as prefill,
        HandoffClient(address, token="decode-secret") as decode,
    ):
        prefill.push(MODEL, "r", 1, tensors)
        error = raises_handoff_error(prefill.pull, MODEL, "r", timeout=2)
        assert isinstance(error, PermissionDenied) and error.code is grpc.StatusCode.PERMISSION_DENIED
        assert error.message == "token `prefill-pool` has roles prefill; PullHandoff needs decode"
        assert isinstance(raises_handoff_error(decode.push, MODEL, "x", 1, tensors), PermissionDenied)
        assert isinstance(raises_handoff_error(decode.status), PermissionDenied)
        assert_same_bits(decode.pull(MODEL, "r").state, tensors)
    with HandoffClient(address, token="admin-secret") as ops:
        assert ops.status().resident_bytes == 0
    with HandoffClient(address, token="scoped-secret") as scoped:
        assert [c.model for c in scoped.list_contracts()] == ["demo-hybrid"]
        error = raises_handoff_error(scoped.get_contract, MODEL)
        assert isinstance(error, PermissionDenied) and "is not scoped to model `every-dtype`" in error.message
        demo = seeded_tensors(contracts["demo-hybrid"])
        scoped.push("demo-hybrid", "mine", 1, demo)
        assert_same_bits(scoped.pull("demo-hybrid", "mine").state, demo)
    with grpc.insecure_channel(address) as channel:  # probes need no token
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    logged = caplog.text
    for secret in ("prefill-secret", "decode-secret", "admin-secret", "scoped-secret", "guessed"):
        assert secret not in logged


def test_a_bad_token_file_stops_the_start_naming_the_entry(tmp_path: Path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": [{"name": "x", "sha256": hash_token("t"), "roles": ["root"]}]}))
    result = subprocess.run(
        [sys.executable, "-m", "handoff_broker.cli", "serve", "--port", "0", "--metrics-port", "-1", "--tokens",
         str(path)], capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"{path}: tokens[0].roles: must be a non-empty list of admin, decode, prefill" in result.stderr


def test_hash_token_reads_the_token_from_stdin():
    result = subprocess.run([sys.executable, "-m", "handoff_broker.cli", "hash-token"], input="s3cret\n",
                            capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert result.stdout.strip() == hash_token("s3cret") and "s3cret" not in result.stdout


def test_an_open_broker_says_so_at_start(start_broker, caplog):
    caplog.set_level(logging.INFO)
    broker = start_broker()
    assert f"open: no TLS and no tokens; anyone who can reach {broker.address} may push" in caplog.text


def test_a_message_over_the_limit_is_refused_counted_and_the_broker_serves_on(start_broker, contracts):
    broker = start_broker(max_message_bytes=64 << 10)
    with HandoffClient(broker.address, chunk_bytes=1 << 20, retry=NO_RETRY) as big:
        contract = big.get_contract("demo-hybrid")
        error = raises_handoff_error(big.push, "demo-hybrid", "r", 1, seeded_tensors(contract))
        assert isinstance(error, MessageTooLarge) and error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "is over the broker's limit of 65536; send smaller chunks" in error.message
    with HandoffClient(broker.address, chunk_bytes=32 << 10) as small:
        round_trip(small, contracts)
    assert broker.store.stats().resident_bytes == 0
    rejected = broker.registry.get_sample_value(
        "handoff_rejections_total", {"model": "demo-hybrid", "reason": "MESSAGE_TOO_LARGE"}
    )
    assert rejected == 1


def test_a_push_that_never_finishes_is_aborted_at_its_deadline(start_broker, contracts):
    import threading

    from support import chunk_frames, header_frame
    from test_claims import wait_until
    from test_lifecycle import push_in_thread

    broker = start_broker(push_deadline=0.6)  # a slow drip of chunks keeps it from ever being idle
    contract = contracts["demo-hybrid"]
    frames = [header_frame(contract, "slow"), *chunk_frames(contract, seeded_tensors(contract), 4096)]

    def drip():
        for frame in frames:
            yield frame
            threading.Event().wait(0.05)

    thread, outcome = push_in_thread(broker.address, drip())
    wait_until(lambda: broker.store.stats().receiving == 1)
    wait_until(lambda: broker.store.stats().receiving == 0, timeout=5)
    thread.join(10)
    assert outcome["error"].code is grpc.StatusCode.CANCELLED
    assert broker.store.stats().resident_bytes == 0


def test_streams_past_a_connections_limit_wait_and_other_clients_are_untouched(start_broker, contracts):
    from support import open_channel, raw_pull

    broker = start_broker(max_streams_per_connection=1)
    with HandoffClient(broker.address) as prefill:
        prefill.push("wide-attention", "big", 1, seeded_tensors(contracts["wide-attention"]))
    with open_channel(broker.address) as channel:
        waiting = raw_pull(channel, "wide-attention", "big", timeout=10)
        next(waiting)  # this stream is open (flow control holds the rest): the connection's one stream
        status = channel.unary_unary("/handoff.v1.HandoffBroker/GetStatus")
        with pytest.raises(grpc.RpcError) as e:
            status(b"", timeout=0.5)
        assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        with HandoffClient(broker.address) as other:  # another connection is served as ever
            round_trip(other, contracts)
        waiting.cancel()


def test_the_status_and_health_commands_reach_a_broker_behind_mutual_tls_and_tokens(
    start_broker, pki, token_file, tmp_path: Path
):
    broker = start_broker(tls_cert=pki["server"].cert, tls_key=pki["server"].key, tls_client_ca=pki["ca"].pem,
                          tokens=TokenTable.load(token_file))  # fmt: skip
    files = {"ca.pem": pki["ca"].pem, "client.pem": pki["client"].cert, "client.key": pki["client"].key,
             "ops.token": b"admin-secret\n", "decode.token": b"decode-secret\n"}  # fmt: skip
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    tls = ["--target", broker.address, "--tls-ca", str(tmp_path / "ca.pem"), "--tls-server-name", "localhost",
           "--tls-client-cert", str(tmp_path / "client.pem"), "--tls-client-key", str(tmp_path / "client.key")]  # fmt: skip

    def cli(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "handoff_broker.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    status = cli("status", *tls, "--token-file", str(tmp_path / "ops.token"))
    assert status.returncode == 0, status.stderr
    assert f"{broker.address}: serving" in status.stdout and "contract every-dtype" in status.stdout
    healthy = cli("health", *tls)  # probes need no token
    assert (healthy.returncode, healthy.stdout.strip()) == (0, f"{broker.address}: SERVING")

    anonymous = cli("status", *tls)
    assert anonymous.returncode == 1 and "no bearer token" in anonymous.stderr
    decode_role = cli("status", *tls, "--token-file", str(tmp_path / "decode.token"))
    assert decode_role.returncode == 1 and "GetStatus needs admin" in decode_role.stderr
    plaintext = cli("health", "--target", broker.address, "--timeout", "1")
    assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr
    missing = cli("status", *tls, "--token-file", str(tmp_path / "nowhere.token"))
    assert missing.returncode == 2 and "nowhere.token" in missing.stderr
    half = cli("health", "--target", broker.address, "--tls-client-cert", str(tmp_path / "client.pem"))
    assert half.returncode == 2 and "--tls-client-cert and --tls-client-key go together" in half.stderr
