"""Contracts for the models people serve, derived from their Hugging Face `config.json` — never guessed.

Each supported `model_type` has a deriver that reads the config's own fields and lists, per layer in layer order,
the tensors its decode step carries, in the order the step first touches them. The figures follow each
architecture's reference implementation in `transformers` (file named at each deriver); an architecture not listed
here, or a config missing a field a deriver needs, is refused with a message naming what is missing.

    dense attention, grouped-query heads      llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
    sliding-window layers (a ring of window rows instead of ctx)
                                              mistral/mixtral (`sliding_window`), qwen2/qwen3 (`use_sliding_window`,
                                              `max_window_layers` or `layer_types`), gemma2, gemma3 / gemma3_text
    multi-head latent attention               deepseek_v2, deepseek_v3: one latent of kv_lora_rank + qk_rope_head_dim
    gated-delta-net hybrids                   qwen3_next: conv ring and recurrent memory per linear layer

Quantized caches: `dtype="float8_e4m3fn"` (or e5m2) carries a per-tensor float32 scale after each cache, `int8` a
per-row one, each a carried tensor of its own (`scale=` overrides: "tensor", "row" or "none").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._contract import MODEL_NAME, Carried, Contract, ManifestError
from ._dtypes import DTYPES

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


class _Layers:
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

    def state(self, name: str, layer: int, rows: int, cols: int, dtype: str) -> None:
        self.carried.append(Carried(name, layer, rows, cols, dtype))


def _get(config: dict, key: str, model_type: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"config.json of model_type `{model_type}`: `{key}` must be a positive integer, got {value!r}"
        )
    return value


def _head_dim(config: dict, model_type: str) -> int:
    """`head_dim` where the config gives it (Qwen3, Gemma), else hidden_size / num_attention_heads (Llama, Mistral)."""
    if config.get("head_dim") is not None:
        return _get(config, "head_dim", model_type)
    hidden, heads = _get(config, "hidden_size", model_type), _get(config, "num_attention_heads", model_type)
    if hidden % heads:
        raise ConfigError(f"config.json of `{model_type}`: hidden_size {hidden} is not a multiple of {heads} heads")
    return hidden // heads


def _kv_heads(config: dict, model_type: str) -> int:
    if config.get("num_key_value_heads") is None:
        return _get(config, "num_attention_heads", model_type)  # plain multi-head attention
    return _get(config, "num_key_value_heads", model_type)


def _attention(layers: _Layers, config: dict, model_type: str, windows: list[int | None]) -> None:
    """Per layer a key then a value cache (rows: ctx, or the layer's window, a ring whose row p mod window holds
    position p), kv_heads x head_dim columns."""
    heads, head_dim = _kv_heads(config, model_type), _head_dim(config, model_type)
    for i, window in enumerate(windows):
        rows = layers.options.ctx if window is None else min(window, layers.options.ctx)
        layers.cache(f"layers.{i}.self_attn.k_cache", i, rows, heads * head_dim, heads, head_dim)
        layers.cache(f"layers.{i}.self_attn.v_cache", i, rows, heads * head_dim, heads, head_dim)


def _layer_types(config: dict, model_type: str, default: Callable[[int], str]) -> list[str]:
    n = _get(config, "num_hidden_layers", model_type)
    types = config.get("layer_types")
    if types is None:
        return [default(i) for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"config.json of `{model_type}`: `layer_types` must list all {n} layers")
    return types


def _windows_from_types(config: dict, model_type: str, types: list[str]) -> list[int | None]:
    windows: list[int | None] = []
    for i, kind in enumerate(types):
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention":
            windows.append(_get(config, "sliding_window", model_type))
        else:
            raise ConfigError(f"config.json of `{model_type}`: layer {i} is `{kind}`, which this model_type lacks")
    return windows


def _dense(config: dict, model_type: str, layers: _Layers) -> None:
    """Llama, Mistral, Mixtral, Qwen2, Qwen3 (and their MoE variants: the same attention).

    transformers models/llama/modeling_llama.py (LlamaAttention: k/v_proj to num_key_value_heads * head_dim);
    models/mistral/modeling_mistral.py and mixtral: `sliding_window` on every layer when set;
    models/qwen2/configuration_qwen2.py and qwen3: layer_types = sliding_attention for layer i when
    use_sliding_window and i >= max_window_layers, else full_attention.
    """
    n = _get(config, "num_hidden_layers", model_type)
    if model_type in ("mistral", "mixtral"):
        window = config.get("sliding_window")
        types = _layer_types(config, model_type, lambda i: "sliding_attention" if window else "full_attention")
    elif model_type.startswith("qwen"):
        sliding = bool(config.get("use_sliding_window"))
        floor = config.get("max_window_layers", n) if sliding else n
        types = _layer_types(config, model_type, lambda i: "sliding_attention" if i >= floor else "full_attention")
    else:
        types = _layer_types(config, model_type, lambda i: "full_attention")
    _attention(layers, config, model_type, _windows_from_types(config, model_type, types))


def _gemma(config: dict, model_type: str, layers: _Layers) -> None:
    """Gemma 2 and 3: sliding-window layers alternate with global ones.

    transformers models/gemma2/configuration_gemma2.py: layer i slides when (i + 1) % 2 (even layers);
    models/gemma3/configuration_gemma3.py: layer i slides when (i + 1) % sliding_window_pattern (default 6), so every
    sixth layer is global. `layer_types`, where the config has it, is taken as written.
    """
    pattern = 2 if model_type == "gemma2" else config.get("sliding_window_pattern", 6)
    types = _layer_types(config, model_type, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention")
    _attention(layers, config, model_type, _windows_from_types(config, model_type, types))


def _mla(config: dict, model_type: str, layers: _Layers) -> None:
    """DeepSeek-V2/V3 multi-head latent attention: what a decode step keeps per position is the compressed KV
    latent (kv_lora_rank) and the decoupled rotary key (qk_rope_head_dim), one tensor a layer, as vLLM and SGLang
    cache it. transformers models/deepseek_v3/modeling_deepseek_v3.py (kv_a_proj_with_mqa: kv_lora_rank +
    qk_rope_head_dim). The multi-token-prediction layers (`num_nextn_predict_layers`) are not decode-step layers."""
    n = _get(config, "num_hidden_layers", model_type)
    width = _get(config, "kv_lora_rank", model_type) + _get(config, "qk_rope_head_dim", model_type)
    for i in range(n):
        layers.cache(f"layers.{i}.self_attn.kv_latent", i, layers.options.ctx, width)


def _qwen3_next(config: dict, model_type: str, layers: _Layers) -> None:
    """Qwen3-Next: gated-delta-net (linear) layers, with a full-attention layer every `full_attention_interval`.

    transformers models/qwen3_next/configuration_qwen3_next.py: layer i is linear_attention when
    (i + 1) % full_attention_interval, else full_attention. models/qwen3_next/modeling_qwen3_next.py
    (Qwen3NextGatedDeltaNet): conv_dim = 2 * key_dim + value_dim, with key_dim = linear_num_key_heads x
    linear_key_head_dim and value_dim = linear_num_value_heads x linear_value_head_dim; the causal conv keeps its last
    linear_conv_kernel_dim - 1 inputs (the conv ring, touched first); the recurrent state is num_value_heads x
    key_head_dim x value_head_dim. Full-attention layers: key and value caches, num_key_value_heads x head_dim.
    """
    interval = config.get("full_attention_interval", 4)
    types = _layer_types(config, model_type, lambda i: "linear_attention" if (i + 1) % interval else "full_attention")
    k_heads = _get(config, "linear_num_key_heads", model_type)
    v_heads = _get(config, "linear_num_value_heads", model_type)
    k_dim, v_dim = _get(config, "linear_key_head_dim", model_type), _get(config, "linear_value_head_dim", model_type)
    kernel = _get(config, "linear_conv_kernel_dim", model_type)
    conv_dtype = layers.options.dtype if not layers.options.dtype.startswith(("float8", "int", "uint")) else "bfloat16"
    heads, head_dim = _kv_heads(config, model_type), _head_dim(config, model_type)
    for i, kind in enumerate(types):
        if kind == "linear_attention":
            layers.state(
                f"layers.{i}.linear_attn.conv_ring", i, kernel - 1, 2 * k_heads * k_dim + v_heads * v_dim, conv_dtype
            )
            layers.state(f"layers.{i}.linear_attn.memory", i, v_heads * k_dim, v_dim, layers.options.state_dtype)
        elif kind == "full_attention":
            layers.cache(f"layers.{i}.self_attn.k_cache", i, layers.options.ctx, heads * head_dim, heads, head_dim)
            layers.cache(f"layers.{i}.self_attn.v_cache", i, layers.options.ctx, heads * head_dim, heads, head_dim)
        else:
            raise ConfigError(f"config.json of `{model_type}`: layer {i} is `{kind}`, which this model_type lacks")


DERIVERS: dict[str, Callable[[dict, str, _Layers], None]] = {
    "llama": _dense,
    "mistral": _dense,
    "mixtral": _dense,
    "qwen2": _dense,
    "qwen2_moe": _dense,
    "qwen3": _dense,
    "qwen3_moe": _dense,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
    "deepseek_v2": _mla,
    "deepseek_v3": _mla,
    "qwen3_next": _qwen3_next,
}

REFUSED = {
    "minimax_text_01": "its lightning-attention layers' state layout is not stated by its config",
    "minimax": "its lightning-attention layers' state layout is not stated by its config",
    "minimax_m1": "its lightning-attention layers' state layout is not stated by its config",
}


def contract_from_config(
    config: dict,
    *,
    ctx: int = DEFAULT_CTX,
    dtype: str = DEFAULT_DTYPE,
    model: str | None = None,
    state_dtype: str = DEFAULT_STATE_DTYPE,
    scale: str | None = None,
) -> Contract:
    """The contract of the model a Hugging Face config.json describes, over a cache of `ctx` positions."""
    if not isinstance(config, dict):
        raise ConfigError("config.json must be a JSON object")
    model_type = config.get("model_type")
    if model_type == "gemma3" and isinstance(config.get("text_config"), dict):  # the multimodal wrapper
        config, model_type = {**config["text_config"], "model_type": "gemma3_text"}, "gemma3_text"
    supported = ", ".join(sorted(DERIVERS))
    if model_type in REFUSED:
        raise ConfigError(f"model_type `{model_type}` is not supported: {REFUSED[model_type]}; supported: {supported}")
    if model_type not in DERIVERS:
        raise ConfigError(f"model_type `{model_type}` is not supported; supported: {supported}")
    for name, value in (("dtype", dtype), ("state_dtype", state_dtype)):
        if value not in DTYPES:
            raise ConfigError(f"{name} {value!r} is not one of {', '.join(DTYPES)}")
    if scale is not None and scale not in SCALES:
        raise ConfigError(f"scale {scale!r} is not one of {', '.join(SCALES)}")
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1:
        raise ConfigError(f"ctx must be a positive integer, got {ctx!r}")
    name = model or config.get("_name_or_path") or model_type
    if not MODEL_NAME.fullmatch(name):
        raise ConfigError(f"model name {name!r} is not a valid contract model name; pass one with --model")
    layers = _Layers(Options(ctx, dtype, state_dtype, scale))
    DERIVERS[model_type](config, model_type, layers)
    return Contract(name, ctx, _get(config, "hidden_size", model_type), tuple(layers.carried))
