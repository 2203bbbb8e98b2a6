"""vLLM's CPU kernels, called only where vLLM calls them, and AMX granted before any of them runs: a load's writes
into CPU pages are made on vLLM's own thread, the attention kernel's ISA is the one vLLM gave the layer, and on a CPU
with AMX tiles the process asks Linux for AMX state at start-up.

Why (issue 39, item 7; docs/vllm.md#cpus, with references into vLLM's source): on CPUs with AMX, bfloat16 Gemma-3
decode instances died of SIGILL in vLLM's attention kernel (`cpu_attention_with_kv_cache`) on their first step after
three loads, where an engine that had computed a prompt itself did not. Read from vLLM 0.32's source and wheel:
- bfloat16 pages in blocks of a multiple of 32 run the `amx` kernel (`cpu_attn._get_attn_isa`); a Gemma-3 asked for
  blocks of 16 gets 32 (its sliding-window spec takes CPU_ATTN's smallest kernel block, and the groups are unified),
  so both of the report's runs were `amx`;
- AMX tile instructions fault (#NM, which Linux turns into SIGILL) in a process that has not asked Linux for AMX
  state (arch_prctl ARCH_REQ_XCOMP_PERM). vLLM never asks: in its `_C` build the one such call is oneDNN's
  `amx::is_available()`, made when oneDNN first builds a brgemm or matmul, which vLLM's bfloat16 linears do only for
  more than 4 tokens (sgl-kernels' `can_use_brgemm<BFloat16>(M)`: M > 4; fewer take an AVX-512 BF16 path);
- an eager CPU engine (`enforce_eager`, an explicit KV-cache size) runs no forward at start-up, and CPU_ATTN's
  warm-up skips the kernel (`attn_metadata is None`).
So a decode instance's first forward, a decode of 3 loaded requests, reached the AMX attention kernel before anything
had asked Linux; a plain engine's first forward, a prefill, had oneDNN ask first. Nothing in the window, the pages
or the threads is needed for this; float32 never runs AMX. The connector now asks at start-up wherever the CPU has
AMX tiles (`require_amx`; Linux grants it to the whole process, once): the attention kernel and vLLM's other AMX
kernels (bfloat16 fused MoE, gated delta) then run wherever they are first reached; where Linux will not grant it and
the attention kernel is `amx`, the connector refuses to start, naming the feature.

The writes run on vLLM's thread (`PageWrites`) as vLLM's own do (a pulled layer waits, as tensors, for vLLM's next
`get_finished` call, which writes every layer pulled so far before it reports any load): not needed for AMX (the
AMX kernel sets its tile configuration per call and thread, and the cache writer uses no tile instruction) but
keeping vLLM's OpenMP kernels on the thread vLLM bound to its cores. GPU pages are written by kernels on the
device, ordered by the connector's CUDA stream: on the pull thread.

Verified here (no AMX on this machine): the writes' thread and order, vLLM's ISA decision both ways, the request at
start-up wherever torch reports AMX tiles, Linux's refusal. Not verified: an AMX machine running these instances.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ._page_layout import Geometry

logger = logging.getLogger(__name__)

AMX_ISAS = ("amx", "amx_fp8")
"""CPU_ATTN ISAs (vLLM 0.32's `_get_attn_isa`) whose kernels run AMX tile instructions."""


def attention_isa(vllm_config: Any, layer_name: str, backend: str, geometry: Geometry) -> str | None:
    """The ISA of CPU_ATTN's kernel for the layer: the one vLLM's metadata builder gave the layer (`layer.isa`), which
    its forward and cache writer use; where the layer is not at hand, `_get_attn_isa` as the builder asks it. None
    for any other backend."""
    if backend != "CPU_ATTN":
        return None
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    if isinstance(isa := getattr(layer, "isa", None), str):
        return isa
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache_dtype = vllm_config.cache_config.cache_dtype
    return _get_attn_isa(vllm_config.model_config.dtype, geometry.block, geometry.head_dim, cache_dtype)


def require_amx(isas: Iterable[str | None], model: str) -> None:
    """Where the CPU has AMX tiles, or vLLM's attention runs an AMX kernel (`isas`), AMX state asked of Linux for this
    process now, from the engine's thread at start-up (torch's `_init_amx`: arch_prctl ARCH_REQ_XCOMP_PERM, the whole
    process's once granted): vLLM's AMX kernels never ask (module docstring). RuntimeError naming the CPU feature
    where the attention kernel is AMX and Linux will not grant it; a warning where only vLLM's other AMX kernels may
    run."""
    import torch

    amx_attention = any(isa in AMX_ISAS for isa in isas)
    if not amx_attention and not torch.cpu._is_amx_tile_supported():
        return
    if torch.cpu._init_amx():  # granted (or already): every AMX kernel may run on any thread of the process
        return
    if amx_attention:
        raise RuntimeError(
            f"{model}: vLLM runs its AMX attention kernel here (this CPU has AMX tiles, amx_tile/amx_bf16, and the "
            "pages are bfloat16 in blocks of 32), but Linux did not grant this process AMX state (arch_prctl "
            "ARCH_REQ_XCOMP_PERM; Linux 5.16 or later grants it): every AMX instruction would die of SIGILL. Run "
            "on a kernel that grants it, or serve the model in float32 (--dtype float32: vLLM's AVX-512 kernels; "
            "CPU_ATTN takes no block size other than multiples of 32, so the block size cannot avoid it)"
        )
    logger.warning("%s: this CPU has AMX tiles (amx_tile) but Linux did not grant this process AMX state (arch_prctl "
                   "ARCH_REQ_XCOMP_PERM): vLLM's attention here is not its AMX kernel, but its other AMX kernels "
                   "(bfloat16 fused MoE, gated delta) would die of SIGILL", model)  # fmt: skip


class PageWrites:
    """Layers pulled into CPU pages, waiting for vLLM's thread to write them (module docstring), in pull order.

    Invariant: a load's writes are all added before its pull ends (its thread adds them, then ends it), and
    `settle` takes the ended loads first and then makes every write waiting, so no load is reported before its
    last write, and no write of a reported load is made after (vLLM recomputes a failed one's blocks)."""

    seconds = 0.0
    """The time vLLM's thread has spent in these writes so far, in this process (every instance's: the class's, so
    that benchmarks/vllm_engines.py reads it beside a running engine); `written`, the layers written."""
    written = 0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[tuple[str, Callable[[], None]]] = []
        self._broken: set[str] = set()  # requests a write of which failed, until their load is reported

    def add(self, request_id: str, write: Callable[[], None]) -> None:
        """On a pull thread: a layer's write for the request, made by the engine thread's next `settle`."""
        with self._lock:
            self._waiting.append((request_id, write))

    def settle(self, received: set[str], failed: set[str]) -> tuple[set[str], set[str]]:
        """On vLLM's thread, for the loads about to be reported (`received`, of them `failed`): every write waiting,
        made; (received, failed), the loads any of whose writes failed among the failed (vLLM recomputes them)."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        started = time.perf_counter()
        for request_id, write in waiting:
            if request_id in self._broken or request_id in failed:
                continue  # (a failed load's pages are recomputed: no use writing them)
            try:
                write()
                PageWrites.written += 1
            except Exception:  # the load fails, the engine goes on
                logger.exception("a pulled layer of request %s was not written into its pages", request_id)
                self._broken.add(request_id)
        if waiting:
            PageWrites.seconds += time.perf_counter() - started
        broken = self._broken & received
        self._broken -= received
        return received, failed | broken
