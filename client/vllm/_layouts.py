"""Page layouts: where an attention backend keeps each token's key and value, read and written in the contract's
logical order (rows = token positions, kv_heads × head_dim columns).

This is the design card's promise kept at vLLM's edge: whatever pages a backend lays the cache out in, the
connector reads and writes the logical order, so a prefill engine with block size 128 and a decode engine with block
size 32 — or a CPU engine and a GPU one — meet. Each layout knows one backend's page tensor for one layer, as vLLM
0.32 hands it to `register_kv_caches` (`allocate_kv_cache` → `create_kv_cache_views`): a logical
`[kernel_blocks, kv_heads, kernel_block, C]` view, whatever physical `KVCacheLayout` its strides follow.

    FLASH_ATTN, FLASHINFER, TRITON_ATTN   C = 2·head_dim, keys then values (`kv_cache.transpose(1, 2)
                                          .split(head_size, dim=-1)` in each backend): _pages.FlashLayout, checked
                                          at start-up against the backend's own cache writer on the pages' device
    CPU_ATTN                              C = 2·head_dim in whatever order the ISA's kernel keeps (the `vec`
                                          kernels store K transposed), learned at start-up through vLLM's own
                                          `cpu_attn_reshape_and_cache`: _cpu_pages
    MLA backends (CPU_MLA, FLASHMLA, ...) one latent per token, C = kv_lora_rank + qk_rope_head_dim: _mla_pages
    GDN / Mamba2 state pages              conv state then recurrent state, bytes: _state_pages

The pieces every layout shares (Geometry, kernel blocks, PageLayout's `gather` and `scatter` in logical order,
UnsupportedLayout) are _page_layout.py's. A backend not listed is refused at start-up with its name
(`UnsupportedLayout`): a silent wrong copy would give garbage tokens.
"""

from __future__ import annotations

import torch

from . import _cpu_pages, _pages
from ._page_layout import CacheWriter, Geometry, PageLayout, UnsupportedLayout

BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
FLASH_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


def with_kernel_block(geometry: Geometry, pages: torch.Tensor) -> Geometry:
    """`geometry` with the kernel block size a `[kernel_blocks, heads, kernel_block, C]` page view shows;
    UnsupportedLayout if it does not divide the manager block."""
    kernel = int(pages.shape[2])
    if kernel < 1 or geometry.block % kernel:
        raise UnsupportedLayout(f"pages of {kernel} tokens a block do not divide vLLM's block of {geometry.block}")
    return Geometry(geometry.kv_heads, geometry.head_dim, geometry.block, 0 if kernel == geometry.block else kernel)


def layout_for(
    backend: str,
    geometry: Geometry,
    dtype: torch.dtype,
    isa: str | None = None,
    *,
    pages: torch.Tensor | None = None,
    writer: CacheWriter | None = None,
) -> PageLayout:
    """The layout of `backend`'s pages (the name vLLM's attention backend reports); UnsupportedLayout if unknown.

    With `pages` (the view vLLM registered), the kernel block size is read from them, and a FLASH_ATTN, FLASHINFER
    or TRITON_ATTN layout is verified on their device: index-coded tokens written by `writer` (the layer's own
    `do_kv_cache_update`, see _pages.cache_writer) into scratch pages of the same physical order must read back
    through the layout, and the layout's scatter must write the bytes the writer wrote. Any disagreement refuses."""
    if pages is not None:
        geometry = with_kernel_block(geometry, pages)
    if backend == "CPU_ATTN":
        return _cpu_pages.cpu_attn_layout(geometry, dtype, isa or "vec", writer)
    if backend in FLASH_BACKENDS:
        layout = _pages.FlashLayout(geometry, backend)
        if pages is not None:
            _pages.verify(layout, pages, writer)
        return layout
    raise UnsupportedLayout(
        f"the attention backend {backend} lays its KV pages out in a way handoff-broker's connector does not know "
        f"(it knows {', '.join(BACKENDS)}); choose one of those (VLLM_ATTENTION_BACKEND) rather than risk a wrong copy"
    )
