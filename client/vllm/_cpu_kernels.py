"""vLLM's CPU kernels, called only where vLLM calls them: a load's writes into CPU pages are made on vLLM's own thread,
the attention kernel's ISA is the one vLLM gave the layer, and AMX, where that kernel uses it, is granted at start-up.

Why (issue 39, item 7): on CPUs with AMX, bfloat16 Gemma-3 decode instances died of SIGILL in vLLM's attention kernel
(`cpu_attention_with_kv_cache`) on their first step after loads, where the same engine computing the prompt itself
(a prefix-cache hit, a chunked N - 1 + 1 prefill) did not. What a load did differently: its layers were written by
vLLM's own cache writer (the layer's `do_kv_cache_update`: `cpu_attn_reshape_and_cache` for the layer's ISA, an
OpenMP parallel region; CPU_MLA's writer) on the connector's pull threads, beside the engine's steps. vLLM writes
pages only from its engine thread, whose OpenMP team it binds to its cores at start-up (VLLM_CPU_OMP_THREADS_BIND),
and its kernels keep per-thread state (the OpenMP team; AMX's tile configuration, on a CPU whose AMX state Linux
grants a process on request, arch_prctl ARCH_REQ_XCOMP_PERM). So none of vLLM's kernels is called from a connector
thread any more (`PageWrites`): a pulled layer waits, as tensors, for vLLM's next `get_finished` call on its own
thread (every step), which writes every layer pulled so far before it reports any load, so a load is never reported
before its last write. GPU pages are written by kernels on the device, ordered by the connector's CUDA stream: on
the pull thread, as before. Where vLLM runs its AMX attention kernel, the connector asks Linux for AMX state at
start-up, on the engine thread (`require_amx`: torch's `_init_amx`, the whole process's once granted), and refuses
to start, naming the CPU feature, where Linux will not grant it.

Verified here (no AMX on this machine): the writes' thread and order, vLLM's ISA decision both ways, Linux's
refusal. Not verified: that these keep a bfloat16 Gemma-3 decode instance alive on an AMX CPU.
"""

from __future__ import annotations

import logging
import threading
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
    """Where vLLM's attention runs an AMX kernel (`isas`), AMX state granted to this process now, from the engine's
    thread at start-up; RuntimeError naming the CPU feature where Linux will not grant it."""
    if not any(isa in AMX_ISAS for isa in isas):
        return
    import torch

    if not torch.cpu._init_amx():  # arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA): the whole process's, once granted
        raise RuntimeError(
            f"{model}: vLLM runs its AMX attention kernel here (this CPU has AMX tiles, amx_tile/amx_bf16, and the "
            "pages are bfloat16 in blocks of 32), but Linux did not grant this process AMX state (arch_prctl "
            "ARCH_REQ_XCOMP_PERM; Linux 5.16 or later grants it): every AMX instruction would die of SIGILL. Run "
            "on a kernel that grants it, or with a block size that is not a multiple of 32 or float32 pages (vLLM's "
            "AVX-512 kernels)"
        )


class PageWrites:
    """Layers pulled into CPU pages, waiting for vLLM's thread to write them (module docstring), in pull order.

    Invariant: a load's writes are all added before its pull ends (its thread adds them, then ends it), and
    `settle` takes the ended loads first and then makes every write waiting, so no load is reported before its
    last write, and no write of a reported load is made after (vLLM recomputes a failed one's blocks)."""

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
        for request_id, write in waiting:
            if request_id in self._broken or request_id in failed:
                continue  # (a failed load's pages are recomputed: no use writing them)
            try:
                write()
            except Exception:  # the load fails, the engine goes on
                logger.exception("a pulled layer of request %s was not written into its pages", request_id)
                self._broken.add(request_id)
        broken = self._broken & received
        self._broken -= received
        return received, failed | broken
