"""MLA pages (DeepSeek-V2/V3, Kimi-K2): one latent per token, no key/value split.

vLLM 0.32 pages an MLA layer (`MLAAttentionSpec`: one KV head, head size kv_lora_rank + qk_rope_head_dim, no V) as
the logical view `[kernel_blocks, 1, kernel_block, kv_lora_rank + qk_rope_head_dim]`: per token `kv_c_normed` then
`k_pe` after RoPE (`concat_and_cache_mla` on GPUs, CPU_MLA's `do_kv_cache_update` on CPUs). The contract carries
the same row per position (`layers.{i}.self_attn.kv_latent`, rows × (kv_lora_rank + qk_rope_head_dim)), so a
LatentLayout moves rows and nothing else, across any two block sizes.

API for the worker (same block ids and rows as PageLayout, one tensor instead of two):

    mover = latent_mover(plan, backend, pages, vllm_config)  # at start-up: the layer's layout, learned and verified
    mover.gather(pages, blocks, rows)                       # {kv_latent name: (rows, width)}, a copy
    mover.scatter(pages, blocks, first, rows, tensors)      # writes tokens [first, rows); a local prefix is kept

    layout = latent_layout(backend, LatentGeometry(width, block), pages=pages, writer=mla_cache_writer(cfg, name))
    latent = layout.gather(pages, block_ids, rows)          # (rows, width), a copy (first=: from a later token)
    layout.scatter(pages, block_ids, first, latent_rows)    # writes tokens [first, first + len(latent_rows))

With `pages`, the layout is verified on their device through the layer's own `impl.do_kv_cache_update`, handed the
pages as vLLM's MLA layer binds them (`MLAAttention.bind_kv_cache`: `[B, 1, N, C]` squeezed to `[B, N, C]`, which
is also the view each backend's forward reads), as the attention pages are (_pages.verify): index-coded latents must
read back, and a scatter must leave the writer's bytes. Where the worker reaches the layer, the view it bound must
be exactly that squeeze of the registered pages. A quantized (fp8) latent cache is refused by name.

Backends claimed (each one's writer checked at page level against the installed vLLM, tests/test_vllm_mla_pages.py;
end to end on CPU_MLA, tests/test_vllm_mla.py):

    CPU_MLA               its own `do_kv_cache_update` (flat[slot, :rank] = kv_c_normed, flat[slot, rank:] = k_pe)
    FLASHMLA, TRITON_MLA  MLAAttentionImpl's `do_kv_cache_update`: `concat_and_cache_mla` on the bound view
                          (kernel block 64 for FLASHMLA, a multiple of 16 for TRITON_MLA)

Every other MLA backend (AMX_MLA's packed writer, CUTLASS_MLA, FLASHINFER_MLA, FLASH_ATTN_MLA, ROCm's, the sparse
ones) is refused by name: its pages were not checked against the installed vLLM's code where the tests run.

Tensor parallelism: the latent is the same on every TP rank (one KV head, not split by vLLM): the contract's
`kv_latent` carries no heads, so rank 0 alone pushes it and every decode rank pulls it whole (handoff_client
shards). Decode or prefill context parallelism shards it by token instead: refused at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._page_layout import KernelBlocks, UnsupportedLayout, slot_mapping, token_places
from ._pages import EXACT_DTYPES, index_codes, scratch_like

MLA_BACKENDS = ("CPU_MLA", "FLASHMLA", "TRITON_MLA")
"""The MLA backends whose pages the connector reads and writes: see the module docstring for why each."""

LatentWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""(kv_c_normed (n, kv_lora_rank), k_pe (n, qk_rope_head_dim), pages, slot_mapping (n,)) -> None."""


@dataclass(frozen=True)
class LatentGeometry(KernelBlocks):
    """One MLA layer's cache: `width` = kv_lora_rank + qk_rope_head_dim per token (`rank` of them the latent),
    `block` tokens a manager block, cut into kernel blocks of `kernel_block` (0: not cut)."""

    width: int
    block: int
    kernel_block: int = 0
    rank: int = 0  # kv_lora_rank: where k_pe starts (only the start-up check needs it)


class LatentLayout:
    """`[kernel_blocks, 1, kernel_block, width]` pages, any strides: token t of kernel block b is `[b, 0, t, :]`."""

    def __init__(self, geometry: LatentGeometry, name: str) -> None:
        self.geometry = geometry
        self.name = name

    def gather(self, pages: torch.Tensor, block_ids: list[int], rows: int, first: int = 0) -> torch.Tensor:
        """Latents of tokens [first, rows) of the request whose blocks are `block_ids`, as (rows - first, width):
        a copy; blocks wholly before `first` are not read."""
        blocks, offsets = token_places(self.geometry, block_ids, first, rows, pages.device)
        return pages[:, 0][blocks, offsets]

    def scatter(self, pages: torch.Tensor, block_ids: list[int], first: int, latent: torch.Tensor) -> None:
        """Write tokens [first, first + len(latent)) of the request whose blocks are `block_ids`; (n, width)."""
        if latent.shape[0] == 0:
            return
        blocks, offsets = token_places(self.geometry, block_ids, first, first + latent.shape[0], pages.device)
        pages[:, 0][blocks, offsets] = latent.to(pages.dtype)  # pages[:, 0] is a view: this writes the pages


def mla_cache_writer(vllm_config: Any, layer_name: str) -> LatentWriter | None:
    """The latent writer vLLM itself runs for MLA layer `layer_name`, or None when it is not at hand: the layer's
    impl's `do_kv_cache_update`, handed registered `[B, 1, N, C]` pages as the layer binds them (`[B, N, C]`)."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    impl = getattr(layer, "impl", None)
    if impl is None or not hasattr(impl, "do_kv_cache_update"):
        return None

    def write(kv_c: torch.Tensor, k_pe: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
        impl.do_kv_cache_update(kv_c, k_pe.unsqueeze(1), pages.squeeze(1), slots, layer.kv_cache_dtype,
                                layer._k_scale)  # fmt: skip

    return write


def check_bound_latent(pages: torch.Tensor, bound: Any, layer_name: str) -> None:
    """The view vLLM's MLA layer bound (`layer.kv_cache`, where the worker reaches it) must be the registered pages
    squeezed to `[B, N, C]`: the same storage, shape and strides the start-up check wrote through."""
    if not torch.is_tensor(bound) or bound.numel() == 0:
        return  # no layer at hand (or none bound yet): the check against vLLM's writer stands alone
    want = pages.squeeze(1)
    if (bound.data_ptr(), tuple(bound.shape), bound.stride()) != (want.data_ptr(), tuple(want.shape), want.stride()):
        raise UnsupportedLayout(f"{layer_name}: vLLM's MLA layer reads a cache of shape {tuple(bound.shape)}, strides "
                                f"{bound.stride()}, not the registered pages {tuple(pages.shape)} without their "
                                "head axis")  # fmt: skip


def latent_layout(
    backend: str, geometry: LatentGeometry, *, pages: torch.Tensor | None = None, writer: LatentWriter | None = None
) -> LatentLayout:
    """The latent layout of MLA backend `backend`; with `pages`, its kernel block read from them and the layout
    verified against `writer` on their device. UnsupportedLayout for a backend not listed, or any disagreement."""
    if backend not in MLA_BACKENDS:
        raise UnsupportedLayout(f"the MLA backend {backend} is not one whose pages handoff-broker's connector has "
                                f"checked against vLLM's own code (it carries {', '.join(MLA_BACKENDS)}); choose one "
                                "of those (--attention-backend) rather than risk a wrong copy")  # fmt: skip
    if pages is None:
        return LatentLayout(geometry, backend)
    expected = (1, geometry.width)
    if pages.dim() != 4 or (pages.shape[1], pages.shape[3]) != expected or geometry.block % pages.shape[2]:
        raise UnsupportedLayout(f"{backend}: vLLM registered MLA pages of shape {tuple(pages.shape)}, the connector "
                                f"expects [blocks, 1, a divisor of {geometry.block}, {geometry.width}]")  # fmt: skip
    kernel = int(pages.shape[2])
    geometry = LatentGeometry(geometry.width, geometry.block, 0 if kernel == geometry.block else kernel, geometry.rank)
    layout = LatentLayout(geometry, backend)
    verify_latent(layout, pages, writer)
    return layout


def verify_latent(layout: LatentLayout, pages: torch.Tensor, writer: LatentWriter | None) -> None:
    """Index-coded latents written by `writer` into scratch pages of the pages' physical order must read back
    through `layout`, and `layout.scatter` of them must leave the same bytes; else UnsupportedLayout."""
    g, name = layout.geometry, layout.name
    if pages.dtype not in EXACT_DTYPES:
        raise UnsupportedLayout(f"{name}: MLA pages of {pages.dtype} (a quantized latent cache) are not supported; "
                                "serve with --kv-cache-dtype auto")  # fmt: skip
    if writer is None:
        raise UnsupportedLayout(f"{name}: no cache writer of vLLM's to check the MLA pages against")
    if not 0 < g.rank < g.width:
        raise UnsupportedLayout(f"{name}: kv_lora_rank {g.rank} does not split a latent of {g.width}")
    block_ids, rows = [2, 0], 2 * g.block - 3
    r = g.ratio
    slots = slot_mapping(g, block_ids, 0, rows, pages.device)
    for digit in range(max(1, math.ceil(math.log(rows * g.width, 256)))):
        codes = index_codes(rows * g.width, digit, pages.dtype, pages.device).reshape(rows, g.width)
        written, written_storage = scratch_like(pages, 3 * r)
        try:
            writer(codes[:, : g.rank].contiguous(), codes[:, g.rank :].contiguous(), written, slots)
        except Exception as e:
            raise UnsupportedLayout(f"{name}: vLLM's MLA cache writer could not run on {pages.device}: {e!r}") from e
        got = layout.gather(written, block_ids, rows)
        if not torch.equal(got, codes):
            token, column = (got != codes).nonzero()[0].tolist()
            raise UnsupportedLayout(f"{name}: the connector read latents other than vLLM's cache writer wrote, first "
                                    f"at token {token}, column {column}")  # fmt: skip
        scattered, scattered_storage = scratch_like(pages, 3 * r)
        layout.scatter(scattered, block_ids, 0, codes)
        if not torch.equal(scattered_storage, written_storage):
            raise UnsupportedLayout(f"{name}: the connector's scatter wrote MLA pages other than vLLM's writer does")


class LatentMover:
    """An MLA layer's latent cache (`Kind.LATENT`): the prompt's rows [first, rows) of the one `kv_latent` tensor,
    through the layer's LatentLayout; the same interface as _movers' attention and state movers."""

    def __init__(self, plan: Any, layout: LatentLayout) -> None:
        self.plan, self.layout = plan, layout
        (self.name,) = (t.name for t in plan.tensors)

    def gather(self, pages: torch.Tensor, blocks: Sequence[int], rows: int) -> dict[str, torch.Tensor]:
        return {self.name: self.layout.gather(pages, list(blocks), rows)}

    def scatter(self, pages: torch.Tensor, blocks: Sequence[int], first: int, rows: int,
                tensors: Mapping[str, torch.Tensor]) -> None:  # fmt: skip
        latent = tensors[self.name]
        if first < rows:
            self.layout.scatter(pages, list(blocks), first, latent[first:rows].to(pages.device))


def check_latent_parallelism(vllm_config: Any, model: str) -> None:
    """Refuse context parallelism (DCP, PCP): it shards an MLA latent by token across ranks, where the contract and
    the connector hold it whole on every rank."""
    parallel = vllm_config.parallel_config
    for what in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (size := getattr(parallel, what, 1) or 1) > 1:
            raise UnsupportedLayout(f"{model}: {what} {size} shards the MLA latent by token across ranks; the "
                                    "handoff connector carries it whole on every rank: serve with context "
                                    "parallelism off")  # fmt: skip


def latent_mover(plan: Any, backend: str, pages: torch.Tensor, vllm_config: Any, model: str) -> LatentMover:
    """The mover of MLA layer `plan.layer` (its _groups.LayerPlan): its latent layout learned from the registered
    pages and verified through vLLM's own writer for it, the view the layer bound checked against them, context
    parallelism refused; UnsupportedLayout naming whatever differs."""
    check_latent_parallelism(vllm_config, model)
    (latent,) = plan.tensors
    rank = int(getattr(vllm_config.model_config.hf_text_config, "kv_lora_rank", 0) or 0)  # where k_pe starts
    geometry = LatentGeometry(latent.cols, plan.block_size, rank=rank)
    layout = latent_layout(backend, geometry, pages=pages, writer=mla_cache_writer(vllm_config, plan.layer))
    layer = vllm_config.compilation_config.static_forward_context.get(plan.layer)
    check_bound_latent(pages, getattr(layer, "kv_cache", None), plan.layer)
    return LatentMover(plan, layout)
