"""Contracts derived from real Hugging Face config.json files (tests/configs, copied field by field from the
public configs), checked against figures worked out by hand here, for every architecture supported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from handoff_client._architectures import ConfigError, contract_from_config

CONFIGS = Path(__file__).parent / "configs"
MiB = 1 << 20


def derive(name: str, **options) -> object:
    return contract_from_config(json.loads((CONFIGS / f"{name}.json").read_text()), **options)


def test_llama_3_8b_has_a_key_and_a_value_cache_per_layer_of_8_kv_heads():
    c = derive("llama-3-8b")
    assert (c.model, c.ctx, c.hidden, len(c.carried)) == ("meta-llama/Meta-Llama-3-8B", 4096, 4096, 64)
    assert [x.name for x in c.of_layer(0)] == ["layers.0.self_attn.k_cache", "layers.0.self_attn.v_cache"]
    assert {(x.rows, x.cols, x.dtype) for x in c.carried} == {(4096, 8 * 128, "bfloat16")}  # 4096 / 32 heads = 128
    assert c.nbytes == 32 * 2 * 4096 * 1024 * 2 == 512 * MiB
    assert derive("llama-3-8b", ctx=32768).nbytes == 4096 * MiB


def test_mistral_7b_keeps_a_ring_of_its_sliding_window_less_one_not_the_whole_context():
    assert derive("mistral-7b-v0.1").nbytes == 4095 * 1024 * 2 * 64  # a window of 4096 ends at the token itself
    long = derive("mistral-7b-v0.1", ctx=32768)
    assert {x.rows for x in long.carried} == {4095}  # sliding_window 4096: the next token reads 4095 cached rows
    assert long.nbytes == 4095 * 1024 * 2 * 64


def test_qwen2_7b_derives_head_dim_from_hidden_size_and_ignores_an_unused_window():
    c = derive("qwen2-7b")
    assert {(x.rows, x.cols) for x in c.carried} == {(4096, 4 * 128)}  # 3584 / 28 heads = 128; use_sliding_window false
    assert len(c.carried) == 56 and c.nbytes == 28 * 2 * 4096 * 512 * 2 == 224 * MiB


def test_qwen3_8b_takes_head_dim_as_the_config_gives_it():
    c = derive("qwen3-8b")
    assert {(x.rows, x.cols) for x in c.carried} == {(4096, 8 * 128)}
    assert len(c.carried) == 72 and c.nbytes == 576 * MiB


def test_gemma_2_alternates_sliding_and_global_layers():
    c = derive("gemma-2-9b", ctx=32768)
    rows = [x.rows for x in c.carried if x.name.endswith("k_cache")]
    assert rows[:4] == [4095, 32768, 4095, 32768]  # even layers slide (window 4096), odd layers see everything
    assert {x.cols for x in c.carried} == {8 * 256}
    assert c.nbytes == 21 * 2 * (4095 + 32768) * 2048 * 2


def test_gemma_3_has_one_global_layer_in_six():
    c = derive("gemma-3-1b")
    full = [x.layer for x in c.carried if x.name.endswith("k_cache") and x.rows == 4096]
    assert full == [5, 11, 17, 23]
    assert {x.rows for x in c.carried if x.layer not in full} == {511}  # window 512
    assert c.nbytes == 4 * 2 * 4096 * 256 * 2 + 22 * 2 * 511 * 256 * 2


def test_deepseek_v3_carries_one_latent_per_layer():
    c = derive("deepseek-v3")
    assert [x.name for x in c.of_layer(60)] == ["layers.60.self_attn.kv_latent"]
    assert len(c.carried) == 61 and {(x.rows, x.cols) for x in c.carried} == {(4096, 512 + 64)}
    assert c.nbytes == 61 * 4096 * 576 * 2


def test_qwen3_next_carries_conv_rings_and_memories_split_by_head_and_every_fourth_layer_a_kv_cache():
    c = derive("qwen3-next-80b-a3b")
    gdn = ["layers.0.linear_attn.conv_q", "layers.0.linear_attn.conv_k", "layers.0.linear_attn.conv_v"]
    assert [x.name for x in c.of_layer(0)] == [*gdn, "layers.0.linear_attn.memory"]
    assert [x.name for x in c.of_layer(3)] == ["layers.3.self_attn.k_cache", "layers.3.self_attn.v_cache"]
    q, k, v = (c.tensor(name) for name in gdn)  # kernel 4 - 1 rows; 16 key heads of 128, 32 value heads of 128
    assert [(x.rows, x.cols, x.heads, x.head_dim, x.dtype) for x in (q, k, v)] == [
        (3, 16 * 128, 16, 128, "bfloat16"), (3, 16 * 128, 16, 128, "bfloat16"), (3, 32 * 128, 32, 128, "bfloat16"),
    ]  # fmt: skip
    memory = c.tensor("layers.0.linear_attn.memory")  # k dim rows; value heads x v dim columns, split by value head
    assert (memory.rows, memory.cols, memory.heads, memory.head_dim, memory.dtype) == (
        128,
        32 * 128,
        32,
        128,
        "float32",
    )
    assert not any(x.rows_are_positions for x in (q, k, v, memory)) and not c.rewindable
    kv = c.tensor("layers.3.self_attn.k_cache")
    assert (kv.rows, kv.cols) == (4096, 2 * 256)
    assert sum(1 for x in c.carried if x.name.endswith("k_cache")) == 12
    assert c.nbytes == 12 * 2 * 4096 * 512 * 2 + 36 * (3 * 8192 * 2 + 4096 * 128 * 4) == 177_930_240


def test_qwen3_5_is_read_from_its_nested_text_config_as_qwen3_next_is():
    c = derive("qwen3_5-tiny")  # a tiny Qwen3.5 (2 key heads, 4 value heads of 64) under a multimodal wrapper
    assert (c.model, c.hidden, len(c.carried)) == ("qwen3_5-tiny", 256, 3 * 4 + 2)
    assert [x.name.rsplit(".", 1)[1] for x in c.carried[:4]] == ["conv_q", "conv_k", "conv_v", "memory"]
    assert [(x.rows, x.cols, x.heads) for x in c.carried[:4]] == [(3, 128, 2), (3, 128, 2), (3, 256, 4), (64, 256, 4)]
    text = {**json.loads((CONFIGS / "qwen3_5-tiny.json").read_text())["text_config"], "model_type": "qwen3_5_moe_text"}
    assert contract_from_config(text, model="qwen3_5-tiny").carried == c.carried  # a text-only (MoE) config alike
    moe = {**json.loads((CONFIGS / "qwen3_5-tiny.json").read_text()), "model_type": "qwen3_5_moe"}
    assert contract_from_config(moe).carried == c.carried


def test_nemotron_h_carries_mamba2_state_on_m_layers_and_kv_caches_on_star_layers():
    c = derive("nemotron-nano-9b-v2")
    pattern = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
    assert sorted({x.layer for x in c.carried}) == [i for i, kind in enumerate(pattern) if kind in "M*"]
    assert [x.name for x in c.of_layer(0)] == [f"layers.0.mamba.{t}" for t in ("conv_x", "conv_b", "conv_c", "ssm")]
    x, b, cc, ssm = c.of_layer(0)  # 128 heads of 80, 8 groups of state 128, conv kernel 4
    assert [(t.rows, t.cols, t.heads, t.head_dim) for t in (x, b, cc)] == [
        (3, 128 * 80, 128, 80), (3, 8 * 128, 8, 128), (3, 8 * 128, 8, 128),
    ]  # fmt: skip
    assert (ssm.rows, ssm.cols, ssm.heads, ssm.head_dim, ssm.dtype) == (80, 128 * 128, 128, 128, "float32")
    assert [x.name for x in c.of_layer(14)] == ["layers.14.self_attn.k_cache", "layers.14.self_attn.v_cache"]
    assert c.tensor("layers.14.self_attn.k_cache").shape == (4096, 8 * 128)
    assert sum(1 for t in c.carried if t.name.endswith("ssm")) == pattern.count("M") == 27
    legacy = {**json.loads((CONFIGS / "nemotron-nano-9b-v2.json").read_text()), "mamba_n_groups": 8, "mamba_d_conv": 4}
    del legacy["hybrid_override_pattern"], legacy["n_groups"], legacy["conv_kernel"]
    legacy["layers_block_type"] = [{"M": "mamba", "*": "attention", "-": "mlp"}[k] for k in pattern]
    assert contract_from_config(legacy).carried == c.carried  # the list spelling and the legacy field names alike


def test_granite_4_hybrid_and_falcon_h1_carry_mamba2_state_with_one_group_every_rank_holds():
    granite = derive("granite-hybrid-tiny")  # layers 3 and 7 attention, the rest Mamba2; 8 heads of 128, 1 group
    assert [t.name.rsplit(".", 1)[1] for t in granite.of_layer(3)] == ["k_cache", "v_cache"]
    assert [(t.rows, t.cols, t.heads) for t in granite.of_layer(0)] == [
        (3, 1024, 8), (3, 128, 1), (3, 128, 1), (128, 8 * 128, 8),
    ]  # fmt: skip
    falcon = derive("falcon-h1")  # every layer: the Mamba2 mixer, then attention
    assert [t.name.rsplit(".", 1)[1] for t in falcon.of_layer(23)] == ["conv_x", "conv_b", "conv_c", "ssm", "k_cache",
                                                                       "v_cache"]  # fmt: skip
    assert [(t.rows, t.cols, t.heads) for t in falcon.of_layer(0)][:4] == [
        (3, 3072, 48), (3, 256, 1), (3, 256, 1), (64, 48 * 256, 48),
    ]  # fmt: skip
    auto = {**json.loads((CONFIGS / "falcon-h1.json").read_text()), "mamba_d_head": "auto"}
    assert contract_from_config(auto).carried == falcon.carried  # "auto": mamba_d_ssm / heads
    with pytest.raises(ConfigError, match=r"48 Mamba heads x mamba_d_head 32 do not make the intermediate size 3072"):
        contract_from_config({**auto, "mamba_d_head": 32})
    with pytest.raises(ConfigError, match=r"`mamba_d_conv` 1 keeps no conv ring"):
        contract_from_config({**auto, "mamba_d_conv": 1})


def test_only_a_contract_whose_rows_are_all_positions_over_the_whole_cache_is_rewindable():
    assert derive("llama-3-8b").rewindable and derive("deepseek-v3").rewindable
    assert derive("llama-3-8b").at(100).rewindable  # a hand-off's filled view says what its contract says
    for hybrid in ("qwen3-next-80b-a3b", "qwen3_5-tiny", "nemotron-nano-9b-v2", "granite-hybrid-tiny", "falcon-h1"):
        assert not derive(hybrid).rewindable, hybrid  # a conv ring and a recurrent state cannot be run back
    assert not derive("gemma-3-1b").rewindable  # a ring of 511 rows in 4096 wraps: position N has lost row N - 512
    assert derive("mistral-7b-v0.1").rewindable  # a ring of 4095 rows in a cache of 4096 never wraps
    assert not derive("mistral-7b-v0.1", ctx=8192).rewindable
    assert not derive("llama-3-8b", dtype="float8_e4m3fn").rewindable  # a per-tensor scale is not positional
    assert derive("llama-3-8b", dtype="int8").rewindable  # a per-row one is


def test_a_float8_cache_carries_a_per_tensor_scale_and_int8_a_per_row_one():
    fp8 = derive("llama-3-8b", dtype="float8_e4m3fn")
    assert [x.name for x in fp8.of_layer(0)] == [
        "layers.0.self_attn.k_cache", "layers.0.self_attn.k_cache.scale",
        "layers.0.self_attn.v_cache", "layers.0.self_attn.v_cache.scale",
    ]  # fmt: skip
    scale = fp8.tensor("layers.0.self_attn.k_cache.scale")
    assert (scale.rows, scale.cols, scale.dtype) == (1, 1, "float32")
    assert fp8.nbytes == 64 * (4096 * 1024 + 4)
    int8 = derive("llama-3-8b", dtype="int8")
    assert (int8.tensor("layers.0.self_attn.v_cache.scale").rows, int8.nbytes) == (4096, 64 * (4096 * 1024 + 4096 * 4))
    assert len(derive("llama-3-8b", dtype="int8", scale="none").carried) == 64


def test_an_architecture_it_does_not_know_is_refused_never_guessed():
    with pytest.raises(ConfigError, match=r"model_type `minimax_text_01` is not supported: its lightning-attention"):
        derive("minimax-text-01")
    with pytest.raises(ConfigError, match=r"model_type `gpt_bigcode` is not supported; supported: deepseek_v2, "):
        contract_from_config({"model_type": "gpt_bigcode", "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match=r"`num_key_value_heads` must be a positive integer, got 'eight'"):
        contract_from_config({**json.loads((CONFIGS / "llama-3-8b.json").read_text()), "num_key_value_heads": "eight"})
    with pytest.raises(ConfigError, match="dtype 'float13'"):
        derive("llama-3-8b", dtype="float13")


def test_contract_from_config_writes_a_manifest_the_broker_loads(tmp_path: Path):
    import subprocess
    import sys

    from handoff_broker.contracts import load_contracts

    out = tmp_path / "qwen3-next.json"
    command = [
        sys.executable,
        "-m",
        "handoff_broker.cli",
        "contract-from-config",
        str(CONFIGS / "qwen3-next-80b-a3b.json"),
    ]
    result = subprocess.run([*command, "--ctx", "8192", "--model", "qwen3-next", "-o", str(out)],
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert load_contracts(tmp_path) == {"qwen3-next": derive("qwen3-next-80b-a3b", ctx=8192, model="qwen3-next")}
    refused = subprocess.run([*command[:-1], str(CONFIGS / "minimax-text-01.json")], capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
    assert refused.returncode == 2 and "model_type `minimax_text_01` is not supported" in refused.stderr


def test_serve_serves_a_config_json_directly_and_moves_its_hand_off(start_broker):
    import numpy as np
    from handoff_client import HandoffClient

    contract = derive("gemma-3-1b", ctx=1024)
    broker = start_broker(contracts={contract.model: contract})
    with HandoffClient(broker.address) as client:
        served = client.get_contract("google/gemma-3-1b-it")
        assert served == contract
        tensors = {c.name: np.full(c.shape, 1.5, c.numpy_dtype) for c in served.carried}
        client.push(served.model, "r", 7, tensors)  # whole cache arrays: the client sends the 7 rows filled
        pulled = client.pull(served.model, "r").state
        assert all(v.shape == (7, served.tensor(k).cols) for k, v in pulled.items())
        assert all(np.array_equal(v, tensors[k][:7]) for k, v in pulled.items())
