"""CPU_ATTN's pages: `[kernel_blocks, kv_heads, kernel_block, 2·head_dim]`, and within a block and head the keys and
values in whatever order the kernel for the host's ISA keeps them (the `vec` kernels store K transposed). Learned
once at start-up by writing index-coded tokens through vLLM's own cache writer (`cpu_attn_reshape_and_cache`) and
reading where each landed: never a guess. The `vec` layout so learned is moved by strided copies
(CpuAttnVecLayout), any other element by element (PermutedLayout)."""

from __future__ import annotations

import math

import torch

from ._page_layout import CacheWriter, Geometry, PageLayout, UnsupportedLayout, slot_mapping, token_places


class PermutedLayout(PageLayout):
    """Pages of [blocks, ...] whose elements within a block are a fixed permutation of the logical
    (2, block, kv_heads, head_dim) order: `where[i]` is the page element holding logical element i."""

    def __init__(self, geometry: Geometry, where: torch.Tensor, name: str) -> None:
        super().__init__(geometry)
        self.where = where
        self.name = name

    def _shape(self) -> tuple[int, ...]:
        g = self.geometry
        return (-1, 2, g.kernel, g.kv_heads, g.head_dim)

    def _blocks(self, pages: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(ids, dtype=torch.long, device=pages.device)
        flat = pages.reshape(pages.shape[0], -1)[index]
        logical = flat[:, self.where.to(pages.device)].reshape(self._shape())
        return logical[:, 0], logical[:, 1]

    def _store(self, pages: torch.Tensor, ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        index = torch.tensor(ids, dtype=torch.long, device=pages.device)
        flat = pages.reshape(pages.shape[0], -1)
        blocks = flat[index]
        blocks[:, self.where.to(pages.device)] = torch.stack((keys, values), dim=1).reshape(len(ids), -1)
        flat[index] = blocks


class CpuAttnVecLayout(PageLayout):
    """CPU_ATTN's pages as its `vec` kernels keep them, [blocks, kv_heads, block, 2·head_dim]: within a block and
    head, the keys transposed ([head_dim, block]) and then the values ([block, head_dim]). Strided views, so a
    gather or scatter is a few block copies, not an element-by-element permutation."""

    def _views(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geometry
        flat = blocks.reshape(blocks.shape[0], g.kv_heads, 2 * g.kernel * g.head_dim)
        keys = flat[:, :, : g.kernel * g.head_dim].reshape(-1, g.kv_heads, g.head_dim, g.kernel).permute(0, 3, 1, 2)
        values = flat[:, :, g.kernel * g.head_dim :].reshape(-1, g.kv_heads, g.kernel, g.head_dim).permute(0, 2, 1, 3)
        return keys, values  # each (n, block, kv_heads, head_dim), views of `blocks`

    def _blocks(self, pages: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(ids, dtype=torch.long, device=pages.device)
        keys, values = self._views(pages[index])
        return keys.contiguous(), values.contiguous()

    def gather(
        self, pages: torch.Tensor, block_ids: list[int], rows: int, first: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass: tokens [first, rows) indexed by (kernel block, offset) straight out of the pages' own strided
        key and value views, each into a fresh (rows - first, kv_heads·head_dim) tensor, where the base class copies
        the blocks out, transposes them and cuts the rows (three passes; the producer's copy-out:
        docs/performance.md). Pages whose blocks cannot be viewed so take the base class's path."""
        g = self.geometry
        try:  # (view, not reshape: a reshape of pages that cannot be viewed so would copy the whole layer)
            keys_view, values_view = self._views(pages.view(pages.shape[0], g.kv_heads, 2 * g.kernel * g.head_dim))
        except RuntimeError:  # the pages' elements are not one contiguous run a block: no such view of them
            return super().gather(pages, block_ids, rows, first)
        blocks, offsets = token_places(g, block_ids, first, rows, pages.device)
        n = rows - first
        return keys_view[blocks, offsets].reshape(n, -1), values_view[blocks, offsets].reshape(n, -1)

    def scatter(
        self, pages: torch.Tensor, block_ids: list[int], first: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """In place, one pass: tokens [first, first + len(keys)) written by (kernel block, offset) straight into the
        pages' own strided key and value views, as `gather` reads them (0.7x the time of writing each kernel block's
        share through that block's views, 1,026 tokens of 8 heads of 128 in blocks of 32; the scatter was half of a
        decode's load time: docs/performance.md). Pages whose blocks cannot be viewed so (strides of another
        physical layout) take the base class's copying path."""
        end = first + keys.shape[0]
        if end == first:
            return
        g = self.geometry
        keys = keys.to(pages.dtype).reshape(-1, g.kv_heads, g.head_dim)
        values = values.to(pages.dtype).reshape(-1, g.kv_heads, g.head_dim)
        try:  # (view, not reshape: writes into a copy of pages that cannot be viewed so would be lost)
            keys_view, values_view = self._views(pages.view(pages.shape[0], g.kv_heads, 2 * g.kernel * g.head_dim))
        except RuntimeError:  # the pages' elements are not one contiguous run a block: no such view of them
            super().scatter(pages, block_ids, first, keys.reshape(len(keys), -1), values.reshape(len(values), -1))
            return
        blocks, offsets = token_places(g, block_ids, first, end, pages.device)
        keys_view[blocks, offsets] = keys
        values_view[blocks, offsets] = values

    def _store(self, pages: torch.Tensor, ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        index = torch.tensor(ids, dtype=torch.long, device=pages.device)
        blocks = torch.empty((len(ids), *pages.shape[1:]), dtype=pages.dtype, device=pages.device)
        key_view, value_view = self._views(blocks)
        key_view.copy_(keys)
        value_view.copy_(values)
        pages[index] = blocks


def check_slots(name: str, slots: torch.Tensor, pages: torch.Tensor, kernel: int) -> None:
    """Every slot within `pages` (kernel blocks of `kernel` tokens); else ValueError naming them, before vLLM's
    writer runs. vLLM 0.32's `cpu_attn_reshape_and_cache` checks no bounds (each ISA's `reshape_and_cache` writes at
    `slot / block_size` for any slot >= 0): a slot past the pages would be a silent write into whatever memory lies
    after them, and a crash, if any, later and elsewhere (docs/vllm.md#cpus)."""
    if slots.numel() == 0:
        return
    low, high, limit = int(slots.min()), int(slots.max()), pages.shape[0] * kernel
    if low < 0 or high >= limit:
        raise ValueError(f"{name}: slots {low} to {high} do not all lie in the layer's pages ({pages.shape[0]} blocks "
                         f"of {kernel} tokens: slots 0 to {limit - 1}); vLLM's cache writer checks no bounds, so "
                         "nothing is written")  # fmt: skip


class WrittenByVllm(PageLayout):
    """A learned CPU_ATTN layout whose scatter is vLLM's own cache writer for the layer (`do_kv_cache_update`, the
    op its forward writes keys and values with), by slot: what vLLM would have written, by construction, in 0.6x
    the time of the strided scatter (1,026 tokens of 8 heads of 128, blocks of 32, one thread). Its gather is the
    learned layout's. Its slots are checked to lie in the pages first (`check_slots`): vLLM's writer does not."""

    def __init__(self, learned: PageLayout, writer: CacheWriter) -> None:
        super().__init__(learned.geometry)
        self.learned = learned
        self.writer = writer
        self.name = learned.name

    def gather(
        self, pages: torch.Tensor, block_ids: list[int], rows: int, first: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.learned.gather(pages, block_ids, rows, first)

    def scatter(
        self, pages: torch.Tensor, block_ids: list[int], first: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        end = first + keys.shape[0]
        if end == first:
            return
        g = self.geometry
        slots = slot_mapping(g, block_ids, first, end, pages.device)
        check_slots(self.name, slots, pages, g.kernel)
        shape = (-1, g.kv_heads, g.head_dim)
        self.writer(keys.to(pages.dtype).reshape(shape).contiguous(), values.to(pages.dtype).reshape(shape).contiguous(),
                    pages, slots)  # fmt: skip


def cpu_attn_layout(geometry: Geometry, dtype: torch.dtype, isa: str, writer: CacheWriter | None = None) -> PageLayout:
    """CPU_ATTN's pages for `isa`, as learned by `learn_cpu_attn_pages`; where that is the `vec` kernels' layout,
    its strided form (CpuAttnVecLayout) is used, any other is moved element by element (PermutedLayout). With the
    layer's own `writer`, the scatter is vLLM's (WrittenByVllm)."""
    where = learn_cpu_attn_pages(geometry, dtype, isa)
    g = geometry
    learned: PageLayout = CpuAttnVecLayout(geometry)
    learned.name = f"CPU_ATTN ({isa})"
    probe = torch.arange(where.numel(), dtype=torch.long).reshape(1, g.kv_heads, g.kernel, 2 * g.head_dim)
    keys, values = learned.gather(probe, [0], g.kernel)  # (the probe's one block, read as the strided form reads)
    if not torch.equal(torch.cat((keys.reshape(-1), values.reshape(-1))), where):
        learned = PermutedLayout(geometry, where, f"CPU_ATTN ({isa})")
    return learned if writer is None else WrittenByVllm(learned, writer)


def learn_cpu_attn_pages(geometry: Geometry, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """Where CPU_ATTN's cache writer for `isa` puts each logical element of a block (PermutedLayout's `where`):
    index-coded keys and values (base-256 digits, exact in every float dtype) are written into one block through
    vLLM's own `cpu_attn_reshape_and_cache`, and each page element's logical index read back. UnsupportedLayout
    if the writer leaves any element unwritten or writes one twice."""
    from vllm import _custom_ops as ops

    g = geometry
    per_plane = g.kernel * g.kv_heads * g.head_dim
    total = 2 * per_plane
    logical = torch.arange(total, dtype=torch.long)
    found = torch.zeros(total, dtype=torch.long)
    slots = torch.arange(g.kernel, dtype=torch.long)
    for digit in range(max(1, math.ceil(math.log(total, 256)))):
        code = (logical // 256**digit % 256).to(dtype)
        keys = code[:per_plane].reshape(g.kernel, g.kv_heads, g.head_dim).contiguous()
        values = code[per_plane:].reshape(g.kernel, g.kv_heads, g.head_dim).contiguous()
        cache = torch.full((1, g.kv_heads, g.kernel, 2 * g.head_dim), -1.0, dtype=dtype)
        split = cache.view(1, g.kv_heads, g.kernel * 2, -1)
        key_cache, value_cache = split.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )
        read = cache.reshape(-1).to(torch.float32)
        if (read < 0).any():
            raise UnsupportedLayout(f"CPU_ATTN ({isa}): the cache writer left page elements unwritten")
        found += read.to(torch.long) * 256**digit
    if not torch.equal(torch.sort(found).values, logical):
        raise UnsupportedLayout(f"CPU_ATTN ({isa}): the cache writer's pages are not a permutation of the tokens")
    where = torch.empty(total, dtype=torch.long)
    where[found] = torch.arange(total, dtype=torch.long)
    return where
