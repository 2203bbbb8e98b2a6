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


def test_mistral_7b_keeps_a_ring_of_its_sliding_window_not_the_whole_context():
    assert derive("mistral-7b-v0.1").nbytes == 512 * MiB
    long = derive("mistral-7b-v0.1", ctx=32768)
    assert {x.rows for x in long.carried} == {4096}  # sliding_window 4096
    assert long.nbytes == 512 * MiB


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
    assert rows[:4] == [4096, 32768, 4096, 32768]  # even layers slide (window 4096), odd layers see everything
    assert {x.cols for x in c.carried} == {8 * 256}
    assert c.nbytes == 21 * 2 * (4096 + 32768) * 2048 * 2 == 6048 * MiB


def test_gemma_3_has_one_global_layer_in_six():
    c = derive("gemma-3-1b")
    full = [x.layer for x in c.carried if x.name.endswith("k_cache") and x.rows == 4096]
    assert full == [5, 11, 17, 23]
    assert {x.rows for x in c.carried if x.layer not in full} == {512}
    assert c.nbytes == 4 * 2 * 4096 * 256 * 2 + 22 * 2 * 512 * 256 * 2 == 27 * MiB


def test_deepseek_v3_carries_one_latent_per_layer():
    c = derive("deepseek-v3")
    assert [x.name for x in c.of_layer(60)] == ["layers.60.self_attn.kv_latent"]
    assert len(c.carried) == 61 and {(x.rows, x.cols) for x in c.carried} == {(4096, 512 + 64)}
    assert c.nbytes == 61 * 4096 * 576 * 2


def test_qwen3_next_carries_conv_rings_and_memories_and_every_fourth_layer_a_kv_cache():
    c = derive("qwen3-next-80b-a3b")
    assert [x.name for x in c.of_layer(0)] == ["layers.0.linear_attn.conv_ring", "layers.0.linear_attn.memory"]
    assert [x.name for x in c.of_layer(3)] == ["layers.3.self_attn.k_cache", "layers.3.self_attn.v_cache"]
    ring, memory = c.tensor("layers.0.linear_attn.conv_ring"), c.tensor("layers.0.linear_attn.memory")
    assert (ring.rows, ring.cols, ring.dtype) == (3, 2 * 16 * 128 + 32 * 128, "bfloat16")  # kernel 4 - 1; q, k, v
    assert (memory.rows, memory.cols, memory.dtype) == (32 * 128, 128, "float32")  # value heads x k dim, v dim
    kv = c.tensor("layers.3.self_attn.k_cache")
    assert (kv.rows, kv.cols) == (4096, 2 * 256)
    assert sum(1 for x in c.carried if x.name.endswith("k_cache")) == 12
    assert c.nbytes == 12 * 2 * 4096 * 512 * 2 + 36 * (3 * 8192 * 2 + 4096 * 128 * 4) == 177_930_240


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
