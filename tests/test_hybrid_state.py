"""Hybrid models' recurrent state across tensor-parallel sizes, and sliding-window rings, against vLLM's own rules.

The contract's conv rings and recurrent states are split by head (handoff_client._hybrids) so that each vLLM rank's
state is its own heads of them. Checked two ways: each rank's view of the contract against the per-rank state shapes
vLLM 0.32 itself computes (`MambaStateShapeCalculator`), and a hand-off pushed by the ranks of one TP size and pulled
by those of another through a real broker, each rank's state built the way vLLM shards it (conv channels per
segment, [Q_r | K_r | V_r] or [x_r | B_r | C_r]; the recurrent state by head), bit for bit. A sliding-window ring is
as long as what vLLM keeps (`SlidingWindowManager.get_num_skipped_tokens`).
"""

from __future__ import annotations

import json
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import assert_holds_nothing
from handoff_client import Contract, HandoffClient
from handoff_client._architectures import contract_from_config
from handoff_client.protocol.shards import Shard, ShardContract

CONFIGS = Path(__file__).parent / "configs"
TINY_NEXT = {  # a tiny Qwen3-Next: 4 key heads and 8 value heads of 64, a full-attention layer with 2 KV heads
    "model_type": "qwen3_next", "hidden_size": 256, "num_hidden_layers": 4, "full_attention_interval": 4,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
}  # fmt: skip


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def vllm_shapes():
    return pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils").MambaStateShapeCalculator


# -- each rank's view is the state vLLM's rank holds ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,tp", [("qwen3-next-80b-a3b", 1), ("qwen3-next-80b-a3b", 2), ("qwen3-next-80b-a3b", 8), ("qwen3_5-tiny", 2)]
)  # (vLLM splits a gated-delta layer's key heads and refuses fewer of them than ranks: Qwen3.5-tiny has 2)
def test_a_gated_delta_layers_state_at_each_rank_is_what_vllm_holds_there(name, tp):
    text = config(name).get("text_config", config(name))
    contract = contract_from_config(config(name), ctx=16)
    conv, ssm = vllm_shapes().gated_delta_net_state_shape(
        tp, text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
        text["linear_value_head_dim"], text["linear_conv_kernel_dim"],
    )  # fmt: skip
    for rank in range(tp):
        view = ShardContract.of(contract, Shard(rank, tp), pushing=False)
        q, k, v, memory = (view.tensor(f"layers.0.linear_attn.{t}") for t in ("conv_q", "conv_k", "conv_v", "memory"))
        assert (q.rows, q.cols + k.cols + v.cols) == conv  # vLLM's SD conv state: (kernel - 1, conv_dim / tp)
        heads, v_dim, k_dim = ssm  # vLLM's (value heads / tp, v_dim, k_dim)
        assert (memory.rows, memory.heads, memory.head_dim) == (k_dim, heads, v_dim)


@pytest.mark.parametrize("name", ["nemotron-nano-9b-v2", "granite-hybrid-tiny", "falcon-h1"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_mamba2_layers_state_at_each_rank_is_what_vllm_holds_there(name, tp):
    contract = contract_from_config(config(name), ctx=16)
    x, b, c, ssm = (contract.tensor(f"layers.0.mamba.{t}") for t in ("conv_x", "conv_b", "conv_c", "ssm"))
    if b.heads > 1 and b.heads % tp:
        pytest.skip(f"vLLM refuses {b.heads} groups at TP {tp} (n_groups % tp != 0 and n_groups != 1)")
    conv, state = vllm_shapes().mamba2_state_shape(tp, x.cols, b.heads, ssm.heads, ssm.rows, ssm.head_dim, x.rows + 1)
    for rank in range(tp):
        view = ShardContract.of(contract, Shard(rank, tp), pushing=False)
        mine = [view.tensor(t.name) for t in (x, b, c, ssm)]
        assert (x.rows, sum(t.cols for t in mine[:3])) == conv  # (kernel - 1, (intermediate + 2·groups·state) / tp)
        assert (mine[3].heads, mine[3].rows, mine[3].head_dim) == state  # (heads / tp, head_dim, state)


def transformers_configs() -> dict:
    """Tiny configs as transformers' own config classes write them (config.json as `save_pretrained` would), with
    the sizes vLLM's model code reads from the same object: (intermediate, groups, heads, head_dim, state, kernel)
    for Mamba2 (vLLM models/nemotron_h.py, granitemoehybrid.py, falcon_h1.py), (key heads, value heads, k_dim,
    v_dim, kernel) for gated-delta layers (models/qwen3_next.py, qwen3_5.py)."""
    t = pytest.importorskip("transformers")
    gdn = {"hidden_size": 256, "num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 32, "linear_value_head_dim": 64, "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip
    made = {
        "nemotron_h": t.NemotronHConfig(hidden_size=256, layers_block_type=["linear_attention", "mlp", "full_attention",
            "moe"], mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=16, conv_kernel=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        "granitemoehybrid": t.GraniteMoeHybridConfig(hidden_size=256, num_hidden_layers=4, layer_types=["mamba",
            "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, num_attention_heads=4,
            num_key_value_heads=2),
        "falcon_h1": t.FalconH1Config(hidden_size=256, num_hidden_layers=2, mamba_d_ssm=512, mamba_n_heads=8,
            mamba_n_groups=1, mamba_d_state=16, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
        "qwen3_next": t.Qwen3NextConfig(**gdn),
        "qwen3_5": t.Qwen3_5Config(text_config=gdn),
        "qwen3_5_moe": t.Qwen3_5MoeConfig(text_config=gdn),
    }  # fmt: skip
    sizes = {}
    for name, c in made.items():
        if name == "nemotron_h":
            sizes[name] = (c.mamba_num_heads * c.mamba_head_dim, c.n_groups, c.mamba_num_heads, c.mamba_head_dim,
                           c.ssm_state_size, c.conv_kernel)  # fmt: skip
        elif name in ("granitemoehybrid", "falcon_h1"):
            inner = c.mamba_expand * c.hidden_size if getattr(c, "mamba_d_ssm", None) is None else c.mamba_d_ssm
            sizes[name] = (inner, c.mamba_n_groups, c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state, c.mamba_d_conv)
        else:
            text = getattr(c, "text_config", c)
            sizes[name] = (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
                           text.linear_value_head_dim, text.linear_conv_kernel_dim)  # fmt: skip
    return {name: (json.loads(c.to_json_string()), sizes[name]) for name, c in made.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_configs_as_transformers_writes_them_derive_the_state_vllm_allocates_for_them(tp):
    calculator = vllm_shapes()
    for name, (written, sizes) in transformers_configs().items():
        contract = contract_from_config(written, ctx=16, model=name)
        states = [t for t in contract.carried if not t.rows_are_positions]
        assert states, name
        if len(sizes) == 6:
            conv, state = calculator.mamba2_state_shape(tp, *sizes)
        else:
            conv, state = calculator.gated_delta_net_state_shape(tp, *sizes)
        layer = states[0].layer
        view = ShardContract.of(contract, Shard(tp - 1, tp), pushing=False)
        mine = [view.tensor(t.name) for t in contract.of_layer(layer) if not t.rows_are_positions]
        assert (mine[0].rows, sum(t.cols for t in mine[:-1])) == conv, name
        assert mine[-1].values == state[0] * state[1] * state[2] and mine[-1].heads == state[0], name


@pytest.mark.parametrize("name,window", [("gemma-3-1b", 512), ("mistral-7b-v0.1", 4096)])
def test_a_sliding_window_ring_holds_exactly_the_rows_vllm_keeps(name, window):
    manager = pytest.importorskip("vllm.v1.core.single_type_kv_cache_manager").SlidingWindowManager
    kept = {n - manager.get_num_skipped_tokens(SimpleNamespace(sliding_window=window, extra_retained_tokens=0), n)
            for n in range(window, 4 * window, 97)}  # fmt: skip
    contract = contract_from_config(config(name), ctx=4 * window)
    rings = {t.rows for t in contract.carried if t.rows < contract.ctx}
    assert rings == kept == {window - 1}


# -- P/D pairs of different TP sizes through a real broker -------------------------------------------------------------


def vllm_rank_state(whole: dict, rank: int, tp: int) -> dict:
    """What vLLM's rank `rank` of `tp` holds of one recurrent layer's state, cut from the whole (TP 1) state the way
    vLLM shards it: each conv segment by its own heads (a segment with fewer heads than ranks replicated, as
    Mamba2's single group is), the recurrent state by head."""
    out = {"conv": [], "ssm": None}
    for segment, heads in whole["segments"]:
        width, first, count = segment.shape[1] // heads, rank * heads // tp, max(heads // tp, 1)  # a replica: r·H/t
        out["conv"].append(segment[:, first * width : (first + count) * width])
    heads = whole["ssm"].shape[0]
    out["conv"] = np.concatenate(out["conv"], axis=1)
    out["ssm"] = whole["ssm"][rank * heads // tp : (rank + 1) * heads // tp]
    return out


def to_contract(state: dict, names: list[str], widths: list[int], gdn: bool) -> dict:
    """A rank's vLLM state as its contract arrays: the conv state's columns cut into the segments' tensors; the
    recurrent state per head into the columns (vLLM's GDN ssm[h, b, a] is memory[a, h·v_dim + b]; Mamba2's
    ssm[h, p, n] is ssm[p, h·N + n])."""
    cuts = np.cumsum(widths)[:-1]
    arrays = dict(zip(names[:-1], np.split(state["conv"], cuts, axis=1)))
    ssm = state["ssm"]
    moved = ssm.transpose(2, 0, 1) if gdn else ssm.transpose(1, 0, 2)
    arrays[names[-1]] = np.ascontiguousarray(moved.reshape(moved.shape[0], -1))
    return {name: np.ascontiguousarray(a) for name, a in arrays.items()}


def from_contract(arrays: dict, names: list[str], heads: int, gdn: bool) -> dict:
    """The inverse of `to_contract`: a decode rank's pulled arrays as its vLLM state."""
    columns = arrays[names[-1]]
    per_head = columns.reshape(columns.shape[0], heads, -1)
    ssm = per_head.transpose(1, 2, 0) if gdn else per_head.transpose(1, 0, 2)
    return {"conv": np.concatenate([arrays[n] for n in names[:-1]], axis=1), "ssm": np.ascontiguousarray(ssm)}


def layer_zero(contract: Contract) -> tuple[list[str], bool]:
    names = [t.name for t in contract.of_layer(0) if "conv" in t.name or t.name.endswith(("memory", "ssm"))]
    return names, names[0].endswith("conv_q")


def whole_state(contract: Contract, seed: int) -> dict:
    """A whole (TP 1) vLLM state of layer 0, random bits: conv segments and the recurrent state (heads first)."""
    names, gdn = layer_zero(contract)
    rng = np.random.default_rng(seed)
    segments = []
    for name in names[:-1]:
        t = contract.tensor(name)
        segments.append((rng.standard_normal((t.rows, t.cols)).astype(t.numpy_dtype), t.heads))
    ssm = contract.tensor(names[-1])  # GDN (V, v_dim, k_dim); Mamba2 (H, P, N)
    shape = (ssm.heads, ssm.head_dim, ssm.rows) if gdn else (ssm.heads, ssm.rows, ssm.head_dim)
    return {"segments": segments, "ssm": rng.standard_normal(shape).astype(ssm.numpy_dtype)}


def state_only(contract: Contract) -> Contract:
    names, _ = layer_zero(contract)
    return Contract(contract.model, contract.ctx, contract.hidden, tuple(contract.tensor(n) for n in names))


HYBRIDS = {
    "tiny-next": state_only(contract_from_config(TINY_NEXT, ctx=16, model="tiny-next")),
    "granite-tiny": state_only(contract_from_config(config("granite-hybrid-tiny"), ctx=16, model="granite-tiny")),
}


@pytest.mark.parametrize("name", sorted(HYBRIDS))
@pytest.mark.parametrize("push_tp,pull_tp", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_a_hybrids_state_pushed_at_one_tp_size_is_pulled_at_another_as_vllm_holds_it(
    start_broker, name, push_tp, pull_tp
):
    """Granite's one Mamba2 group is held whole by every rank (replicated, as vLLM does: conv_b and conv_c are pushed
    by rank 0 only and pulled by every rank); the rest moves head by head between the ranks that hold it."""
    contract = HYBRIDS[name]
    names, gdn = layer_zero(contract)
    whole = whole_state(contract, seed=push_tp * 10 + pull_tp)
    broker = start_broker(contracts={name: contract})

    def push(rank: int) -> None:
        view = ShardContract.of(contract, Shard(rank, push_tp), pushing=False)
        widths = [view.tensor(n).cols for n in names[:-1]]
        arrays = to_contract(vllm_rank_state(whole, rank, push_tp), names, widths, gdn)
        pushing = ShardContract.of(contract, Shard(rank, push_tp), pushing=True)
        sent = {t.name for t in pushing.carried}  # a replica is pushed by its first holder only
        mine = {n: a for n, a in arrays.items() if n in sent}
        client.push(name, "req", 9, mine, shard=(rank, push_tp))

    with HandoffClient(broker.address, timeout=20) as client, futures.ThreadPoolExecutor(push_tp + pull_tp) as pool:
        pulls = [pool.submit(client.pull, name, "req", shard=(r, pull_tp)) for r in range(pull_tp)]
        list(pool.map(push, range(push_tp)))
        pulled = [p.result(timeout=20) for p in pulls]
    for rank, handoff in enumerate(pulled):
        heads = ShardContract.of(contract, Shard(rank, pull_tp), pushing=False).tensor(names[-1]).heads
        got, want = from_contract(handoff.state, names, heads, gdn), vllm_rank_state(whole, rank, pull_tp)
        assert got["conv"].tobytes() == want["conv"].tobytes(), f"rank {rank} of {pull_tp}: conv"
        assert got["ssm"].tobytes() == want["ssm"].tobytes(), f"rank {rank} of {pull_tp}: recurrent state"
    assert_holds_nothing(broker)
