"""Which tensors of two transformers caches of one model correspond, layer by layer: what the tests that hold a
cache `handoff_client.transformers.load` built to transformers' own compare (imported by the tests, and by their
subprocesses that run transformers apart from vLLM)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def paired_tensors(got: Any, want: Any) -> Iterator[tuple[int, str, Any, Any]]:
    """(layer, kind, got's tensor, want's tensor) for every tensor `want` holds: keys and values of attention
    layers, the conv ring (its last K - 1 columns: transformers keeps K, the first feeding nothing) and recurrent
    state of linear-attention layers. The shapes must agree."""
    for i, (a, b) in enumerate(zip(got.layers, want.layers, strict=True)):
        pairs = {}
        if getattr(b, "keys", None) is not None and b.keys.numel():
            pairs.update(keys=(a.keys, b.keys), values=(a.values, b.values))
        if getattr(b, "conv_states", {}).get(0) is not None:
            pairs.update(conv=(a.conv_states[0][..., 1:], b.conv_states[0][..., 1:]),
                         recurrent=(a.recurrent_states[0], b.recurrent_states[0]))  # fmt: skip
        for what, (x, y) in pairs.items():
            assert x.shape == y.shape, (i, what, x.shape, y.shape)
            yield i, what, x, y
