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

Block ids are the scheduler's (manager) blocks of `Geometry.block` tokens. vLLM may cut each into
`block // kernel_block` kernel blocks (`kernel_block_size`), which is what the page tensor's first axis counts:
manager block b is kernel blocks b·r … b·r + r − 1. A layout learns the kernel block from the pages themselves.

`gather(pages, block_ids, rows, first=0)` reads tokens [first, rows) and `scatter(pages, block_ids, first, keys,
values)` writes tokens [first, first + n); neither touches a block wholly outside its tokens, so a sliding window's
nulled blocks (id 0) before `first` are never read or written.

A backend not listed is refused at start-up with its name (`UnsupportedLayout`): a silent wrong copy would give
garbage tokens. `gather` returns copies (the pages are free to be reused at once); `scatter` writes only the rows
it is given and leaves every other slot of the blocks as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
FLASH_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")

CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""vLLM's own cache writer for one layer: (keys (n, kv_heads, head_dim), values, pages, slot_mapping (n,)); a slot is
kernel_block_id · kernel_block + offset, as vLLM's slot mappings count them."""


class UnsupportedLayout(RuntimeError):
    """An attention backend whose page layout the connector does not know, or whose pages disagree with what the
    connector would read; the message names the backend and what differed."""


@dataclass(frozen=True)
class Geometry:
    """One layer's cache, as the connector sees it: kv_heads × head_dim per token, `block` tokens a (manager) block,
    each cut into kernel blocks of `kernel_block` tokens (0: not cut)."""

    kv_heads: int
    head_dim: int
    block: int
    kernel_block: int = 0

    @property
    def kernel(self) -> int:
        """Tokens in one page of the page tensor's first axis."""
        return self.kernel_block or self.block

    @property
    def ratio(self) -> int:
        """Kernel blocks per manager block."""
        return self.block // self.kernel


def kernel_block_ids(geometry: Geometry, block_ids: list[int]) -> list[int]:
    """The page tensor's blocks, in token order, that manager blocks `block_ids` are made of."""
    r = geometry.ratio
    return list(block_ids) if r == 1 else [b * r + j for b in block_ids for j in range(r)]


def with_kernel_block(geometry: Geometry, pages: torch.Tensor) -> Geometry:
    """`geometry` with the kernel block size a `[kernel_blocks, heads, kernel_block, C]` page view shows;
    UnsupportedLayout if it does not divide the manager block."""
    kernel = int(pages.shape[2])
    if kernel < 1 or geometry.block % kernel:
        raise UnsupportedLayout(f"pages of {kernel} tokens a block do not divide vLLM's block of {geometry.block}")
    return Geometry(geometry.kv_heads, geometry.head_dim, geometry.block, 0 if kernel == geometry.block else kernel)


class PageLayout:
    """One backend's pages for one layer, read and written in logical order. Subclasses see kernel blocks only:
    `gather` and `scatter` turn the scheduler's block ids into the page tensor's ones."""

    name: str = ""

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry

    def gather(
        self, pages: torch.Tensor, block_ids: list[int], rows: int, first: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [first, rows) of the request whose blocks are `block_ids`, as (rows - first,
        heads·dim). Blocks wholly before `first` are not read (a sliding window's nulled blocks may stand there)."""
        g = self.geometry
        ids = kernel_block_ids(g, block_ids)[first // g.kernel : math.ceil(rows / g.kernel)]
        keys, values = self._blocks(pages, ids)
        width, base = g.kv_heads * g.head_dim, (first // g.kernel) * g.kernel
        return (keys.reshape(-1, width)[first - base : rows - base].clone(),
                values.reshape(-1, width)[first - base : rows - base].clone())  # fmt: skip

    def scatter(
        self, pages: torch.Tensor, block_ids: list[int], first: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write tokens [first, first + len(keys)) of the request whose blocks are `block_ids`; (n, heads·dim)."""
        end = first + keys.shape[0]
        if end == first:
            return
        g = self.geometry
        ids = kernel_block_ids(g, block_ids)[first // g.kernel : math.ceil(end / g.kernel)]
        old_keys, old_values = self._blocks(pages, ids)
        base = (first // g.kernel) * g.kernel
        width = g.kv_heads * g.head_dim
        flat_keys, flat_values = old_keys.reshape(-1, width), old_values.reshape(-1, width)
        flat_keys[first - base : end - base] = keys.to(pages.dtype)
        flat_values[first - base : end - base] = values.to(pages.dtype)
        self._store(pages, ids, flat_keys.view(old_keys.shape), flat_values.view(old_values.shape))

    def _blocks(self, pages: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of keys and values of kernel blocks `ids`, as (n, kernel_block, kv_heads, head_dim)."""
        raise NotImplementedError

    def _store(self, pages: torch.Tensor, ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError


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
    from . import _cpu_pages, _pages

    if pages is not None:
        geometry = with_kernel_block(geometry, pages)
    if backend == "CPU_ATTN":
        return _cpu_pages.cpu_attn_layout(geometry, dtype, isa or "vec")
    if backend in FLASH_BACKENDS:
        layout = _pages.FlashLayout(geometry, backend)
        if pages is not None:
            _pages.verify(layout, pages, writer)
        return layout
    raise UnsupportedLayout(
        f"the attention backend {backend} lays its KV pages out in a way handoff-broker's connector does not know "
        f"(it knows {', '.join(BACKENDS)}); choose one of those (VLLM_ATTENTION_BACKEND) rather than risk a wrong copy"
    )
