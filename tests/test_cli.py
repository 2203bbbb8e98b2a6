"""The `handoff-broker` command, run as a user runs it: as a separate process."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MANIFESTS, assert_same_bits, seeded_tensors
from handoff_broker.commands import human_size
from handoff_client import HandoffClient

CONFIGS = Path(__file__).parent / "configs"

COMMAND = [sys.executable, "-m", "handoff_broker.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout, check=False)


def test_demo_moves_a_hand_off_between_two_processes_bit_for_bit():
    result = run("demo")
    assert result.returncode == 0, result.stderr
    assert "12 tensors, 242688 bytes, all bit-identical" in result.stdout  # a 100-token prompt's rows, state whole
    assert "242688 of the 4334592 bytes the whole context would hold" in result.stdout
    assert "broker holds 0 bytes after the confirm" in result.stdout
    assert result.stdout.count(" yes\n") == 12


def start_serving(*args: str) -> tuple[subprocess.Popen, str]:
    broker = subprocess.Popen(
        [*COMMAND, "serve", "--port", "0", "--metrics-port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = broker.stdout.readline()
    match = re.match(r"handoff-broker listening on (\S+);", line)
    assert match, f"no listening line: {line!r} {broker.stderr.read() if broker.poll() is not None else ''}"
    return broker, match.group(1)


def test_serve_serves_and_stops_cleanly_on_sigterm():
    broker, address = start_serving("--contracts", str(MANIFESTS), "--grace", "1")
    try:
        with HandoffClient(address) as client:
            assert [c.model for c in client.list_contracts()] == ["demo-hybrid", "every-dtype", "wide-attention"]
            contract = client.get_contract("every-dtype")
            tensors = seeded_tensors(contract)
            client.push("every-dtype", "r", 1, tensors)
            client.push("every-dtype", "left-behind", 1, tensors)
            assert_same_bits(client.pull("every-dtype", "r").state, tensors)
        healthy = run("health", "--target", address, timeout=30)
        assert (healthy.returncode, healthy.stdout.strip()) == (0, f"{address}: SERVING")
        started = time.monotonic()
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(timeout=15) == 0
        assert time.monotonic() - started < 10
        assert f"1 hand-off(s) ({contract.nbytes} bytes) were still held" in broker.stderr.read()
        gone = run("health", "--target", address, "--timeout", "1", timeout=30)
        assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr
    finally:
        broker.kill()
        broker.wait()


def test_every_serve_flag_may_come_from_the_environment_and_logs_may_be_json(tmp_path: Path):
    env = {**os.environ, "HANDOFF_CONTRACTS": str(MANIFESTS), "HANDOFF_MAX_BYTES": "1GiB", "HANDOFF_LOG_FORMAT": "json",
           "HANDOFF_NO_LANES": "1"}  # fmt: skip
    broker = subprocess.Popen([*COMMAND, "serve", "--port", "0", "--metrics-port", "-1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        line = broker.stdout.readline()
        assert "max 1073741824 bytes (1.0 GiB) of hand-offs" in line
        address = re.match(r"handoff-broker listening on (\S+);", line).group(1)
        with HandoffClient(address) as client:
            assert client.lane() is None  # a switch from the environment: --no-lanes
            contract = client.get_contract("every-dtype")
            client.push("every-dtype", "held", 1, seeded_tensors(contract))
        status = run("status", "--target", address, timeout=30)
        assert status.returncode == 0, status.stderr
        assert "hand-offs held: 1 (0 receiving, 1 ready, 0 claimed)" in status.stdout
        assert (
            f"bytes: {contract.nbytes} of 1073741824 ({human_size(contract.nbytes)} of 1.0 GiB, 0.0%)" in status.stdout
        )
        assert f"contract every-dtype: ctx 64, 9 tensors, {contract.nbytes} bytes a hand-off" in status.stdout
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(timeout=15)
    records = [json.loads(line) for line in broker.stderr.read().splitlines()]
    assert {"time", "level", "logger", "message"} <= set(records[0])
    assert any("push every-dtype/held committed" in r["message"] for r in records)


def test_a_port_already_taken_stops_the_start_naming_that_port_and_leaving_none_open():
    """Fails before the fix: a taken metrics port was a traceback after gRPC had begun serving; a taken lane port
    was reported as the gRPC port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag, what in (
            ("--metrics-port", "/metrics (--metrics-port)"),
            ("--lane-port", "the TCP lane (--lane-port)"),
        ):
            result = run("serve", "--port", "0", "--metrics-port", "0", flag, str(port), timeout=60)
            assert result.returncode == 2, result.stderr
            assert f"cannot start: cannot listen for {what} on 127.0.0.1:{port}" in result.stderr
            assert "Traceback" not in result.stderr


def test_a_cache_longer_than_the_model_was_trained_for_is_derived_with_a_warning(tmp_path: Path):
    result = run(
        "contract-from-config", str(CONFIGS / "llama-3-8b.json"), "--ctx", "32768", "-o", str(tmp_path / "m.json")
    )
    assert result.returncode == 0, result.stderr
    assert "a cache of 32768 positions, beyond the model's max_position_embeddings 8192" in result.stderr
    quiet = run(
        "contract-from-config", str(CONFIGS / "llama-3-8b.json"), "--ctx", "8192", "-o", str(tmp_path / "m.json")
    )
    assert "max_position_embeddings" not in quiet.stderr


def test_the_health_check_imports_only_what_it_needs():
    """A container's HEALTHCHECK runs this every 10 s: before the fix it imported numpy and ml_dtypes (1.4 s of CPU
    each time here); now only grpc (0.2 s)."""
    probe = subprocess.run([sys.executable, "-X", "importtime", "-m", "handoff_broker", "health", "--target",
                            "127.0.0.1:1", "--timeout", "0.5"], capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    imported = {line.rsplit("|", 1)[-1].strip() for line in probe.stderr.splitlines() if line.startswith("import time")}
    assert "grpc" in imported and probe.returncode == 1  # (nothing listens there)
    assert not {"numpy", "ml_dtypes", "prometheus_client"} & imported


def test_serve_takes_a_hugging_face_config_json():
    config = Path(__file__).parent / "configs" / "qwen3-8b.json"
    broker, address = start_serving(
        "--model-config", str(config), "--model-config", f"my/qwen={config}", "--config-ctx", "2048"
    )
    try:
        with HandoffClient(address) as client:
            contract, named = sorted(client.list_contracts(), key=lambda c: c.model)
            assert (contract.model, contract.ctx, len(contract.carried)) == ("Qwen/Qwen3-8B", 2048, 72)
            assert named.model == "my/qwen" and named.carried == contract.carried  # NAME=CONFIG.json names it
    finally:
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(timeout=15) == 0


def test_serve_without_contracts_serves_the_embedded_demo_model():
    broker, address = start_serving()
    try:
        with HandoffClient(address) as client:
            assert [c.model for c in client.list_contracts()] == ["demo-hybrid"]
    finally:
        broker.send_signal(signal.SIGINT)
        assert broker.wait(timeout=15) == 0


def test_a_bad_manifest_stops_the_start_naming_the_file_and_field(tmp_path: Path):
    manifest = json.loads((MANIFESTS / "every-dtype.json").read_text())
    manifest["carried"][2]["rows"] = 0
    (tmp_path / "broken.json").write_text(json.dumps(manifest))
    result = run("serve", "--port", "0", "--metrics-port", "0", "--contracts", str(tmp_path), timeout=30)
    assert result.returncode == 2
    assert f"{tmp_path / 'broken.json'}: carried[2].rows: must be an integer >= 1, got 0" in result.stderr


def test_check_contracts_prints_each_contract_with_its_bytes_and_fingerprint(contracts):
    result = run("check-contracts", str(MANIFESTS))
    assert result.returncode == 0, result.stderr
    demo = contracts["demo-hybrid"]
    assert (
        f"demo-hybrid: ctx 4096, hidden 256, 8 carried tensors, 4334592 bytes per hand-off at the full ctx, 4334592 "
        f"after 1000 tokens, fingerprint {demo.fingerprint}" in result.stdout
    )
    assert "layers.1.self_attn.k_cache" in result.stdout


def test_check_contracts_shows_how_a_tensor_splits_by_head(tmp_path):
    manifest = tmp_path / "m.json"
    made = run("contract-from-config", str(CONFIGS / "qwen2-7b.json"), "--ctx", "16", "-o", str(manifest))
    assert made.returncode == 0, made.stderr
    result = run("check-contracts", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "layers.0.self_attn.k_cache" in result.stdout and "bytes  4 heads x 128" in result.stdout
    assert "not rewindable" not in result.stdout  # every tensor's rows are positions, over the whole cache


def test_check_contracts_says_which_contracts_are_produced_one_token_short(tmp_path):
    made = run("contract-from-config", str(CONFIGS / "qwen3-next-80b-a3b.json"), "--ctx", "16", "-o",
               str(tmp_path / "next.json"))  # fmt: skip
    assert made.returncode == 0, made.stderr
    result = run("check-contracts", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "not rewindable: its producer pushes the state after N - 1 of a prompt's N tokens" in result.stdout
    assert "layers.0.linear_attn.memory" in result.stdout and "bytes  32 heads x 128" in result.stdout


def test_the_client_needs_none_of_the_brokers_own_dependencies(broker):
    """A decode worker installs grpcio, protobuf, numpy, ml_dtypes, crc32c and grpcio-status; nothing else."""
    script = f"""
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {{"grpc_health", "grpc_reflection", "prometheus_client", "handoff_broker", "grpc_tools"}}:
            raise ImportError(f"{{name}} is not installed on a decode worker")
sys.meta_path.insert(0, Refuse())
import numpy as np
from handoff_client import HandoffClient
with HandoffClient({broker.address!r}) as c:
    contract = c.get_contract("every-dtype")
    tensors = {{t.name: np.ones(t.shape, t.numpy_dtype) for t in contract.carried}}
    c.push("every-dtype", "isolated", 1, tensors)
    h = c.pull("every-dtype", "isolated")
    assert all((h.state[k].tobytes() == v.tobytes()) for k, v in tensors.items())
print("ok", sorted(m for m in sys.modules if m.split(".")[0] in {{"handoff_broker", "prometheus_client", "grpc_health"}}))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok []"


CLIENT_ONLY = """
import runpy, sys
class Refuse:  # the client-only install: none of the server extra
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"grpc_health", "grpc_reflection", "prometheus_client"}:
            raise ImportError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Refuse())
sys.argv = ["handoff-broker", *sys.argv[1:]]
runpy.run_module("handoff_broker", run_name="__main__")
"""


def test_the_client_only_install_runs_every_command_that_needs_only_the_client(broker, tmp_path):
    """Fails before the fix: every command, even --help, died importing grpc_health without the server extra."""

    def client_only(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", CLIENT_ONLY, *args], input=stdin, capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip

    assert client_only("--help").returncode == 0
    health = client_only("health", "--target", broker.address)
    assert (health.returncode, health.stdout.strip()) == (0, f"{broker.address}: SERVING"), health.stderr
    status = client_only("status", "--target", broker.address)
    assert status.returncode == 0 and "serving" in status.stdout, status.stderr
    manifest = tmp_path / "llama.json"
    derived = client_only("contract-from-config", str(CONFIGS / "llama-3-8b.json"), "-o", str(manifest))
    assert derived.returncode == 0, derived.stderr
    assert client_only("check-contracts", str(tmp_path)).returncode == 0
    assert len(client_only("hash-token", stdin="secret\n").stdout.strip()) == 64
    serve = client_only("serve", "--port", "0")
    assert serve.returncode == 2
    assert "needs the server extra (missing grpc_health): pip install '.[server]' from a clone" in serve.stderr


@pytest.mark.parametrize(
    ("text", "value"),
    [("1073741824", 1 << 30), ("16GiB", 16 << 30), ("16gib", 16 << 30), ("16G", 16 << 30), ("16g", 16 << 30),
     ("16GB", 16 * 10**9), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("64 KiB", 64 << 10)],
)  # fmt: skip
def test_sizes_take_the_common_spellings_binary_and_decimal(text, value):
    from handoff_broker.cli import _parse_bytes

    assert _parse_bytes(text) == value


def test_a_size_that_is_not_one_says_which_units_exist():
    done = subprocess.run([sys.executable, "-m", "handoff_broker", "serve", "--max-bytes", "16 gigs"],
                          check=False, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "KiB, MiB, GiB, TiB" in done.stderr and "KB, MB, GB, TB (decimal)" in done.stderr
    done = subprocess.run([sys.executable, "-m", "handoff_broker", "serve", "--max-bytes", "0"],
                          check=False, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "not a size above 0" in done.stderr


def test_the_default_max_bytes_is_half_the_containers_memory_limit_when_it_is_lower(tmp_path):
    """`docker run -m 2g`: cgroup v2's memory.max (or v1's memory.limit_in_bytes), not half the host's RAM."""
    from handoff_broker.app import default_max_bytes

    (tmp_path / "memory.max").write_text("2147483648\n")
    assert default_max_bytes(tmp_path) == 1 << 30
    (tmp_path / "memory.max").write_text("max\n")  # no limit: half the machine's memory
    host = default_max_bytes(tmp_path)
    assert host > 1 << 30 or host == default_max_bytes(tmp_path / "absent")
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("1073741824\n")  # cgroup v1
    assert default_max_bytes(tmp_path) == 1 << 29


def test_a_bad_value_in_the_environment_is_one_line_naming_it_and_other_commands_run():
    env = {**os.environ, "HANDOFF_MAX_BYTES": "16gigs"}
    done = subprocess.run([sys.executable, "-m", "handoff_broker", "serve"], env=env, check=False, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "HANDOFF_MAX_BYTES='16gigs' is not a valid --max-bytes" in done.stderr
    health = subprocess.run([sys.executable, "-m", "handoff_broker", "health", "--target", "127.0.0.1:1",
                             "--timeout", "1"], env=env, check=False, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "HANDOFF_MAX_BYTES" not in health.stderr and "UNAVAILABLE" in health.stdout + health.stderr


def test_the_log_flags_may_come_after_the_command():
    done = subprocess.run([sys.executable, "-m", "handoff_broker", "contract-from-config", "--help", "--log-format",
                           "json"], check=False, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0
    done = subprocess.run([sys.executable, "-m", "handoff_broker", "check-contracts", str(MANIFESTS), "--log-format",
                           "json", "--log-level", "INFO"], check=False, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
