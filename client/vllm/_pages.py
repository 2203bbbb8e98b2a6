"""vLLM 0.32's attention pages for FLASH_ATTN, FLASHINFER and TRITON_ATTN, and their start-up check.

vLLM 0.32 registers every attention layer's cache as the logical view `[kernel_blocks, kv_heads, kernel_block,
2·head_dim]` (`create_kv_cache_views`); the physical `KVCacheLayout` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC)
changes only its strides. Each of the three backends reads and writes it as `kv_cache.transpose(1, 2)
.split(head_size, dim=-1)`: token t of kernel block b is `[b, :, t, :head_dim]` (keys) and `[b, :, t, head_dim:]`
(values). FlashLayout indexes that view, so torch follows whatever strides the pages have.

`verify` does not trust any of this: on the pages' own device, it writes index-coded tokens through the layer's own
cache writer (`impl.do_kv_cache_update`, which calls the backend's real kernel: `reshape_and_cache_flash` or
Triton's) into scratch pages of the same shape and physical order, and requires (1) the layout's gather to read each
code back where the writer put it and (2) the layout's scatter of the same codes to leave exactly the bytes the writer
left. Either failing refuses start-up with UnsupportedLayout naming the backend and the first element that differed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._page_layout import CacheWriter, Geometry, PageLayout, UnsupportedLayout, slot_mapping, token_places

EXACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SENTINEL = -1.0  # no index code is negative: an element still holding it was never written


class FlashLayout(PageLayout):
    """`[kernel_blocks, kv_heads, kernel_block, 2·head_dim]` pages, keys then values in the last axis, any strides."""

    def __init__(self, geometry: Geometry, name: str) -> None:
        super().__init__(geometry)
        self.name = name

    def gather(
        self, pages: torch.Tensor, block_ids: list[int], rows: int, first: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = token_places(self.geometry, block_ids, first, rows, pages.device)
        view, d = pages.transpose(1, 2), self.geometry.head_dim  # (kernel_blocks, kernel_block, kv_heads, 2·head_dim)
        # Each a fresh (rows - first, kv_heads, head_dim) tensor (advanced indexing copies), so the reshape is free.
        n = rows - first
        return view[blocks, offsets, :, :d].reshape(n, -1), view[blocks, offsets, :, d:].reshape(n, -1)

    def scatter(
        self, pages: torch.Tensor, block_ids: list[int], first: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        n = keys.shape[0]
        if n == 0:
            return
        g = self.geometry
        blocks, offsets = token_places(self.geometry, block_ids, first, first + n, pages.device)
        view = pages.transpose(1, 2)  # (kernel_blocks, kernel_block, kv_heads, 2·head_dim): a view of the pages
        view[blocks, offsets, :, : g.head_dim] = keys.reshape(n, g.kv_heads, g.head_dim).to(pages.dtype)
        view[blocks, offsets, :, g.head_dim :] = values.reshape(n, g.kv_heads, g.head_dim).to(pages.dtype)


def cache_writer(vllm_config: Any, layer_name: str) -> CacheWriter | None:
    """The cache writer vLLM itself runs for `layer_name` (its attention impl's `do_kv_cache_update`); where the
    layer or its impl is not at hand, vLLM's `reshape_and_cache_flash` op on the backends' split of the pages, if
    that op exists here (CUDA builds); else None."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    impl = getattr(layer, "impl", None)
    if impl is None or not hasattr(impl, "do_kv_cache_update"):
        return _flash_op_writer()

    def write(keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
        impl.do_kv_cache_update(layer, keys, values, pages, slots)

    return write


def _flash_op_writer() -> CacheWriter | None:
    try:
        from vllm import _custom_ops as ops

        torch.ops._C_cache_ops.reshape_and_cache_flash  # noqa: B018 - absent from CPU builds
    except (ImportError, AttributeError, RuntimeError):
        return None

    def write(keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
        key_cache, value_cache = pages.transpose(1, 2).split(keys.shape[-1], dim=-1)  # as the backends split it
        scale = torch.ones((), dtype=torch.float32, device=pages.device)
        ops.reshape_and_cache_flash(keys, values, key_cache, value_cache, slots, "auto", scale, scale)

    return write


def scratch_like(pages: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scratch, its storage) of `blocks` kernel blocks: the pages' logical shape and physical axis order (the order
    of their strides), densely packed, so a probe costs a few blocks, not the layer's whole stride span."""
    shape = (blocks, *pages.shape[1:])
    order = sorted(range(4), key=lambda d: (-pages.stride(d), d))  # outermost axis first
    physical = torch.full([shape[d] for d in order], SENTINEL, dtype=pages.dtype, device=pages.device)
    inverse = [order.index(d) for d in range(4)]
    return physical.permute(inverse), physical


def index_codes(count: int, digit: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Digit `digit` (base 256) of 0 … count-1: exact integers in every float dtype vLLM pages."""
    return (torch.arange(count, dtype=torch.long) // 256**digit % 256).to(dtype).to(device)


def verify(layout: FlashLayout, pages: torch.Tensor, writer: CacheWriter | None) -> None:
    """Check `layout` against `writer` on `pages`' device (module docstring); UnsupportedLayout if they disagree,
    if the pages' dtype cannot carry exact codes, or if there is no writer to check against."""
    g, name = layout.geometry, layout.name
    if pages.dtype not in EXACT_DTYPES:
        raise UnsupportedLayout(f"{name}: pages of {pages.dtype} (a quantized KV cache) are not supported; "
                                "serve with --kv-cache-dtype auto")  # fmt: skip
    expected = (g.kv_heads, g.kernel, 2 * g.head_dim)
    if pages.dim() != 4 or tuple(pages.shape[1:]) != expected:
        raise UnsupportedLayout(f"{name}: vLLM registered pages of shape {tuple(pages.shape)}, the connector "
                                f"expects [blocks, {g.kv_heads}, {g.kernel}, {2 * g.head_dim}] "
                                "(kv_heads, block, 2·head_dim)")  # fmt: skip
    if writer is None:
        raise UnsupportedLayout(f"{name}: no cache writer of vLLM's to check the pages against")
    block_ids = [2, 0]  # out of order, the second one partly filled: 3 manager blocks of scratch
    rows = 2 * g.block - 3
    n_kernel = 3 * g.ratio
    slots = slot_mapping(g, block_ids, 0, rows, pages.device)
    per_plane = rows * g.kv_heads * g.head_dim
    for digit in range(max(1, math.ceil(math.log(2 * per_plane, 256)))):
        codes = index_codes(2 * per_plane, digit, pages.dtype, pages.device)
        keys = codes[:per_plane].reshape(rows, g.kv_heads, g.head_dim)
        values = codes[per_plane:].reshape(rows, g.kv_heads, g.head_dim)
        written, written_storage = scratch_like(pages, n_kernel)
        try:
            writer(keys, values, written, slots)
        except Exception as e:
            raise UnsupportedLayout(f"{name}: vLLM's cache writer could not run on {pages.device}: {e!r}") from e
        got_keys, got_values = layout.gather(written, block_ids, rows)
        for what, got, want in (("key", got_keys, keys), ("value", got_values, values)):
            _same(name, f"the connector read {what}s", got, want.reshape(rows, -1), g)
        scattered, scattered_storage = scratch_like(pages, n_kernel)
        layout.scatter(scattered, block_ids, 0, keys.reshape(rows, -1), values.reshape(rows, -1))
        if not torch.equal(scattered_storage, written_storage):
            where = (scattered_storage != written_storage).nonzero()[0].tolist()
            raise UnsupportedLayout(f"{name}: the connector's scatter wrote pages other than vLLM's cache writer does "
                                    f"(first differing element at physical index {where})")  # fmt: skip


def _same(name: str, what: str, got: torch.Tensor, want: torch.Tensor, g: Geometry) -> None:
    if torch.equal(got, want):
        return
    token, column = (got != want).nonzero()[0].tolist()
    raise UnsupportedLayout(
        f"{name}: {what} other than vLLM's cache writer wrote, first at token {token}, head {column // g.head_dim}, "
        f"dim {column % g.head_dim} ({got[token, column].item()} where {want[token, column].item()} was written)"
    )
