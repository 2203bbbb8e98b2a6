"""A transformers cache (5.x: `DynamicCache(config=...)`) <-> the contract's tensors: this adapter's layout knowledge
and nothing else (the rules every adapter obeys are handoff_client._handoff_rules).

What transformers keeps, layer i of `cache.layers` being the contract's layer i (read from transformers 5.19's
cache_utils.py; the same in 5.25):

    attention     DynamicLayer: keys and values [batch, kv_heads, tokens, head_dim], post-RoPE, oldest first.
                  The contract's k_cache/v_cache rows are positions, columns head-major: row p = keys[0, :, p, :]
                  flattened. A window (DynamicSlidingWindowLayer) keeps the last window - 1 tokens oldest first and
                  counts every token in `cumulative_length`; the contract's ring holds position p at row p mod R
                  (`window_rows` gives the roll between the two).
    conv          LinearAttentionLayer.conv_states[0]: [batch, conv_dim, K], the last K inputs; the contract keeps
                  the last K - 1 (vLLM's), in time order, channels cut into its conv tensors in contract order
                  ([Q | K | V] or [x | B | C]). Loading pads the first column with zeros: transformers' conv over K
                  columns uses column 0 only for an output it throws away.
    recurrent     LinearAttentionLayer.recurrent_states[0]: [batch, heads, a, b] (gated-delta S_h (k_dim, v_dim),
                  Mamba2 (head_dim, state)), float32 even for a bf16 model; the contract's memory/ssm[a, h·b + j] =
                  S_h[a, j].

A hybrid layer holding both (Falcon-H1: LinearAttentionAndFullAttentionLayer) is read and written both ways. Batch 1.
Anything else the contract carries (an MLA latent, a quantization scale) is refused by name (`refusal`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._handoff_rules import window_rows
from ..protocol.contract import Carried, Contract

CONV = ("conv_q", "conv_k", "conv_v", "conv_x", "conv_b", "conv_c")
RECURRENT = ("memory", "ssm")
ATTENTION = ("k_cache", "v_cache")


def kind(carried: Carried) -> str:
    """attention, conv or recurrent, by the contract's tensor names (handoff_client._architectures); else other."""
    last = carried.name.rsplit(".", 1)[-1]
    if last in ATTENTION:
        return "attention"
    if last in CONV:
        return "conv"
    if last in RECURRENT:
        return "recurrent"
    return "other"


def refusal(contract: Contract) -> str | None:
    """Why this adapter cannot carry `contract` exactly (None: it can)."""
    for c in contract.carried:
        if kind(c) == "other":
            what = "an MLA latent" if c.name.endswith("kv_latent") else "a tensor it does not know"
            return (
                f"{contract.model}: `{c.name}` ({c.rows} x {c.cols} {c.dtype}) is {what}; transformers caches "
                "per-head keys and values, and the transformers adapter carries attention caches, sliding-window "
                "rings, conv rings and recurrent states only"
            )
    return None


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _layers(contract: Contract) -> dict[int, list[Carried]]:
    out: dict[int, list[Carried]] = {}
    for c in contract.carried:
        out.setdefault(c.layer, []).append(c)
    return out


def _is_ring(contract: Contract, c: Carried) -> bool:
    return (c.cache_rows or c.rows) < contract.ctx


def read_cache(cache: Any, contract: Contract, position: int, exact: bool = False) -> dict[str, torch.Tensor]:
    """The contract's tensors (contract order, its dtypes, contiguous CPU) out of a cache that has run `position`
    tokens. `contract` is the declared one; each tensor whose rows are positions comes at its filled rows. `exact`:
    in the cache's own dtypes, not cast to the contract's (an audit's reference)."""
    filled = contract.at(position)
    out: dict[str, torch.Tensor] = {}
    for layer, tensors in _layers(filled).items():
        held = cache.layers[layer]
        conv = [c for c in tensors if kind(c) == "conv"]
        for c in tensors:
            if kind(c) == "attention":
                source = held.keys if c.name.endswith("k_cache") else held.values
                rows = source[0].transpose(0, 1).reshape(source.shape[2], -1)  # [tokens, heads·head_dim]
                if _is_ring(contract, c):
                    rows = torch.roll(rows[-c.rows :], window_rows(position, c.cache_rows or c.rows)[1], dims=0)
                else:
                    rows = rows[: c.rows]
                out[c.name] = rows
            elif kind(c) == "recurrent":
                state = held.recurrent_states[0][0]  # [heads, a, b]
                out[c.name] = state.permute(1, 0, 2).reshape(state.shape[1], -1)
        if conv:
            ring = held.conv_states[0][0][:, 1:].transpose(0, 1)  # [K - 1, conv_dim], oldest first
            start = 0
            for c in conv:
                out[c.name] = ring[:, start : start + c.cols]
                start += c.cols
    return {c.name: (out[c.name] if exact else out[c.name].to(torch_dtype(c.dtype))).contiguous().cpu()
            for c in filled.carried}  # fmt: skip


def write_cache(cache: Any, contract: Contract, position: int, held: int, state: Mapping[str, torch.Tensor],
                heads: Mapping[int, int], dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
    """Fill a fresh cache with a hand-off after `position` tokens, so that it holds `held` <= position of them
    (a rewindable contract may be cut back; rings and states never are). `state`: the hand-off's tensors by name
    at their filled rows; `heads`: each attention layer's KV head count; `dtype`: the model's."""
    for layer, tensors in _layers(contract.at(position)).items():
        target = cache.layers[layer]
        conv = [c for c in tensors if kind(c) == "conv"]
        attention = [c for c in tensors if kind(c) == "attention"]
        if attention:
            keys, values = (state[c.name] for c in attention)
            c = attention[0]
            first, shift = window_rows(position, c.cache_rows or c.rows) if _is_ring(contract, c) else (0, 0)
            keys, values = torch.roll(keys, -shift, dims=0), torch.roll(values, -shift, dims=0)  # oldest first
            keys, values = keys[: held - first], values[: held - first]
            n = heads[layer]
            k, v = (t.reshape(t.shape[0], n, -1).transpose(0, 1)[None].to(device, dtype) for t in (keys, values))
            target.update(k.contiguous(), v.contiguous())
            if hasattr(target, "cumulative_length"):
                target.cumulative_length = held  # a window counts every token, not the rows it keeps
        if conv:
            ring = torch.cat([state[c.name] for c in conv], dim=1).transpose(0, 1)  # [conv_dim, K - 1]
            padded = torch.nn.functional.pad(ring, (1, 0))[None].to(device, dtype)
            target.update_conv_state(padded.contiguous())
        for c in tensors:
            if kind(c) == "recurrent":
                rows = state[c.name]
                s = rows.reshape(rows.shape[0], -1, rows.shape[1] // max(c.heads, 1)) if c.heads else None
                if s is None:
                    raise ValueError(f"{contract.model}: `{c.name}` states no heads; cannot lay it out per head")
                # transformers keeps recurrent states in float32 for a bf16/fp16 model (its torch paths): so here
                s = s.permute(1, 0, 2)[None].to(device, torch.promote_types(dtype, torch.float32))
                target.update_recurrent_state(s.contiguous())
