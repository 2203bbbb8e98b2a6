"""How vLLM's recurrent-state pages hold each head's S_h (`_state_pages.Orientation`), learned from the installed vLLM.

    learn_orientation(mamba_type, state_dtype) -> Orientation          # cached: once per (kind, dtype) a process

Where the orientation comes from:

    GPU builds (and any kind not probed)   vLLM's own MambaStateShapeCalculator, asked with distinct sizes
                                           (`learn_transposed`): gated-delta-net (v_dim, k_dim) -> TRANSPOSED,
                                           Mamba2 (head_dim, state) -> AS_IS
    CPU build, gated-delta-net             one decode step of vLLM's own kernel (`fused_sigmoid_gating_delta_rule_
                                           update_cpu`) through the view its CPU path takes of the page
                                           (`_ssm_state_view`): vLLM 0.32 gives REINTERPRETED
    CPU build, Mamba2                      one token through each of vLLM's own CPU Mamba2 kernels, the prefill's
                                           (`mamba_chunk_scan_combined_varlen`, which dispatches to the CPU scan) and
                                           the decode's (the SSU backend vLLM runs on CPU, `CPUSSUBackend`), in the
                                           layer's state dtype: both must hold S_h as the calculator shapes it
                                           (AS_IS); anything else is refused

Every probe starts from a zero state with no decay, so one token writes a known outer product per head (gated delta:
S_h = k v^T, Mamba2: S_h = dt · x B^T), with sizes that differ on every axis, so a wrong orientation cannot pass.
The result depends only on the layer's kind and state dtype (the probe uses its own sizes), so it is computed once
per distinct (kind, dtype) and every layer of that kind shares it: start-up runs each probe once, not once a layer.
Anything the probe cannot read as one of the orientations the connector converts is refused with UnsupportedLayout.
"""

from __future__ import annotations

import functools
import types

import torch

from ._layouts import UnsupportedLayout
from ._state_pages import Orientation

GDN_KINDS = ("GDN_ATTN", "GDN_ATTENTION", "GATED_DELTA_NET")
MAMBA2_KINDS = ("MAMBA2",)


def learn_transposed(mamba_type: str) -> bool:
    """Whether vLLM's recurrent state for `mamba_type` ("gdn_attention"/"GDN_ATTN", "mamba2"/"MAMBA2") holds each
    head's S_h transposed against the contract, read off vLLM's own MambaStateShapeCalculator with distinct sizes."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Shapes

    kind = mamba_type.upper()
    if kind in GDN_KINDS:  # S_h is (k_dim, v_dim): k_dim 5, v_dim 7
        _, state = Shapes.gated_delta_net_state_shape(1, 1, 2, 5, 7, 4)
        rows, cols = 5, 7
    elif kind in MAMBA2_KINDS:  # S_h is (head_dim, state): head_dim 5, state 7
        _, state = Shapes.mamba2_state_shape(1, 10, 1, 2, 5, 7, 4)
        rows, cols = 5, 7
    else:
        raise UnsupportedLayout(f"vLLM's {mamba_type} state pages are not ones handoff-broker's connector converts")
    if tuple(state[1:]) == (cols, rows):
        return True
    if tuple(state[1:]) == (rows, cols):
        return False
    raise UnsupportedLayout(f"vLLM's {mamba_type} recurrent state {tuple(state)} is neither S_h nor its transpose")


def orientation_of(held: torch.Tensor, s_h: torch.Tensor) -> Orientation | None:
    """Which orientation a page's state `held` ((heads, a, b), as vLLM's calculator shapes it) holds the per-head
    states `s_h` ((heads, rows, cols), transformers' orientation) in, to bf16's precision; None if none."""
    heads, rows, cols = s_h.shape
    readings = [(Orientation.AS_IS, held), (Orientation.TRANSPOSED, held.transpose(1, 2))]
    if held.shape[1:] == (cols, rows):
        readings.append((Orientation.REINTERPRETED, held.reshape(heads, rows, cols)))
    for orientation, reading in readings:
        if reading.shape == s_h.shape and torch.allclose(reading.float(), s_h.float(), rtol=0.02, atol=0.02):
            return orientation
    return None


def _gdn_kernel_orientation() -> Orientation:
    """How vLLM's CPU build's gated-delta-net kernels hold S_h in a page vLLM allocates as (heads, v_dim, k_dim):
    one decode step of its own kernel on a zero state, through the view its CPU path takes of the page, with beta 1
    and no decay, writes S_h = k v^T (transformers' delta rule); the page then holds that either as vLLM's shape says
    (transposed) or row-major in its memory (reinterpreted). Anything else: UnsupportedLayout."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _ssm_state_view

    heads, k_dim, v_dim = 2, 16, 32  # distinct sizes: a wrong orientation cannot pass
    page = torch.zeros(2, heads, v_dim, k_dim, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 1, heads, d, generator=g).to(torch.bfloat16) for d in (k_dim, v_dim))
    q = torch.zeros(1, 1, heads, k_dim, dtype=torch.bfloat16)
    no_decay, beta_one = torch.full((1, heads), -30.0), torch.full((1, heads), 30.0)
    zero = torch.zeros(heads, dtype=torch.bfloat16)
    view = _ssm_state_view(types.SimpleNamespace(kv_cache=(None, page)))
    ops.fused_sigmoid_gating_delta_rule_update_cpu(
        zero, zero, q, k, v, no_decay.to(torch.bfloat16), beta_one.to(torch.bfloat16), view,
        torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), False)  # fmt: skip
    written = k[0, 0].float()[:, :, None] * v[0, 0].float()[:, None, :]  # S_h = k v^T, (heads, k_dim, v_dim)
    orientation = orientation_of(page[1], written)
    if orientation not in (Orientation.TRANSPOSED, Orientation.REINTERPRETED):
        raise UnsupportedLayout("vLLM's CPU gated-delta-net kernel wrote a state that is neither S_h nor its transpose")
    return orientation


def mamba2_kernel_states(state_dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(S_h = dt · x B^T per head, (heads, head_dim, state); what each of vLLM's CPU Mamba2 kernels leaves in a
    `state_dtype` state shaped as its calculator shapes it, (heads, head_dim, state), after one token from a zero
    state with no decay (A = 0) and dt = 1): "prefill" as the mixer stores the scan's final state, "decode" as the
    SSU backend updates the page in place."""
    from vllm.config.mamba import MambaConfig
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
    from vllm.model_executor.layers.mamba.ops.ssu_dispatch import CPUSSUBackend

    heads, head_dim, state, act = 2, 5, 7, torch.bfloat16  # distinct sizes: a wrong orientation cannot pass
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, heads, head_dim, generator=g).to(act)
    b = torch.randn(1, 1, state, generator=g).to(act)  # one group
    c = torch.zeros(1, 1, state, dtype=act)
    written = x[0].float()[:, :, None] * b[0, 0].float()[None, None, :]
    one = torch.tensor([0, 1], dtype=torch.int32)
    scanned = mamba_chunk_scan_combined_varlen(
        x, torch.ones(1, heads, dtype=act), torch.zeros(heads), b, c, 256, cu_seqlens=one, cu_chunk_seqlens=one,
        last_chunk_indices=torch.tensor([0]), seq_idx=torch.tensor([0], dtype=torch.int32),
        out=torch.empty(1, heads, head_dim, dtype=act), state_dtype=state_dtype)  # fmt: skip
    prefill = torch.zeros(2, heads, head_dim, state, dtype=state_dtype)
    prefill[1] = scanned[0]  # the mixer: ssm_state[state_indices_tensor_p] = final_states
    decode = torch.zeros(2, heads, head_dim, state, dtype=state_dtype)
    slot = torch.tensor([1], dtype=torch.int32)
    CPUSSUBackend(MambaConfig())(
        decode, x, torch.ones(1, heads, head_dim, dtype=act), torch.zeros(heads, head_dim, state), b, c,
        torch.zeros(heads, head_dim), torch.zeros(heads, head_dim), state_batch_indices=slot,
        dst_state_batch_indices=slot, out=torch.empty(1, heads, head_dim, dtype=act))  # fmt: skip
    return written, {"prefill": prefill[1], "decode": decode[1]}


def _mamba2_kernel_orientation(state_dtype: torch.dtype) -> Orientation:
    """AS_IS if both of vLLM's CPU Mamba2 kernels hold S_h as its calculator shapes it; else UnsupportedLayout
    naming the kernel (a Mamba2 page's shape is S_h's own, so no other orientation is one the connector converts)."""
    try:
        written, held = mamba2_kernel_states(state_dtype)
    except (RuntimeError, TypeError, ValueError) as e:  # the engine could not run such a layer either
        raise UnsupportedLayout(f"vLLM's CPU Mamba2 kernels did not run on a {state_dtype} state: {e}") from e
    for kernel, state in held.items():
        if (found := orientation_of(state, written)) is not Orientation.AS_IS:
            how = "in no orientation the connector knows" if found is None else found.value
            raise UnsupportedLayout(f"vLLM's CPU Mamba2 {kernel} kernel holds S_h (head_dim, state) {how}, not as "
                                    "its calculator's (heads, head_dim, state) shape says: not converted")  # fmt: skip
    return Orientation.AS_IS


@functools.cache
def learn_orientation(mamba_type: str, state_dtype: torch.dtype = torch.bfloat16) -> Orientation:
    """How vLLM's pages of `mamba_type` with a `state_dtype` recurrent state hold each head's S_h (module
    docstring): probed through vLLM's own kernels on its CPU build, otherwise vLLM's calculator says. Cached per
    (kind, dtype): every layer of a kind shares the answer."""
    from vllm.platforms import current_platform

    transposed = learn_transposed(mamba_type)
    if not current_platform.is_cpu():
        return Orientation.TRANSPOSED if transposed else Orientation.AS_IS
    if mamba_type.upper() in MAMBA2_KINDS:
        return _mamba2_kernel_orientation(state_dtype)
    return _gdn_kernel_orientation()
