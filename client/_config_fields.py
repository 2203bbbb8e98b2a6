"""What every contract deriver shares: reading a config.json's fields strictly, and laying out carried tensors.

A field a deriver needs is read with `positive_int` (a bool, a string, zero or a negative number is refused with a
ConfigError naming the model_type and the field: never guessed). `Layers` accumulates the carried tensors layer by
layer in the order the decode step first touches them; `attention` adds one layer's key and value caches.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol.contract import Carried, ManifestError

DEFAULT_CTX = 4096
DEFAULT_DTYPE = "bfloat16"
DEFAULT_STATE_DTYPE = "float32"
SCALES = ("tensor", "row", "none")


class ConfigError(ManifestError):
    """A config.json this module will not turn into a contract; the message says which field or model_type."""


@dataclass(frozen=True)
class Options:
    ctx: int = DEFAULT_CTX
    dtype: str = DEFAULT_DTYPE
    state_dtype: str = DEFAULT_STATE_DTYPE
    scale: str | None = None  # None: by dtype (float8 -> tensor, int8 -> row, others -> none)

    @property
    def scale_kind(self) -> str:
        if self.scale is not None:
            return self.scale
        if self.dtype.startswith("float8"):
            return "tensor"
        return "row" if self.dtype in ("int8", "uint8") else "none"

    @property
    def conv_dtype(self) -> str:
        """A recurrent layer's conv ring holds the layer's inputs, in the model's dtype: the cache dtype, unless that
        is a quantized one (vLLM's `mamba_cache_dtype` "auto" keeps the model dtype), then bfloat16."""
        return self.dtype if not self.dtype.startswith(("float8", "int", "uint")) else "bfloat16"


class Layers:
    """Accumulates carried tensors layer by layer; caches get their scale tensors as the options say."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.carried: list[Carried] = []

    def cache(self, name: str, layer: int, rows: int, cols: int, heads: int = 0, head_dim: int = 0) -> None:
        """A cache, one row per token position (ctx rows, or a sliding window's ring): a hand-off carries the rows
        its position filled. With `heads`, its columns split by head across tensor-parallel ranks (else every rank
        holds it whole, as an MLA latent is). A per-row scale is positional too; a per-tensor one is not."""
        self.carried.append(Carried(name, layer, rows, cols, self.options.dtype, heads, head_dim, True))
        kind = self.options.scale_kind
        if kind == "tensor":
            self.carried.append(Carried(f"{name}.scale", layer, 1, 1, "float32"))
        elif kind == "row":
            self.carried.append(Carried(f"{name}.scale", layer, rows, 1, "float32", rows_are_positions=True))

    def state(self, name: str, layer: int, rows: int, cols: int, dtype: str, heads: int = 0, head_dim: int = 0) -> None:
        """A recurrent state of fixed size (its rows are not positions), carried whole at every position; with
        `heads`, its columns split by head across tensor-parallel ranks as a cache's do."""
        self.carried.append(Carried(name, layer, rows, cols, dtype, heads, head_dim))


def positive_int(config: dict, key: str, model_type: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"config.json of model_type `{model_type}`: `{key}` must be a positive integer, got {value!r}"
        )
    return value


def head_dim(config: dict, model_type: str) -> int:
    """`head_dim` where the config gives it (Qwen3, Gemma), else hidden_size / num_attention_heads (Llama, Mistral)."""
    if config.get("head_dim") is not None:
        return positive_int(config, "head_dim", model_type)
    hidden, heads = (
        positive_int(config, "hidden_size", model_type),
        positive_int(config, "num_attention_heads", model_type),
    )
    if hidden % heads:
        raise ConfigError(f"config.json of `{model_type}`: hidden_size {hidden} is not a multiple of {heads} heads")
    return hidden // heads


def kv_heads(config: dict, model_type: str) -> int:
    if config.get("num_key_value_heads") is None:
        return positive_int(config, "num_attention_heads", model_type)  # plain multi-head attention
    return positive_int(config, "num_key_value_heads", model_type)


def ring_rows(window: int, model_type: str) -> int:
    """The rows a sliding-window layer's ring keeps: window - 1. A layer of window W attends to the W positions
    (p - W, p] ending at its own token p (transformers' `sliding_window_overlay`: kv > q - W; vLLM's
    `SlidingWindowManager.get_num_skipped_tokens`: n - W + 1 skipped after n tokens), so the next token reads W - 1
    cached rows, and vLLM keeps exactly those."""
    if window < 2:
        raise ConfigError(f"config.json of `{model_type}`: a sliding window of {window} keeps no past rows")
    return window - 1


def attention(layers: Layers, config: dict, model_type: str, layer: int, window: int | None = None) -> None:
    """Layer `layer`'s key then value cache, kv_heads x head_dim columns split by head: ctx rows, or with a sliding
    `window` a ring of min(window - 1, ctx) rows whose row p mod rows holds position p."""
    heads, width = kv_heads(config, model_type), head_dim(config, model_type)
    ctx = layers.options.ctx
    rows = ctx if window is None else min(ring_rows(window, model_type), ctx)
    layers.cache(f"layers.{layer}.self_attn.k_cache", layer, rows, heads * width, heads, width)
    layers.cache(f"layers.{layer}.self_attn.v_cache", layer, rows, heads * width, heads, width)
