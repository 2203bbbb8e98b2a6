"""Contracts of hybrid models: recurrent layers (gated-delta-net, Mamba2) beside attention layers.

A recurrent layer carries a conv ring (its causal conv's last `kernel - 1` inputs) and a recurrent state. Both are
split by head across tensor-parallel ranks exactly as vLLM shards them, so the broker's head resharding (columns
split by head, `handoff_client.protocol.shards`) moves them between TP sizes as it moves attention heads. Neither is
positional: each is carried whole (at every rank, its heads whole) at every position, and neither can be rewound,
so a contract holding one is not `rewindable` (a producer stops one token short; docs/contracts.md).

Tensors per gated-delta-net layer i (qwen3_next, qwen3_5, qwen3_5_moe), K key heads of k_dim, V value heads of
v_dim, kernel `linear_conv_kernel_dim`; all row-major:

    layers.{i}.linear_attn.conv_q   (kernel-1, K·k_dim)   heads K of k_dim     conv channels [0, K·k_dim)
    layers.{i}.linear_attn.conv_k   (kernel-1, K·k_dim)   heads K of k_dim     conv channels [K·k_dim, 2·K·k_dim)
    layers.{i}.linear_attn.conv_v   (kernel-1, V·v_dim)   heads V of v_dim     conv channels [2·K·k_dim, conv_dim)
    layers.{i}.linear_attn.memory   (k_dim, V·v_dim)      heads V of v_dim     memory[a, h·v_dim + b] = S_h[a, b]

A conv tensor's rows are the kept inputs in time order, as vLLM's SD conv state `(kernel-1, conv_dim)` keeps them, its
columns [Q | K | V] cut into three tensors (vLLM's DS layout is its transpose). S_h is value head h's recurrent state in
transformers' orientation `(k_dim, v_dim)` (`recurrent_state[b, h]`); vLLM keeps it transposed per head, `(V/tp, v_dim,
k_dim)`, so vLLM's `ssm[h, b, a]` is `memory[a, h·v_dim + b]`.

Tensors per Mamba2 layer i (nemotron_h, granitemoehybrid, falcon_h1), H heads of head_dim P, G groups of state N:

    layers.{i}.mamba.conv_x   (kernel-1, H·P)   heads H of P    conv channels [0, H·P)              (x)
    layers.{i}.mamba.conv_b   (kernel-1, G·N)   heads G of N    conv channels [H·P, H·P + G·N)      (B)
    layers.{i}.mamba.conv_c   (kernel-1, G·N)   heads G of N    conv channels [H·P + G·N, conv_dim) (C)
    layers.{i}.mamba.ssm      (P, H·N)          heads H of N    ssm[p, h·N + n] = state[h, p, n]

vLLM's Mamba2 state is `(H/tp, P, N)` (mamba_utils.mamba2_state_shape), so its `ssm[h, p, n]` is `ssm[p, h·N + n]`
here. With one group and several ranks, every rank holds the group whole (vLLM's `extra_groups_for_head_shards`),
which is the contract's replicated head (a head count that divides the TP size).

At TP size t, rank r holds of each tensor the heads `protocol.shards.held_heads` names (r·H/t up to (r+1)·H/t, or head
r·H/t replicated when H < t): the per-rank conv state is vLLM's [Q_r | K_r | V_r] (or [x_r | B_r | C_r]) and the
per-rank recurrent state vLLM's `(H/t, ...)`, so the rank's own pages convert without another rank's bytes.
"""

from __future__ import annotations

from ._config_fields import ConfigError, Layers, attention, positive_int


def _kernel_rows(config: dict, key: str, model_type: str) -> int:
    kernel = positive_int(config, key, model_type)
    if kernel < 2:
        raise ConfigError(f"config.json of `{model_type}`: `{key}` {kernel} keeps no conv ring")
    return kernel - 1


def gated_delta(layers: Layers, config: dict, model_type: str, layer: int) -> None:
    """One gated-delta-net layer's conv ring (three tensors: q, k, v) and recurrent memory, as the module docstring
    lays them out. transformers models/qwen3_next/modeling_qwen3_next.py (Qwen3NextGatedDeltaNet): conv_dim =
    2·key_dim + value_dim, channels [q | k | v]; recurrent state (V, k_dim, v_dim) per sequence."""
    k_heads = positive_int(config, "linear_num_key_heads", model_type)
    v_heads = positive_int(config, "linear_num_value_heads", model_type)
    k_dim = positive_int(config, "linear_key_head_dim", model_type)
    v_dim = positive_int(config, "linear_value_head_dim", model_type)
    rows = _kernel_rows(config, "linear_conv_kernel_dim", model_type)
    if v_heads % k_heads:
        raise ConfigError(
            f"config.json of `{model_type}`: {v_heads} linear value heads are not a multiple of {k_heads} key heads"
        )
    conv, state = layers.options.conv_dtype, layers.options.state_dtype
    name = f"layers.{layer}.linear_attn"
    layers.state(f"{name}.conv_q", layer, rows, k_heads * k_dim, conv, k_heads, k_dim)
    layers.state(f"{name}.conv_k", layer, rows, k_heads * k_dim, conv, k_heads, k_dim)
    layers.state(f"{name}.conv_v", layer, rows, v_heads * v_dim, conv, v_heads, v_dim)
    layers.state(f"{name}.memory", layer, k_dim, v_heads * v_dim, state, v_heads, v_dim)


def _gdn_types(config: dict, model_type: str) -> list[str]:
    """Layer i is linear_attention when (i + 1) % full_attention_interval (default 4), else full_attention, or
    `layer_types` as written (transformers configuration_qwen3_next.py, configuration_qwen3_5.py)."""
    n = positive_int(config, "num_hidden_layers", model_type)
    types = config.get("layer_types")
    if types is None:
        interval = positive_int({"i": config.get("full_attention_interval", 4)}, "i", model_type)
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"config.json of `{model_type}`: `layer_types` must list all {n} layers")
    return types


def qwen3_next(config: dict, model_type: str, layers: Layers) -> None:
    """Qwen3-Next and Qwen3.5 (dense and MoE; the text config): gated-delta-net layers, with a full-attention layer
    every `full_attention_interval`. Full-attention layers: key and value caches, num_key_value_heads x head_dim.
    The multi-token-prediction layers (`mtp_num_hidden_layers`) are not decode-step layers."""
    for i, kind in enumerate(_gdn_types(config, model_type)):
        if kind == "linear_attention":
            gated_delta(layers, config, model_type, i)
        elif kind == "full_attention":
            attention(layers, config, model_type, i)
        else:
            raise ConfigError(f"config.json of `{model_type}`: layer {i} is `{kind}`, which this model_type lacks")


def mamba2(layers: Layers, model_type: str, layer: int, heads: int, head_dim: int, groups: int, state: int,
           rows: int) -> None:  # fmt: skip
    """One Mamba2 layer's conv ring (three tensors: x, B, C) and SSM state, as the module docstring lays them out.
    transformers models/mamba2/modeling_mamba2.py: conv_dim = intermediate + 2·n_groups·state_size, channels
    [x | B | C]; ssm_states (heads, head_dim, state_size)."""
    if heads % groups:
        raise ConfigError(f"config.json of `{model_type}`: {heads} Mamba heads are not a multiple of {groups} groups")
    conv, ssm = layers.options.conv_dtype, layers.options.state_dtype
    name = f"layers.{layer}.mamba"
    layers.state(f"{name}.conv_x", layer, rows, heads * head_dim, conv, heads, head_dim)
    layers.state(f"{name}.conv_b", layer, rows, groups * state, conv, groups, state)
    layers.state(f"{name}.conv_c", layer, rows, groups * state, conv, groups, state)
    layers.state(f"{name}.ssm", layer, head_dim, heads * state, ssm, heads, state)


def _mamba_head_dim(config: dict, model_type: str, heads: int, intermediate: int) -> int:
    """`mamba_d_head` as the config gives it ("auto": intermediate / heads), checked against the intermediate size
    vLLM sizes the conv ring by: heads x head_dim must make it."""
    value = config.get("mamba_d_head", "auto")
    width = intermediate // heads if value == "auto" else positive_int(config, "mamba_d_head", model_type)
    if width * heads != intermediate:
        raise ConfigError(
            f"config.json of `{model_type}`: {heads} Mamba heads x mamba_d_head {width} do not make the intermediate "
            f"size {intermediate}"
        )
    return width


_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' remap_legacy_layer_types


def _listed_types(config: dict, model_type: str, key: str) -> list[str]:
    types = config.get(key)
    if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"config.json of `{model_type}`: `{key}` must be a list of layer types, got {types!r}")
    return [_LEGACY.get(t, t) for t in types]


def nemotron_h(config: dict, model_type: str, layers: Layers) -> None:
    """NVIDIA Nemotron-H: Mamba2, attention and MLP/MoE layers as `hybrid_override_pattern` spells them ("M" Mamba2,
    "*" attention, "-" MLP, "E" MoE) or `layers_block_type` lists them. transformers
    models/nemotron_h/configuration_nemotron_h.py, modeling_nemotron_h.py (NemotronHMamba2Mixer: intermediate =
    mamba_num_heads x mamba_head_dim; n_groups, ssm_state_size, conv_kernel; legacy mamba_n_groups, mamba_d_conv);
    vLLM models/nemotron_h.py. Attention layers: num_key_value_heads x head_dim."""
    pattern = config.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        if bad := sorted(set(pattern) - _PATTERN.keys()):
            raise ConfigError(f"config.json of `{model_type}`: `hybrid_override_pattern` has {bad[0]!r}")
        types = [_PATTERN[c] for c in pattern]
    else:
        types = _listed_types(
            config, model_type, "layers_block_type" if "layers_block_type" in config else "layer_types"
        )
    if config.get("num_hidden_layers") is not None and config["num_hidden_layers"] != len(types):
        raise ConfigError(f"config.json of `{model_type}`: num_hidden_layers {config['num_hidden_layers']!r} but the "
                          f"layer pattern lists {len(types)} layers")  # fmt: skip
    if config.get("sliding_window") is not None:
        raise ConfigError(f"config.json of `{model_type}`: a sliding window on Nemotron-H layers is not supported")
    heads = positive_int(config, "mamba_num_heads", model_type)
    head_dim = positive_int(config, "mamba_head_dim", model_type)
    groups = positive_int(config, "n_groups" if "n_groups" in config else "mamba_n_groups", model_type)
    state = positive_int(config, "ssm_state_size", model_type)
    rows = _kernel_rows(config, "conv_kernel" if "conv_kernel" in config else "mamba_d_conv", model_type)
    for i, kind in enumerate(types):
        if kind == "linear_attention":
            mamba2(layers, model_type, i, heads, head_dim, groups, state, rows)
        elif kind == "full_attention":
            attention(layers, config, model_type, i)
        elif kind not in ("mlp", "moe"):
            raise ConfigError(f"config.json of `{model_type}`: layer {i} is `{kind}`, which this model_type lacks")


def _mamba_fields(config: dict, model_type: str, intermediate: int) -> tuple[int, int, int, int, int]:
    heads = positive_int(config, "mamba_n_heads", model_type)
    return (
        heads,
        _mamba_head_dim(config, model_type, heads, intermediate),
        positive_int(config, "mamba_n_groups", model_type),
        positive_int(config, "mamba_d_state", model_type),
        _kernel_rows(config, "mamba_d_conv", model_type),
    )


def granitemoehybrid(config: dict, model_type: str, layers: Layers) -> None:
    """IBM Granite 4.0 hybrids: Mamba2 or attention per layer as `layer_types` lists them ("mamba"/"attention", or
    linear_attention/full_attention; all Mamba2 when absent). transformers
    models/granitemoehybrid/configuration_granitemoehybrid.py (intermediate = mamba_expand x hidden_size, which
    vLLM models/granitemoehybrid.py sizes the conv ring by). Attention layers: num_key_value_heads x
    hidden_size / num_attention_heads."""
    n = positive_int(config, "num_hidden_layers", model_type)
    types = (
        ["linear_attention"] * n
        if config.get("layer_types") is None
        else _listed_types(config, model_type, "layer_types")
    )
    if len(types) != n:
        raise ConfigError(f"config.json of `{model_type}`: `layer_types` must list all {n} layers")
    intermediate = positive_int(config, "mamba_expand", model_type) * positive_int(config, "hidden_size", model_type)
    fields = _mamba_fields(config, model_type, intermediate)
    for i, kind in enumerate(types):
        if kind == "linear_attention":
            mamba2(layers, model_type, i, *fields)
        elif kind == "full_attention":
            attention(layers, config, model_type, i)
        else:
            raise ConfigError(f"config.json of `{model_type}`: layer {i} is `{kind}`, which this model_type lacks")


def falcon_h1(config: dict, model_type: str, layers: Layers) -> None:
    """TII Falcon-H1: every layer runs a Mamba2 mixer and attention side by side, the mixer first
    (transformers models/falcon_h1/modeling_falcon_h1.py, FalconH1DecoderLayer). Intermediate = mamba_d_ssm, or
    mamba_expand x hidden_size without it (configuration_falcon_h1.py; vLLM models/falcon_h1.py). Attention:
    num_key_value_heads x head_dim (hidden_size / num_attention_heads without it)."""
    n = positive_int(config, "num_hidden_layers", model_type)
    if config.get("mamba_d_ssm") is not None:
        intermediate = positive_int(config, "mamba_d_ssm", model_type)
    else:
        intermediate = positive_int(config, "mamba_expand", model_type) * positive_int(
            config, "hidden_size", model_type
        )
    fields = _mamba_fields(config, model_type, intermediate)
    for i in range(n):
        mamba2(layers, model_type, i, *fields)
        attention(layers, config, model_type, i)
