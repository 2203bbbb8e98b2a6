"""One layer's bytes between vLLM's pages and the contract's tensors, by the layer's kind (_groups.py).

    attention   the prompt's rows [first, rows) of key and value, through the backend's page layout (_layouts.py)
    window      only the ring's rows: positions [rows - ring, rows) in the contract's ring order (row p mod ring
                holds position p), read from and written to the request's own blocks of its window group; the
                skipped prefix's null blocks are neither read nor written (a row that would be is refused)
    state       the request's state block (its group's last block id), whole: conv tensors and recurrent state
                through _state_pages.py

`gather(pages, blocks, rows)` copies a layer out ({contract name: tensor}, on the pages' device); `scatter(pages,
blocks, first, rows, tensors)` writes what a hand-off after `rows` tokens carries for the layer into the pages,
from position `first` on (a local prefix hit below it is kept). `blocks` is the request's block ids of the layer's
own KV-cache group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from handoff_client._handoff_rules import window_rows

from ._groups import Kind, LayerPlan, check_rows_held, state_block
from ._layouts import PageLayout
from ._orientation import learn_orientation
from ._state_pages import StatePageLayout, StateTensor, check_bound_views, state_layout


class AttentionMover:
    """A full-attention or sliding-window layer's key and value caches."""

    def __init__(self, plan: LayerPlan, layout: PageLayout) -> None:
        self.plan, self.layout = plan, layout
        self.key, self.value = (t.name for t in plan.tensors)

    def _shift(self, rows: int) -> int:
        """Ring order of a wrapped window: ring[(rows + i) mod R] = token rows - R + i, a roll by rows mod R (the
        window's rows, as every adapter reads them: handoff_client._handoff_rules.window_rows)."""
        return window_rows(rows, self.plan.ring_rows)[1] if self.plan.kind is Kind.WINDOW else 0

    def gather(self, pages: torch.Tensor, blocks: Sequence[int], rows: int) -> dict[str, torch.Tensor]:
        first = self.plan.first_row(rows)
        check_rows_held(self.plan, blocks, first, rows)
        keys, values = self.layout.gather(pages, list(blocks), rows, first=first)
        if shift := self._shift(rows):
            keys, values = torch.roll(keys, shift, dims=0), torch.roll(values, shift, dims=0)
        return {self.key: keys, self.value: values}

    def scatter(self, pages: torch.Tensor, blocks: Sequence[int], first: int, rows: int,
                tensors: Mapping[str, torch.Tensor]) -> None:  # fmt: skip
        keys, values = tensors[self.key], tensors[self.value]
        base = self.plan.first_row(rows)  # the position the tensors' row 0 holds, in position order
        if shift := self._shift(rows):
            keys, values = torch.roll(keys, -shift, dims=0), torch.roll(values, -shift, dims=0)
        start = max(first, base)
        if start >= rows:
            return
        check_rows_held(self.plan, blocks, start, rows)
        keys, values = keys[start - base : rows - base], values[start - base : rows - base]
        self.layout.scatter(pages, list(blocks), start, keys.to(pages.device), values.to(pages.device))


class StateMover:
    """A gated-delta-net or Mamba2 layer's state page: the request's one state block, whole."""

    def __init__(self, plan: LayerPlan, layout: StatePageLayout) -> None:
        self.plan, self.layout = plan, layout

    def gather(self, pages: torch.Tensor, blocks: Sequence[int], rows: int) -> dict[str, torch.Tensor]:
        return self.layout.gather(pages, state_block(self.plan, blocks))

    def scatter(self, pages: torch.Tensor, blocks: Sequence[int], first: int, rows: int,
                tensors: Mapping[str, torch.Tensor]) -> None:  # fmt: skip
        moved = {name: tensor.to(pages.device) for name, tensor in tensors.items()}
        self.layout.scatter(pages, state_block(self.plan, blocks), moved)


def state_mover(plan: LayerPlan, pages: torch.Tensor, bound: Sequence[torch.Tensor] | None) -> StateMover:
    """The mover of a STATE layer: its page layout from vLLM's MambaSpec (shapes, dtypes, conv layout, orientation
    learned from vLLM's own calculators and, on its CPU build, kernels: _orientation.py), checked against the views
    vLLM's layer bound (`bound`, its `.kv_cache`) where the worker can reach them; UnsupportedLayout naming what
    differs."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    spec = plan.spec
    tensors = [StateTensor(t.name, t.rows, t.cols, t.heads, t.head_dim) for t in plan.tensors]
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    layout = state_layout(tensors, spec.shapes, spec.dtypes, conv_dim_first=is_conv_state_dim_first(),
                          orientation=learn_orientation(kind, spec.dtypes[-1]), layer=plan.layer)  # fmt: skip
    if bound is not None:
        check_bound_views(layout, pages, bound, plan.layer)
    return StateMover(plan, layout)


def layer_windows(vllm_config: Any) -> dict[str, int | None]:
    """Each attention layer's own sliding window (None: full attention), read off vLLM's layers: with the hybrid
    KV-cache manager off, one group's spec merges them."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    return {name: layer.sliding_window for name, layer in context.items() if hasattr(layer, "sliding_window")}


def bound_views(vllm_config: Any, layer: str) -> tuple[torch.Tensor, ...] | None:
    """The state views vLLM's layer `layer` bound to its pages (MambaBase.bind_kv_cache), or None where the worker
    cannot reach the layer (then the page layout stands on vLLM's calculators alone)."""
    context = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    module = context.get(layer)
    views = getattr(module, "kv_cache", None)
    return tuple(views) if isinstance(views, (tuple, list)) and views and torch.is_tensor(views[0]) else None
