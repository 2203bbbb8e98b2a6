"""Page layouts: where an attention backend keeps each token's key and value, read and written in the contract's
logical order (rows = token positions, kv_heads × head_dim columns).

This is the design card's promise kept at vLLM's edge: whatever pages a backend lays the cache out in, the
connector reads and writes the logical order, so a prefill engine with block size 128 and a decode engine with block
size 32 — or a CPU engine and a GPU one — meet. Each layout knows one backend's page tensor for one layer:

    CPU_ATTN                [blocks, kv_heads, block, 2·head_dim]: within a block and head, keys then values, in
                            whatever order the kernel's ISA keeps them (the "vec" kernels store K transposed);
                            learned once at start-up by writing index-coded tokens through vLLM's own cache writer
                            (`cpu_attn_reshape_and_cache`) and reading where each landed: never a guess. The
                            `vec` layout so learned is moved by strided copies, any other element by element
    FLASH_ATTN              [2, blocks, block, kv_heads, head_dim]     (key and value planes first)
    FLASHINFER, TRITON_ATTN [blocks, 2, block, kv_heads, head_dim]

A backend not listed is refused at start-up with its name (`UnsupportedLayout`): a silent wrong copy would give
garbage tokens. `gather` returns copies (the pages are free to be reused at once); `scatter` writes only the rows
it is given and leaves every other slot of the blocks as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


class UnsupportedLayout(RuntimeError):
    """An attention backend whose page layout the connector does not know; the message names it."""


@dataclass(frozen=True)
class Geometry:
    """One layer's cache, as the connector sees it: kv_heads × head_dim per token, `block` tokens a page."""

    kv_heads: int
    head_dim: int
    block: int


class PageLayout:
    """One backend's pages for one layer, read and written in logical order."""

    name: str = ""

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry

    def gather(self, pages: torch.Tensor, block_ids: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of tokens [0, rows) of the request whose blocks are `block_ids`, as (rows, heads·dim)."""
        keys, values = self._blocks(pages, block_ids[: self._blocks_for(rows)])
        width = self.geometry.kv_heads * self.geometry.head_dim
        return keys.reshape(-1, width)[:rows].clone(), values.reshape(-1, width)[:rows].clone()

    def scatter(
        self, pages: torch.Tensor, block_ids: list[int], first: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write tokens [first, first + len(keys)) of the request whose blocks are `block_ids`; (n, heads·dim)."""
        end = first + keys.shape[0]
        if end == first:
            return
        g = self.geometry
        ids = block_ids[first // g.block : self._blocks_for(end)]
        old_keys, old_values = self._blocks(pages, ids)
        base = (first // g.block) * g.block
        width = g.kv_heads * g.head_dim
        flat_keys, flat_values = old_keys.reshape(-1, width), old_values.reshape(-1, width)
        flat_keys[first - base : end - base] = keys.to(pages.dtype)
        flat_values[first - base : end - base] = values.to(pages.dtype)
        self._store(pages, ids, flat_keys.view(old_keys.shape), flat_values.view(old_values.shape))

    def _blocks_for(self, rows: int) -> int:
        return math.ceil(rows / self.geometry.block)

    def _blocks(self, pages: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of keys and values of blocks `ids`, as (n, block, kv_heads, head_dim)."""
        raise NotImplementedError

    def _store(self, pages: torch.Tensor, ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError


class FlashAttnLayout(PageLayout):
    """[2, blocks, block, kv_heads, head_dim]."""

    name = "FLASH_ATTN"

    def _blocks(self, pages: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(ids, dtype=torch.long, device=pages.device)
        return pages[0, index].clone(), pages[1, index].clone()

    def _store(self, pages: torch.Tensor, ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        index = torch.tensor(ids, dtype=torch.long, device=pages.device)
        pages[0, index] = keys
        pages[1, index] = values


class BlockMajorLayout(PageLayout):
    """[blocks, 2, block, kv_heads, head_dim] (FlashInfer's and Triton's NHD pages)."""

    name = "FLASHINFER"

    def _blocks(self, pages: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(ids, dtype=torch.long, device=pages.device)
        chosen = pages[index]
        return chosen[:, 0].clone(), chosen[:, 1].clone()

    def _store(self, pages: torch.Tensor, ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        index = torch.tensor(ids, dtype=torch.long, device=pages.device)
        pages[index] = torch.stack((keys, values), dim=1)


class PermutedLayout(PageLayout):
    """Pages of [blocks, ...] whose elements within a block are a fixed permutation of the logical
    (2, block, kv_heads, head_dim) order: `where[i]` is the page element holding logical element i."""

    def __init__(self, geometry: Geometry, where: torch.Tensor, name: str) -> None:
        super().__init__(geometry)
        self.where = where
        self.name = name

    def _shape(self) -> tuple[int, ...]:
        g = self.geometry
        return (-1, 2, g.block, g.kv_heads, g.head_dim)

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
        flat = blocks.reshape(blocks.shape[0], g.kv_heads, 2 * g.block * g.head_dim)
        keys = flat[:, :, : g.block * g.head_dim].reshape(-1, g.kv_heads, g.head_dim, g.block).permute(0, 3, 1, 2)
        values = flat[:, :, g.block * g.head_dim :].reshape(-1, g.kv_heads, g.block, g.head_dim).permute(0, 2, 1, 3)
        return keys, values  # each (n, block, kv_heads, head_dim), views of `blocks`

    def _blocks(self, pages: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(ids, dtype=torch.long, device=pages.device)
        keys, values = self._views(pages[index])
        return keys.contiguous(), values.contiguous()

    def _store(self, pages: torch.Tensor, ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        index = torch.tensor(ids, dtype=torch.long, device=pages.device)
        blocks = torch.empty((len(ids), *pages.shape[1:]), dtype=pages.dtype, device=pages.device)
        key_view, value_view = self._views(blocks)
        key_view.copy_(keys)
        value_view.copy_(values)
        pages[index] = blocks


def cpu_attn_layout(geometry: Geometry, dtype: torch.dtype, isa: str) -> PageLayout:
    """CPU_ATTN's pages for `isa`, as learned by `learn_cpu_attn_pages`; where that is the `vec` kernels' layout,
    its strided form (CpuAttnVecLayout) is used, any other is moved element by element (PermutedLayout)."""
    where = learn_cpu_attn_pages(geometry, dtype, isa)
    g = geometry
    strided = CpuAttnVecLayout(geometry)
    strided.name = f"CPU_ATTN ({isa})"
    probe = torch.arange(where.numel(), dtype=torch.long).reshape(1, g.kv_heads, g.block, 2 * g.head_dim)
    keys, values = strided._blocks(probe, [0])
    if torch.equal(torch.stack((keys, values), dim=1).reshape(-1), where):
        return strided
    return PermutedLayout(geometry, where, f"CPU_ATTN ({isa})")


def learn_cpu_attn_pages(geometry: Geometry, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """Where CPU_ATTN's cache writer for `isa` puts each logical element of a block (PermutedLayout's `where`):
    index-coded keys and values (base-256 digits, exact in every float dtype) are written into one block through
    vLLM's own `cpu_attn_reshape_and_cache`, and each page element's logical index read back. UnsupportedLayout
    if the writer leaves any element unwritten or writes one twice."""
    from vllm import _custom_ops as ops

    g = geometry
    per_plane = g.block * g.kv_heads * g.head_dim
    total = 2 * per_plane
    logical = torch.arange(total, dtype=torch.long)
    found = torch.zeros(total, dtype=torch.long)
    slots = torch.arange(g.block, dtype=torch.long)
    for digit in range(max(1, math.ceil(math.log(total, 256)))):
        code = (logical // 256**digit % 256).to(dtype)
        keys = code[:per_plane].reshape(g.block, g.kv_heads, g.head_dim).contiguous()
        values = code[per_plane:].reshape(g.block, g.kv_heads, g.head_dim).contiguous()
        cache = torch.full((1, g.kv_heads, g.block, 2 * g.head_dim), -1.0, dtype=dtype)
        split = cache.view(1, g.kv_heads, g.block * 2, -1)
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


def layout_for(backend: str, geometry: Geometry, dtype: torch.dtype, isa: str | None = None) -> PageLayout:
    """The layout of `backend`'s pages (the name vLLM's attention backend reports); UnsupportedLayout if unknown."""
    if backend == "CPU_ATTN":
        return cpu_attn_layout(geometry, dtype, isa or "vec")
    if backend == "FLASH_ATTN":
        return FlashAttnLayout(geometry)
    if backend in ("FLASHINFER", "TRITON_ATTN"):
        layout = BlockMajorLayout(geometry)
        layout.name = backend
        return layout
    raise UnsupportedLayout(
        f"the attention backend {backend} lays its KV pages out in a way handoff-broker's connector does not know "
        f"(it knows {', '.join(BACKENDS)}); choose one of those (VLLM_ATTENTION_BACKEND) rather than risk a wrong copy"
    )
