"""What ops tools expect: a real Prometheus scrapes the broker and every dashboard query returns data; grpcurl-style
reflection lists the service; the demo traffic workers of the compose file run; settings come from TOML."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import seeded_tensors
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from handoff_broker import cli, flag_sources
from handoff_client import HandoffClient, HandoffError

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "handoff-broker.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(port: int, expr: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's prometheus (see .ci/run)")
        pytest.skip("no prometheus binary on PATH (apt-get install prometheus); CI installs it")
    return binary


def test_a_real_prometheus_scrapes_the_broker_and_every_dashboard_query_returns_data(
    prometheus_binary, start_broker, contracts, tmp_path
):
    broker = start_broker(metrics_port=0)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: handoff-broker\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{broker.metrics_port}']\n"
    )
    port = free_port()
    prometheus = subprocess.Popen(
        [prometheus_binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    stop = threading.Event()

    def traffic() -> None:
        with HandoffClient(broker.address) as client:
            tensors = seeded_tensors(contracts["demo-hybrid"])
            n = 0
            while not stop.is_set():
                client.push("demo-hybrid", f"t{n}", 1, tensors)
                client.pull("demo-hybrid", f"t{n}")
                try:
                    client.pull("demo-hybrid", f"t{n}", timeout=1)  # already confirmed: a refusal
                except HandoffError:
                    pass
                n += 1
                time.sleep(0.1)

    mover = threading.Thread(target=traffic)
    mover.start()
    try:
        deadline = time.monotonic() + 60
        while True:  # until Prometheus has a few scrapes of the broker under traffic
            try:
                result = query(port, 'count_over_time(up{job="handoff-broker"}[1m])')["data"]["result"]
                if result and float(result[0]["value"][1]) >= 4:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Prometheus never scraped the broker"
            time.sleep(0.5)
        assert query(port, 'up{job="handoff-broker"}')["data"]["result"][0]["value"][1] == "1"
        pushed = query(port, 'handoff_pushes_total{model="demo-hybrid",outcome="committed"}')["data"]["result"]
        assert float(pushed[0]["value"][1]) > 0
        exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]
        assert len(exprs) >= 10
        for expr in exprs:
            answer = query(port, expr)
            assert answer["status"] == "success", expr
            assert answer["data"]["result"], f"no data for the dashboard's `{expr}`"
    finally:
        stop.set()
        mover.join(30)
        prometheus.terminate()
        prometheus.wait(30)


def test_reflection_lists_the_service_health_and_reflection(broker):
    with grpc.insecure_channel(broker.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"handoff.v1.HandoffBroker", "grpc.health.v1.Health"} <= services
        described = database.FindFileContainingSymbol("handoff.v1.HandoffBroker")
        assert described.name == "handoff/v1/handoff.proto"
        # ... under reflection v1 too, which newer grpcurl and Postman ask for first (the same messages on the wire)
        assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= services
        ask = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (answer,) = ask(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="handoff.v1.HandoffBroker")])
        )
        assert answer.file_descriptor_response.file_descriptor_proto  # the .proto's descriptor, as on v1alpha


def test_the_compose_files_demo_workers_move_hand_offs(broker):
    command = [sys.executable, "-m", "handoff_broker.cli", "--log-level", "WARNING", "traffic"]
    common = ["--target", broker.address, "--count", "3", "--interval", "0"]
    decode = subprocess.Popen([*command, "decode", *common], stdout=subprocess.PIPE, text=True)
    prefill = subprocess.run([*command, "prefill", *common], capture_output=True, text=True, timeout=60, check=False)
    assert prefill.returncode == 0, prefill.stderr
    assert decode.wait(timeout=60) == 0
    assert decode.stdout.read().strip() == "decode: 3 hand-offs of demo-hybrid"
    # Restarted, they meet ids already moved: the prefill's are recognised repeats, the decode's are gone, and
    # neither sticks on them (before the fix each retried its first id forever).
    again = subprocess.run([*command, "prefill", *common], capture_output=True, text=True, timeout=60, check=False)
    assert (again.returncode, again.stdout.strip()) == (0, "prefill: 3 hand-offs of demo-hybrid")
    stale = subprocess.run([*command, "decode", *common], capture_output=True, text=True, timeout=60, check=False)
    assert (stale.returncode, stale.stdout.strip()) == (1, "decode: 0 hand-offs of demo-hybrid, 3 given up")


def test_settings_come_from_a_toml_file_below_the_environment_and_the_command_line(tmp_path, monkeypatch, capsys):
    settings = tmp_path / "broker.toml"
    settings.write_text('ttl = 12.5\nmax-bytes = "2GiB"\nlease = 3.0\nmodel-config = ["a.json"]\n')

    def parsed(*argv: str):
        parser = cli.build_parser()
        flag_sources.apply_config_file(parser, list(argv))
        return parser.parse_args(list(argv))

    args = parsed("serve", "--config", str(settings), "--lease", "4")
    assert (args.ttl, args.max_bytes, args.lease, args.model_config) == (12.5, 2 << 30, 4.0, ["a.json"])
    monkeypatch.setenv("HANDOFF_TTL", "99")
    assert parsed("serve", "--config", str(settings)).ttl == 99.0
    settings.write_text("colour = 'blue'\n")
    with pytest.raises(SystemExit) as exit:
        parsed("serve", "--config", str(settings))
    assert exit.value.code == 2
    assert "colour: not a serve flag" in capsys.readouterr().err
