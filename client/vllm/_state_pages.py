"""Recurrent-state pages (gated-delta-net and Mamba2 layers) ↔ the contract's conv ring and recurrent state.

vLLM 0.32 registers a Mamba-type layer's cache as `[num_blocks, 1, 1, bytes]` int8 (`create_kv_cache_views` for a
`MambaSpec`), and the layer unpacks each block as its states back to back, in `get_state_shape()` order, each
re-typed to its dtype (`MambaBase.bind_kv_cache`): the conv state, then the recurrent (temporal) state.

    conv state    (kernel-1, conv_dim) in the SD layout, (conv_dim, kernel-1) in DS (`get_conv_state_layout`);
                  channels [Q | K | V] for a gated-delta-net layer, [x | B | C] for Mamba2, each the rank's own
                  heads under tensor parallelism
    recurrent     (heads, A, B): gated-delta-net (v_heads, v_dim, k_dim), Mamba2 (heads, head_dim, state)

The contract (handoff_client._hybrids, whatever it says at the time) carries the conv state as tensors whose
columns, in the contract's order, are the channels in the page's order (one `conv_ring`, or `conv_q/k/v`,
`conv_x/b/c`), rows the kernel-1 kept inputs in time order; and the recurrent state as one tensor holding per head
h a matrix S_h (rows × head_dim) either on its columns (`heads` > 0: tensor[x, h·head_dim + y] = S_h[x, y]) or
stacked on its rows (`heads` = 0: tensor[h·rows/H + x, y]). How vLLM's page holds S_h (`Orientation`) is
learned, not assumed (`_orientation.learn_orientation`):

    AS_IS          page[h] is S_h                                   Mamba2 (vLLM's calculator: (heads, head_dim, state);
                                                                    its CPU kernels too, probed)
    TRANSPOSED     page[h] is S_h transposed                        gated-delta-net where the kernels follow vLLM's
                                                                    calculator, (v_dim, k_dim) (its GPU kernels)
    REINTERPRETED  page[h], allocated (v_dim, k_dim), holds S_h     gated-delta-net on vLLM's CPU build: its kernels
                   (k_dim, v_dim) row-major in the same memory      view the page as (k_dim, v_dim)
                                                                    (`cpu/gdn_attention._ssm_state_view`)

On the CPU build the orientation is learned by running vLLM's own kernels (gated-delta-net's decode, Mamba2's prefill
and decode) on a page, through the view its CPU path takes of it: a state read back after them must be S_h in
transformers' orientation (_orientation.py).

API for the worker, one state block (one request's running state) at a time:

    layout = state_layout(local_state_tensors, spec.shapes, spec.dtypes, conv_dim_first=...,
                          orientation=learn_orientation(spec.mamba_type.name, spec.dtypes[-1]))
    layout.gather(pages, block_id) -> {contract name: (rows, cols) tensor}     # copies
    layout.scatter(pages, block_id, {contract name: (rows, cols) tensor})     # writes every state byte it owns
    layout.views(pages) -> (conv, recurrent)                                  # the typed views bind_kv_cache makes
    check_bound_views(layout, pages, layer_module.kv_cache, name)            # at start-up: the same views as vLLM's

Anything that does not fit (sizes, dtypes, a tensor left over) is refused with UnsupportedLayout naming it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch

from ._layouts import UnsupportedLayout


class Orientation(enum.Enum):
    """How a page holds each head's S_h (module docstring)."""

    AS_IS = "as is"
    TRANSPOSED = "transposed"
    REINTERPRETED = "row-major in the transposed shape's memory"


@dataclass(frozen=True)
class StateTensor:
    """A contract tensor as one rank holds it: name, shape, and its heads (0: not split by head)."""

    name: str
    rows: int
    cols: int
    heads: int = 0
    head_dim: int = 0


@dataclass(frozen=True)
class StateGeometry:
    """One Mamba-type layer's page as vLLM lays it out for this rank."""

    conv_shape: tuple[int, int]
    conv_dtype: torch.dtype
    state_shape: tuple[int, int, int]
    state_dtype: torch.dtype
    conv_dim_first: bool  # vLLM's DS conv layout: (conv_dim, kernel-1)
    orientation: Orientation  # how state[h] holds S_h

    @property
    def kernel_rows(self) -> int:
        return self.conv_shape[1] if self.conv_dim_first else self.conv_shape[0]

    @property
    def conv_dim(self) -> int:
        return self.conv_shape[0] if self.conv_dim_first else self.conv_shape[1]


class StatePageLayout:
    """One layer's state page ↔ its contract tensors (module docstring); `conv` and `state` are the contract's."""

    def __init__(self, geometry: StateGeometry, conv: Sequence[StateTensor], state: StateTensor) -> None:
        self.geometry, self.conv, self.state = geometry, tuple(conv), state

    def views(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv (blocks, *conv_shape), recurrent (blocks, *state_shape)): typed views of the int8 pages, as
        `MambaBase.bind_kv_cache` makes them."""
        g = self.geometry
        raw = pages.squeeze(dim=(1, 2))
        conv_bytes = prod(g.conv_shape) * g.conv_dtype.itemsize
        state_bytes = prod(g.state_shape) * g.state_dtype.itemsize
        conv = raw[:, :conv_bytes].view(g.conv_dtype).view(-1, *g.conv_shape)
        state = raw[:, conv_bytes : conv_bytes + state_bytes].view(g.state_dtype).view(-1, *g.state_shape)
        return conv, state

    def _conv_rows(self, conv: torch.Tensor) -> torch.Tensor:
        """One block's conv state as (kernel-1, conv_dim), a view."""
        return conv.t() if self.geometry.conv_dim_first else conv

    def _s_per_head(self, block: torch.Tensor) -> torch.Tensor:
        """One block's recurrent state (vLLM's (heads, a, b) view) as S_h per head, a view."""
        h, a, b = self.geometry.state_shape
        if self.geometry.orientation is Orientation.TRANSPOSED:
            return block.transpose(1, 2)
        if self.geometry.orientation is Orientation.REINTERPRETED:
            return block.reshape(h, b, a)
        return block

    def _per_head(self, tensor: torch.Tensor) -> torch.Tensor:
        """The contract's recurrent tensor as (heads, rows, head_dim): S_h per head, a view where it can be."""
        h, s = self.geometry.state_shape[0], self.state
        if s.heads:
            return tensor.reshape(s.rows, h, s.cols // h).permute(1, 0, 2)
        return tensor.reshape(h, s.rows // h, s.cols)

    def gather(self, pages: torch.Tensor, block_id: int) -> dict[str, torch.Tensor]:
        """The contract's tensors of the request whose state block is `block_id`, each (rows, cols): copies."""
        conv, state = self.views(pages)
        rows = self._conv_rows(conv[block_id])
        out, first = {}, 0
        for t in self.conv:
            out[t.name] = rows[:, first : first + t.cols].clone()
            first += t.cols
        heads = self._s_per_head(state[block_id])
        s = self.state
        if s.heads:
            out[s.name] = heads.permute(1, 0, 2).reshape(s.rows, s.cols).clone()  # one head: reshape is a view
        else:
            out[s.name] = heads.reshape(s.rows, s.cols).clone()
        return out

    def scatter(self, pages: torch.Tensor, block_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write the contract's tensors into state block `block_id` (every conv and recurrent byte of it)."""
        g = self.geometry
        conv, state = self.views(pages)
        rows = self._conv_rows(conv[block_id])
        first = 0
        for t in self.conv:
            rows[:, first : first + t.cols] = tensors[t.name].reshape(t.rows, t.cols).to(g.conv_dtype)
            first += t.cols
        heads = self._per_head(tensors[self.state.name].to(g.state_dtype))
        if g.orientation is Orientation.TRANSPOSED:
            heads = heads.transpose(1, 2)
        elif g.orientation is Orientation.REINTERPRETED:
            heads = heads.reshape(g.state_shape)
        state[block_id] = heads


def check_bound_views(layout: StatePageLayout, pages: torch.Tensor, bound: Sequence[torch.Tensor], layer: str) -> None:
    """At start-up: the views `layout` makes of `pages` must be the very views vLLM's layer bound (its `.kv_cache`,
    made by `MambaBase.bind_kv_cache`): same memory, shape, strides and dtype; else UnsupportedLayout naming the
    layer and the state that differs."""
    if len(bound) != 2:
        raise UnsupportedLayout(f"state pages of {layer}: vLLM bound {len(bound)} states, the connector knows 2")
    for what, mine, theirs in zip(("conv", "recurrent"), layout.views(pages), bound):
        same = (mine.data_ptr(), mine.shape, mine.stride(), mine.dtype) == (
            theirs.data_ptr(), theirs.shape, theirs.stride(), theirs.dtype)  # fmt: skip
        if not same:
            raise UnsupportedLayout(
                f"state pages of {layer}: the connector's {what} state view {tuple(mine.shape)} {mine.dtype} at "
                f"{mine.stride()} is not the one vLLM bound, {tuple(theirs.shape)} {theirs.dtype} at {theirs.stride()}"
            )


def state_layout(
    tensors: Sequence[StateTensor],
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    *,
    conv_dim_first: bool,
    orientation: Orientation,
    layer: str = "",
) -> StatePageLayout:
    """The page layout of one Mamba-type layer whose contract tensors (this rank's shapes) are `tensors` and whose
    `MambaSpec` has `shapes` and `dtypes` (conv state, recurrent state); UnsupportedLayout naming what does not fit."""
    where = f"state pages of {layer or 'a layer'}"
    if len(shapes) != 2 or len(dtypes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        raise UnsupportedLayout(f"{where}: vLLM's states {[tuple(s) for s in shapes]} are not a conv state and one "
                                "(heads, a, b) recurrent state")  # fmt: skip
    g = StateGeometry(tuple(shapes[0]), dtypes[0], tuple(shapes[1]), dtypes[1], conv_dim_first, orientation)
    conv = [t for t in tensors if ".conv" in t.name or t.name.startswith("conv")]
    rest = [t for t in tensors if t not in conv]
    if len(rest) != 1 or not conv:
        raise UnsupportedLayout(f"{where}: the contract's tensors {[t.name for t in tensors]} are not conv tensors "
                                "and one recurrent state")  # fmt: skip
    for t in conv:
        if t.rows != g.kernel_rows:
            raise UnsupportedLayout(f"{where}: `{t.name}` keeps {t.rows} inputs, vLLM's conv state {g.kernel_rows}")
    if sum(t.cols for t in conv) != g.conv_dim:
        raise UnsupportedLayout(f"{where}: the contract's conv tensors have {sum(t.cols for t in conv)} channels, "
                                f"vLLM's conv state {g.conv_dim}")  # fmt: skip
    state, (h, a, b) = rest[0], g.state_shape
    per_head = (a, b) if orientation is Orientation.AS_IS else (b, a)  # S_h's (rows, head_dim)
    if state.heads:
        fits = state.heads == h and (state.rows, state.head_dim) == per_head and state.cols == h * state.head_dim
    else:
        fits = (state.rows, state.cols) == (h * per_head[0], per_head[1])
    if not fits:
        raise UnsupportedLayout(f"{where}: the contract's `{state.name}` ({state.rows} x {state.cols}, "
                                f"{state.heads} heads) does not hold vLLM's recurrent state {(h, a, b)} "
                                f"({orientation.value} per head)")  # fmt: skip
    return StatePageLayout(g, conv, state)
