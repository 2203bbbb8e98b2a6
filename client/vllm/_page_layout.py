"""What every attention page layout is built on (_layouts.py chooses one per backend): a layer's cache `Geometry`,
the kernel blocks a manager block is cut into, `PageLayout` (reads and writes in the contract's logical order: rows =
token positions, kv_heads × head_dim columns), and `UnsupportedLayout`, the refusal. The backends' layouts
(_pages.py, _cpu_pages.py) subclass PageLayout; _mla_pages.py and _state_pages.py refuse with UnsupportedLayout.

Block ids are the scheduler's (manager) blocks of `Geometry.block` tokens. vLLM may cut each into
`block // kernel_block` kernel blocks (`kernel_block_size`), which is what the page tensor's first axis counts:
manager block b is kernel blocks b·r … b·r + r − 1. A layout learns the kernel block from the pages themselves.

`gather(pages, block_ids, rows, first=0)` reads tokens [first, rows) and `scatter(pages, block_ids, first, keys,
values)` writes tokens [first, first + n); neither touches a block wholly outside its tokens, so a sliding window's
nulled blocks (id 0) before `first` are never read or written. `gather` returns copies (the pages are free to be
reused at once); `scatter` writes only the rows it is given and leaves every other slot of the blocks as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""vLLM's own cache writer for one layer: (keys (n, kv_heads, head_dim), values, pages, slot_mapping (n,)); a slot is
kernel_block_id · kernel_block + offset, as vLLM's slot mappings count them."""


class UnsupportedLayout(RuntimeError):
    """An attention backend whose page layout the connector does not know, or whose pages disagree with what the
    connector would read; the message names the backend and what differed."""


class KernelBlocks:
    """A layer's blocks: `block` tokens a (manager) block, each cut into kernel blocks of `kernel_block` tokens (0:
    not cut), the page tensor's first axis. Mixed into each geometry (attention's, an MLA latent's)."""

    block: int
    kernel_block: int

    @property
    def kernel(self) -> int:
        """Tokens in one page of the page tensor's first axis."""
        return self.kernel_block or self.block

    @property
    def ratio(self) -> int:
        """Kernel blocks per manager block."""
        return self.block // self.kernel


@dataclass(frozen=True)
class Geometry(KernelBlocks):
    """One layer's cache, as the connector sees it: kv_heads × head_dim per token, `block` tokens a (manager) block,
    each cut into kernel blocks of `kernel_block` tokens (0: not cut)."""

    kv_heads: int
    head_dim: int
    block: int
    kernel_block: int = 0


def kernel_block_ids(geometry: KernelBlocks, block_ids: list[int]) -> list[int]:
    """The page tensor's blocks, in token order, that manager blocks `block_ids` are made of."""
    r = geometry.ratio
    return list(block_ids) if r == 1 else [b * r + j for b in block_ids for j in range(r)]


def token_places(
    geometry: KernelBlocks, block_ids: list[int], first: int, end: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel block, offset) of tokens [first, end) of the request whose blocks are `block_ids`, as index tensors on
    `device`: where in the page tensor each token is."""
    g = geometry
    ids = torch.tensor(kernel_block_ids(g, block_ids)[: math.ceil(end / g.kernel)], dtype=torch.long)
    tokens = torch.arange(first, end, dtype=torch.long)
    return ids[tokens // g.kernel].to(device), (tokens % g.kernel).to(device)


def slot_mapping(
    geometry: KernelBlocks, block_ids: list[int], first: int, end: int, device: torch.device
) -> torch.Tensor:
    """Tokens [first, end)'s slots, as vLLM's cache writers take them: kernel block · kernel_block + offset."""
    blocks, offsets = token_places(geometry, block_ids, first, end, device)
    return blocks * geometry.kernel + offsets


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
