"""Which of vLLM's KV-cache groups, which layer and which kind of page each carried contract tensor lives in.

vLLM 0.32 with its hybrid KV-cache manager (HMA: the connector is `SupportsHMA`) splits a model's layers into
KV-cache groups (`KVCacheConfig.kv_cache_groups`, handed to the connector's constructor in both roles), each with
its own block table: every block id the scheduler gives is a tuple with one list per group, and a block id means
something only within its group (HMA lays all groups over one buffer). Block id 0 is vLLM's null block: a sliding
window's blocks wholly before the window are replaced by it. A tiny Qwen3-Next (3 gated-delta layers, 1 attention
layer) has 4 groups, and group 0 is a Mamba group: "the" attention blocks are no longer `block_ids[0]`.

`group_map` learns, from the engine's own specs, each layer's group and kind, and checks it against the contract:

    ATTENTION  FullAttentionSpec                 key and value caches of ctx rows (rows are positions)
    WINDOW     SlidingWindowSpec, or a FullAttentionSpec with a sliding_window (HMA off): key and value rings of
               min(window - 1, ctx) rows, row p mod rows holding position p (handoff_client._config_fields.ring_rows)
    STATE      MambaSpec (gated-delta-net, Mamba2)   conv tensors and one recurrent state, one state block per
               request (mamba_cache_mode "none"), the last of its group's block ids
    LATENT     MLAAttentionSpec (DeepSeek-V2/V3, Kimi-K2)   one `kv_latent` of ctx rows, kv_lora_rank +
               qk_rope_head_dim wide (rows are positions): _mla_pages

Invariants of a `GroupMap`: every carried tensor of the contract (the rank's view under tensor parallelism) belongs
to exactly one layer, every layer of a group that carries anything belongs to one group, and each layer's tensors
fit its kind (names, rows, dtypes). Whatever does not is refused with `UnsupportedGroups`, naming the layer or the
tensor and both sides' values: a tensor written to the wrong group's pages is wrong tokens.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from handoff_client._handoff_rules import window_rows
from handoff_client.protocol.contract import Carried, Contract

LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
FALCON_H1_MIXER = re.compile(r"^model\.(\d+)\.mixer$")
"""vLLM's Falcon-H1 (models/falcon_h1.py) names decoder layer i's Mamba2 mixer `model.{L + i}.mixer`, L the decoder
layers, so that "all attention/ssm layers have different index in prefix"; its attention is `model.layers.{i}...`."""
NULL_BLOCK = 0
"""vLLM's null block id: a placeholder in a block table, never a page of the request's own."""

BlockIds = tuple[tuple[int, ...], ...]
"""A request's block ids, one tuple per KV-cache group, indexed like `kv_cache_groups`."""


class UnsupportedGroups(ValueError):
    """vLLM's KV-cache groups and the contract do not fit together; the message names the layer or tensor."""


class Kind(enum.Enum):
    ATTENTION = "attention"
    WINDOW = "sliding-window attention"
    STATE = "recurrent state"
    LATENT = "latent attention (MLA)"


@dataclass(frozen=True)
class LayerPlan:
    """One vLLM layer: its group, its kind, and the contract tensors its pages hold (key then value, or the conv
    tensors then the recurrent state, in contract order)."""

    layer: str
    group: int
    kind: Kind
    block_size: int
    tensors: tuple[Carried, ...]
    window: int | None = None  # WINDOW: vLLM's sliding window, in tokens
    spec: Any = None  # vLLM's KVCacheSpec of the layer

    @property
    def ring_rows(self) -> int:
        """WINDOW: the rows the contract's ring keeps (min(window - 1, ctx)); else the cache's rows."""
        return self.tensors[0].rows

    def first_row(self, rows: int) -> int:
        """The first position of `rows` filled positions this layer carries: a window's ring keeps the last
        ring_rows of them (handoff_client._handoff_rules.window_rows), every other layer all (a state layer has no
        positions: 0)."""
        return window_rows(rows, self.ring_rows)[0] if self.kind is Kind.WINDOW else 0


@dataclass(frozen=True)
class GroupMap:
    """Every carried layer's plan, by vLLM layer name; see the module docstring for its invariants."""

    layers: dict[str, LayerPlan]
    groups: int  # how many KV-cache groups the engine has

    @property
    def layer_of(self) -> dict[str, str]:
        """The contract's tensor name -> its vLLM layer."""
        return {t.name: plan.layer for plan in self.layers.values() for t in plan.tensors}

    @property
    def written_groups(self) -> tuple[int, ...]:
        """The groups a load writes (every group holding a carried layer). Not named to vLLM as loaded: a load
        writes only the hand-off's rows, so vLLM zeroes the fresh blocks first (HandoffConnector's
        `get_loaded_kv_cache_group_ids`)."""
        return tuple(sorted({plan.group for plan in self.layers.values()}))

    @property
    def has_windows(self) -> bool:
        return any(plan.kind is Kind.WINDOW for plan in self.layers.values())

    @property
    def has_state(self) -> bool:
        return any(plan.kind is Kind.STATE for plan in self.layers.values())


def per_group(block_ids: Sequence[Sequence[int]] | Sequence[int], groups: int) -> BlockIds:
    """vLLM's block ids as one tuple per group: a tuple of lists as the HMA scheduler gives them, or one flat list
    (`request_finished` of an engine with one group, HMA off). Refuses (UnsupportedGroups) a count of groups other
    than the engine's."""
    if block_ids and not isinstance(block_ids[0], (list, tuple)):
        block_ids = (block_ids,)  # type: ignore[assignment]
    out = tuple(tuple(int(b) for b in blocks) for blocks in block_ids)  # type: ignore[union-attr]
    if len(out) != groups:
        raise UnsupportedGroups(f"vLLM gave block ids for {len(out)} KV-cache groups, the engine has {groups}")
    return out


def extend(blocks: BlockIds | None, new: Sequence[Sequence[int] | None] | None) -> BlockIds | None:
    """`blocks` with a step's newly allocated block ids (one list per group, or None for none) appended per group."""
    if new is None or blocks is None:
        return blocks
    return tuple(own + tuple(more or ()) for own, more in zip(blocks, new, strict=True))


def state_block(plan: LayerPlan, blocks: Sequence[int]) -> int:
    """The request's state block of a STATE layer: the last of its group's block ids (with mamba_cache_mode "none"
    the request holds exactly one; speculative scratch slots are refused at start-up)."""
    if not blocks or blocks[-1] == NULL_BLOCK:
        raise UnsupportedGroups(f"{plan.layer}: the request holds no state block in KV-cache group {plan.group} "
                                f"(block ids {list(blocks)})")  # fmt: skip
    return blocks[-1]


def check_rows_held(plan: LayerPlan, blocks: Sequence[int], first: int, end: int) -> None:
    """Positions [first, end) of `plan`'s layer must lie in the request's own blocks, none in the null block: a
    window's skipped prefix is never read or written."""
    if end <= first:
        return
    lo, hi = first // plan.block_size, (end - 1) // plan.block_size
    if hi >= len(blocks) or NULL_BLOCK in blocks[lo : hi + 1]:
        raise UnsupportedGroups(f"{plan.layer}: positions [{first}, {end}) are not all in the request's blocks of "
                                f"KV-cache group {plan.group} ({list(blocks)}, block {plan.block_size})")  # fmt: skip


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _layer_specs(group: Any) -> dict[str, Any]:
    """Each layer of a KV-cache group with its own spec (a UniformTypeKVCacheSpecs holds one per layer)."""
    spec = group.kv_cache_spec
    own = getattr(spec, "kv_cache_specs", None)
    return {name: (own[name] if own else spec) for name in group.layer_names}


def _plan(name: str, group: int, spec: Any, tensors: list[Carried], contract: Contract,
          windows: Mapping[str, int | None] | None) -> LayerPlan:  # fmt: skip
    """One layer's plan, its tensors checked against vLLM's spec of it."""
    kind_name = type(spec).__name__
    where = f"{contract.model}: vLLM layer `{name}` (KV-cache group {group}, {kind_name})"
    names = [t.name for t in tensors]
    if _is_state_spec(spec):
        if any(t.rows_are_positions for t in tensors) or len(tensors) < 2:
            raise UnsupportedGroups(f"{where} holds recurrent state; the contract gives it {names}")
        conv = [t for t in tensors if t is not tensors[-1]]
        dtypes = [_dtype_name(d) for d in spec.dtypes]
        for t, want in [*((t, dtypes[0]) for t in conv), (tensors[-1], dtypes[-1])]:
            if t.dtype != want:
                raise UnsupportedGroups(f"{where}: the contract's `{t.name}` is {t.dtype}, vLLM keeps that state in "
                                        f"{want} (its resolved mamba cache dtypes {dtypes}): serve the contract in "
                                        "the engine's dtypes")  # fmt: skip
        return LayerPlan(name, group, Kind.STATE, spec.block_size, tuple(tensors), spec=spec)
    if kind_name == "MLAAttentionSpec":
        return _latent_plan(where, name, group, spec, tensors, contract)
    if not hasattr(spec, "num_kv_heads") or type(spec).__name__.startswith(("MLA", "SlidingWindowMLA")):
        raise UnsupportedGroups(f"{where}: the connector carries attention key/value caches and recurrent state "
                                f"pages, not {kind_name} pages")  # fmt: skip
    keys = [t for t in tensors if t.name.endswith("k_cache")]
    values = [t for t in tensors if t.name.endswith("v_cache")]
    if len(keys) != 1 or len(values) != 1 or len(tensors) != 2:
        raise UnsupportedGroups(f"{where} holds keys and values; the contract gives it {names}")
    window = getattr(spec, "sliding_window", None)
    if windows is not None and name in windows:
        window = windows[name]  # the layer's own (HMA off: one group whose spec merges every layer's window)
    elif window is not None and type(spec).__name__ == "FullAttentionSpec" and keys[0].rows == contract.ctx:
        window = None  # a merged group's window is its window layers'; the worker checks each layer's own
    want = contract.ctx if window is None else min(window - 1, contract.ctx)
    for t in (keys[0], values[0]):
        if not t.rows_are_positions or t.rows != want:
            what = "a cache of ctx" if window is None else f"a ring of min(window {window} - 1, ctx)"
            raise UnsupportedGroups(f"{where}: the contract's `{t.name}` has {t.rows} rows, vLLM's layer keeps "
                                    f"{what} = {want}")  # fmt: skip
    kind = Kind.ATTENTION if window is None else Kind.WINDOW
    return LayerPlan(name, group, kind, spec.block_size, (keys[0], values[0]), window, spec)


def _latent_plan(where: str, name: str, group: int, spec: Any, tensors: list[Carried], contract: Contract) -> LayerPlan:
    """An MLA layer: one latent per token, as wide as vLLM's one KV head; a compressed or padded latent (DeepSeek-V4:
    several tokens a state, aligned pages) or a quantized one is refused."""
    names = [t.name for t in tensors]
    if len(tensors) != 1 or not tensors[0].name.endswith("kv_latent"):
        raise UnsupportedGroups(f"{where} holds one MLA latent per token; the contract gives it {names}")
    (latent,) = tensors
    if spec.num_kv_heads != 1 or latent.cols != spec.head_size:
        raise UnsupportedGroups(f"{where} keeps {spec.num_kv_heads} latent(s) of {spec.head_size} a token; the "
                                f"contract's `{latent.name}` has {latent.cols} columns")  # fmt: skip
    if not latent.rows_are_positions or latent.rows != contract.ctx:
        raise UnsupportedGroups(f"{where}: the contract's `{latent.name}` has {latent.rows} rows, vLLM's layer keeps a "
                                f"latent of ctx = {contract.ctx}")  # fmt: skip
    odd = {what: getattr(spec, what, None) for what in ("cache_dtype_str", "alignment", "model_version")}
    odd = {what: value for what, value in odd.items() if value not in (None, "auto")}
    if odd or getattr(spec, "tokens_per_state", 1) != 1:
        raise UnsupportedGroups(f"{where}: an MLA cache with {odd or {'tokens_per_state': spec.tokens_per_state}} "
                                "(quantized, compressed or aligned) is not one the connector carries")  # fmt: skip
    return LayerPlan(name, group, Kind.LATENT, spec.block_size, (latent,), spec=spec)


def group_map(kv_cache_config: Any, contract: Contract, windows: Mapping[str, int | None] | None = None) -> GroupMap:
    """Map every tensor `contract` carries (this rank's view) to its vLLM layer and KV-cache group, from the
    engine's `kv_cache_config` and, where given (the worker, from the layers themselves), each attention layer's own
    sliding window; UnsupportedGroups naming whatever does not fit."""
    by_layer: dict[int, list[Carried]] = {}
    for carried in contract.carried:
        by_layer.setdefault(carried.layer, []).append(carried)
    plans: dict[str, LayerPlan] = {}
    claimed: dict[tuple[int, bool], str] = {}  # (layer index, its state side) -> the vLLM layer
    groups = kv_cache_config.kv_cache_groups
    mixer_offset = _falcon_h1_layers(contract, [name for group in groups for name in group.layer_names], by_layer)
    for g, group in enumerate(groups):
        for name, spec in _layer_specs(group).items():
            layer = _layer_index(name, mixer_offset)
            if layer is None:
                raise UnsupportedGroups(f"{contract.model}: vLLM layer `{name}` names no layer index")
            state = _is_state_spec(spec)
            tensors = _side(by_layer.get(layer, []), state)
            if not tensors:
                raise UnsupportedGroups(f"{contract.model}: vLLM layer `{name}` (KV-cache group {g}) has pages, the "
                                        f"contract carries nothing of layer {layer}")  # fmt: skip
            if (layer, state) in claimed:
                raise UnsupportedGroups(f"{contract.model}: layer {layer} is both vLLM's `{claimed[layer, state]}` "
                                        f"and `{name}`")  # fmt: skip
            if not getattr(group, "enable_kv_transfer", True):
                raise UnsupportedGroups(f"{contract.model}: vLLM layer `{name}` is in KV-cache group {g}, which vLLM "
                                        "does not transfer, but the contract carries it")  # fmt: skip
            claimed[layer, state] = name
            plans[name] = _plan(name, g, spec, tensors, contract, windows)
    held = {t.name for plan in plans.values() for t in plan.tensors}
    if left := [t for t in contract.carried if t.name not in held]:
        names = [t.name for t in by_layer[left[0].layer] if t.name not in held]
        raise UnsupportedGroups(f"{contract.model}: the contract carries {names} of layer {left[0].layer}, which no "
                                "vLLM KV-cache group holds")  # fmt: skip
    return GroupMap(plans, len(groups))


def _falcon_h1_layers(contract: Contract, names: Sequence[str], by_layer: Mapping[int, list[Carried]]) -> int | None:
    """L, the decoder layers of an engine whose Mamba2 mixers vLLM names `model.{L + i}.mixer` (Falcon-H1: one a
    decoder layer, so they are model.L.mixer ... model.{2L - 1}.mixer), read off the engine's own names, not the
    contract's: the names are vLLM's, numbered by its model's config. None without such names. An engine whose L is
    not the contract's layer count is refused naming both counts (before, L was taken from the contract, so against
    a contract of another size a mixer's name was refused as naming no layer index, or read as another layer's)."""
    mixers = sorted(int(m.group(1)) for name in names if (m := FALCON_H1_MIXER.match(name)))
    if not mixers:
        return None
    layers = len(mixers)
    if mixers != list(range(layers, 2 * layers)):
        raise UnsupportedGroups(f"{contract.model}: vLLM's Mamba2 mixers model.{mixers[0]}.mixer ... "
                                f"model.{mixers[-1]}.mixer are not model.L.mixer ... model.{{2L - 1}}.mixer for its "
                                f"{layers} decoder layers (Falcon-H1's naming)")  # fmt: skip
    if layers != (carried := 1 + max(by_layer, default=-1)):
        raise UnsupportedGroups(f"{contract.model}: vLLM's engine has {layers} decoder layers (its Mamba2 mixers are "
                                f"model.{layers}.mixer ... model.{2 * layers - 1}.mixer), the contract carries "
                                f"{carried} layers: they are not the same model")  # fmt: skip
    return layers


def _layer_index(name: str, mixer_offset: int | None) -> int | None:
    """The decoder layer a vLLM layer name belongs to (`...layers.{i}....`, or Falcon-H1's mixer `model.{L + i}.mixer`
    with L = `mixer_offset`, the engine's decoder layers); None when the name says none."""
    if index := LAYER_INDEX.search(name + "."):
        return int(index.group(1))
    if mixer_offset is not None and (mixer := FALCON_H1_MIXER.match(name)):
        return int(mixer.group(1)) - mixer_offset
    return None


def _is_state_spec(spec: Any) -> bool:
    return hasattr(spec, "shapes") and hasattr(spec, "mamba_type")  # a MambaSpec


def _side(tensors: list[Carried], state: bool) -> list[Carried]:
    """A layer index's tensors for one vLLM layer of it: all of them, unless the index holds recurrent state beside
    attention (Falcon-H1: a Mamba2 mixer and attention in one decoder layer, two vLLM layers in two KV-cache groups);
    then the state layer takes the state tensors (not positional, not scales) and the attention layer the rest."""
    is_state = [not t.rows_are_positions and not t.name.endswith(".scale") for t in tensors]
    if all(is_state) or not any(is_state):
        return tensors
    return [t for t, s in zip(tensors, is_state) if s == state]


def engine_state_dtype(kv_cache_config: Any) -> str | None:
    """The recurrent-state dtype vLLM resolved for its Mamba-type layers (`mamba_ssm_cache_dtype`, "auto" made
    concrete: the last of each MambaSpec's dtypes), which the served contract's state tensors must have; None for a
    model without such layers. Layers that disagree are refused."""
    found = {
        _dtype_name(spec.dtypes[-1])
        for group in getattr(kv_cache_config, "kv_cache_groups", ())
        for spec in _layer_specs(group).values()
        if hasattr(spec, "shapes") and hasattr(spec, "mamba_type")
    }
    if len(found) > 1:
        raise UnsupportedGroups(f"vLLM keeps its layers' recurrent states in several dtypes {sorted(found)}")
    return found.pop() if found else None
