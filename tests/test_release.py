"""The release a tree is, said once (pyproject's `version`) and agreed with everywhere it is shown: `--version`,
`handoff_client.__version__` and `handoff_build_info` (the installed metadata), and the image tag every deploy file
and doc builds or runs. The CHANGELOG's top section is `## Unreleased` and the next a dated release; the tree's
version is that release, or a development version of the one after it (PEP 440 `X.Y.Z.devN`, which is a valid
image tag as it stands: no `+local` part, which a Docker tag could not carry).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import handoff_client

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
DEVELOPMENT = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.dev(\d+)$")
# Every file that names the broker's image: what a user builds, runs, or applies.
IMAGE_FILES = ["Dockerfile", "docker-compose.yml", "README.md", "CONTRIBUTING.md"]
IMAGE_FILES += [
    str(path.relative_to(ROOT)) for path in [*(ROOT / "docs").glob("*.md"), *(ROOT / "deploy").rglob("*.y*ml")]
]


def released() -> list[tuple[str, str]]:
    """The CHANGELOG's release sections, newest first: (version, date)."""
    return re.findall(r"^## (\d+\.\d+\.\d+) - (\d{4}-\d{2}-\d{2})$", CHANGELOG, re.MULTILINE)


def test_the_changelog_keeps_unreleased_on_top_of_the_last_release():
    sections = re.findall(r"^## (.+)$", CHANGELOG, re.MULTILINE)
    assert sections[0] == "Unreleased", sections[:2]
    assert sections[1] == " - ".join(released()[0]), "the section under Unreleased is the latest release, dated"
    versions = [tuple(map(int, version.split("."))) for version, _ in released()]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)


def test_the_version_is_the_latest_release_or_a_development_version_after_it():
    latest = tuple(map(int, released()[0][0].split(".")))
    if match := RELEASE.match(VERSION):
        assert tuple(map(int, match.groups())) == latest, f"{VERSION} is not the CHANGELOG's latest release"
    else:
        match = DEVELOPMENT.match(VERSION)
        assert match, f"pyproject's version {VERSION!r} is neither X.Y.Z nor X.Y.Z.devN"
        assert tuple(map(int, match.groups()[:3])) > latest, f"{VERSION} does not come after release {latest}"


def test_every_image_tag_is_the_version():
    tags = {}
    for name in IMAGE_FILES:
        for tag in re.findall(r"\bhandoff-broker:(\d[A-Za-z0-9_.-]*)", (ROOT / name).read_text()):
            tags.setdefault(tag.rstrip("."), []).append(name)
    assert set(tags) == {VERSION}, tags
    assert {"Dockerfile", "docker-compose.yml", "README.md", "deploy/kubernetes/base/broker.yaml"} <= set(tags[VERSION])


def test_the_front_page_states_the_release_and_the_version():
    status = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("**Status:**"))
    assert f"release {released()[0][0]}" in status, status
    assert VERSION == released()[0][0] or f"this tree {VERSION}" in status, status


def test_version_and_build_info_show_the_installed_version_which_is_pyprojects():
    """The installed metadata is what --version and handoff_build_info read: an install made before the version
    changed (an editable one) must be reinstalled, and this says so."""
    assert handoff_client.__version__ == VERSION, "reinstall: pip install -e . (the metadata is from before a bump)"
    from handoff_broker.metrics import build_labels

    assert build_labels()["version"] == VERSION
    done = subprocess.run([sys.executable, "-m", "handoff_broker.cli", "--version"], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.startswith(f"handoff-broker {VERSION} (Python ")
