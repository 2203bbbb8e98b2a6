"""Contracts for the models people serve, derived from their Hugging Face `config.json` — never guessed.

Each supported `model_type` has a deriver that reads the config's own fields and lists, per layer in layer order,
the tensors its decode step carries, in the order the step first touches them. The figures follow each
architecture's reference implementation in `transformers` (file named at each deriver); an architecture not listed
here, or a config missing a field a deriver needs, is refused with a message naming what is missing.

    dense attention, grouped-query heads      llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
    sliding-window layers (a ring of window - 1 rows instead of ctx: what the next token reads, and vLLM keeps)
                                              mistral/mixtral (`sliding_window`), qwen2/qwen3 (`use_sliding_window`,
                                              `max_window_layers` or `layer_types`), gemma2, gemma3 / gemma3_text
    multi-head latent attention               deepseek_v2, deepseek_v3: one latent of kv_lora_rank + qk_rope_head_dim
    gated-delta-net hybrids                   qwen3_next, qwen3_5 / qwen3_5_moe (their `text_config`): conv ring
                                              (q, k, v) and recurrent memory per linear layer, split by head
    Mamba2 hybrids                            nemotron_h, granitemoehybrid, falcon_h1: conv ring (x, B, C) and SSM
                                              state per Mamba layer, split by head (handoff_client._hybrids)

Quantized caches: `dtype="float8_e4m3fn"` (or e5m2) carries a per-tensor float32 scale after each cache, `int8` a
per-row one, each a carried tensor of its own (`scale=` overrides: "tensor", "row" or "none").
"""

from __future__ import annotations

from collections.abc import Callable

from . import _hybrids
from ._config_fields import (
    DEFAULT_CTX,
    DEFAULT_DTYPE,
    DEFAULT_STATE_DTYPE,
    SCALES,
    ConfigError,
    Layers,
    Options,
    attention,
    positive_int,
)
from .protocol.contract import MODEL_NAME, Contract
from .protocol.dtypes import DTYPES

__all__ = ["DEFAULT_CTX", "DEFAULT_DTYPE", "DEFAULT_STATE_DTYPE", "DERIVERS", "ConfigError", "contract_from_config"]

_get = positive_int


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


def _dense(config: dict, model_type: str, layers: Layers) -> None:
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
    for i, window in enumerate(_windows_from_types(config, model_type, types)):
        attention(layers, config, model_type, i, window)


def _gemma(config: dict, model_type: str, layers: Layers) -> None:
    """Gemma 2 and 3: sliding-window layers alternate with global ones.

    transformers models/gemma2/configuration_gemma2.py: layer i slides when (i + 1) % 2 (even layers);
    models/gemma3/configuration_gemma3.py: layer i slides when (i + 1) % sliding_window_pattern (default 6), so every
    sixth layer is global. `layer_types`, where the config has it, is taken as written.
    """
    pattern = 2 if model_type == "gemma2" else config.get("sliding_window_pattern", 6)
    types = _layer_types(config, model_type, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention")
    for i, window in enumerate(_windows_from_types(config, model_type, types)):
        attention(layers, config, model_type, i, window)


def _mla(config: dict, model_type: str, layers: Layers) -> None:
    """DeepSeek-V2/V3 multi-head latent attention: what a decode step keeps per position is the compressed KV
    latent (kv_lora_rank) and the decoupled rotary key (qk_rope_head_dim), one tensor a layer, as vLLM and SGLang
    cache it. transformers models/deepseek_v3/modeling_deepseek_v3.py (kv_a_proj_with_mqa: kv_lora_rank +
    qk_rope_head_dim). The multi-token-prediction layers (`num_nextn_predict_layers`) are not decode-step layers."""
    n = _get(config, "num_hidden_layers", model_type)
    width = _get(config, "kv_lora_rank", model_type) + _get(config, "qk_rope_head_dim", model_type)
    for i in range(n):
        layers.cache(f"layers.{i}.self_attn.kv_latent", i, layers.options.ctx, width)


DERIVERS: dict[str, Callable[[dict, str, Layers], None]] = {
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
    "qwen3_next": _hybrids.qwen3_next,
    "qwen3_5_text": _hybrids.qwen3_next,
    "qwen3_5_moe_text": _hybrids.qwen3_next,
    "nemotron_h": _hybrids.nemotron_h,
    "granitemoehybrid": _hybrids.granitemoehybrid,
    "falcon_h1": _hybrids.falcon_h1,
}

WRAPPERS = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
"""Multimodal configs whose language model's config is nested as `text_config`: the contract is the text model's."""

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
    if model_type in WRAPPERS and isinstance(config.get("text_config"), dict):
        name = config.get("_name_or_path")
        config, model_type = {**config["text_config"], "model_type": WRAPPERS[model_type]}, WRAPPERS[model_type]
        if name and not config.get("_name_or_path"):
            config["_name_or_path"] = name
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
    layers = Layers(Options(ctx, dtype, state_dtype, scale))
    DERIVERS[model_type](config, model_type, layers)
    return Contract(name, ctx, _get(config, "hidden_size", model_type), tuple(layers.carried))
