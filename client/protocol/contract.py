"""A model's contract, and the rules a hand-off must meet to be one of its hand-offs.

This is the design card's `Contract`, `Carried`, `Handoff` and `check`, kept to the letter: a hand-off is refused,
by name, when it carries a tensor the contract does not (UnknownTensor), leaves one out (MissingTensor), holds one of
the wrong size (WrongLength), or stands at a position whose next row the cache lacks (PositionOutOfRange). The client
applies these rules to whole arrays before it sends; the broker applies the same rules, chunk by chunk, with
`spans.TensorSpans`, as bytes arrive. One implementation, one set of messages.

Only what the prompt filled: a tensor whose rows are cache positions (`rows_are_positions`: an attention layer's key
or value cache, an MLA latent, a sliding-window ring) holds, after `position` tokens, only min(position, rows) rows
that mean anything. A hand-off carries exactly those: `Contract.at(position)` is the contract as that hand-off must
meet it, each such tensor cut to its filled rows (a `FilledContract`), and "size" in the seed's rules means that
filled size. Row r of a position-indexed tensor holds the token at position p = r while position <= rows; a ring of
`rows` = window rows that has wrapped holds position p at row p mod window (the cyclic layout TensorRT-LLM and
llama.cpp use), so all its rows are filled. Tensors of fixed size (a gated-delta memory, a conv ring, a per-tensor
quantization scale) are carried whole at every position.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from .dtypes import DTYPES, numpy_dtype
from .errors import (
    ManifestError,
    MissingTensor,
    PositionOutOfRange,
    UnknownTensor,
    WrongLayout,
    WrongLength,
)

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
"""What a model name may be: a Hugging Face repo id fits (`meta-llama/Llama-3.1-8B`); no spaces or control bytes."""


OPTIONAL_FIELDS = frozenset({"heads", "head_dim", "rows_are_positions"})
"""Fields of a carried tensor a manifest may leave out: a tensor without heads is not split across TP ranks; one
without `rows_are_positions` (or with it false) is carried whole at every position."""


@dataclass(frozen=True)
class Carried:
    """One tensor a decode step carries: its name, its layer, its declared shape and element type, and how its
    columns split into attention heads across tensor-parallel ranks (`heads` = 0: not split, every rank holds it
    whole; see handoff_client/protocol/shards.py)."""

    name: str
    layer: int
    rows: int
    cols: int
    dtype: str
    heads: int = 0
    head_dim: int = 0
    rows_are_positions: bool = False
    """Row r holds the cache entry of token position r (mod `rows`, for a sliding-window ring of `rows` rows): a
    hand-off after `position` tokens carries only its min(position, rows) filled rows."""
    cache_rows: int = 0
    """In a hand-off's filled view (`filled`, `Contract.at`): the rows the contract declares, of which `rows` are
    the filled ones. 0 in the contract itself."""

    @property
    def numpy_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)

    def filled(self, position: int) -> Carried:
        """This tensor as a hand-off after `position` tokens carries it: its first min(position, rows) rows when
        its rows are positions, else itself."""
        if not self.rows_are_positions or position >= self.rows:
            return self
        return replace(self, rows=position, cache_rows=self.rows)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def values(self) -> int:
        return self.rows * self.cols

    @cached_property
    def nbytes(self) -> int:
        return self.values * self.numpy_dtype.itemsize

    def filled_note(self) -> str:
        """What WrongLength says of a want that is a filled size: the rows the position filled, of those declared."""
        if not self.cache_rows:
            return ""
        return f"the {self.rows} rows {self.rows} tokens filled of its {self.cache_rows}"

    def layout(self) -> str:
        if self.cache_rows:
            return f"({self.rows}, {self.cols}) {self.dtype}, the filled rows of its ({self.cache_rows}, {self.cols})"
        return f"({self.rows}, {self.cols}) {self.dtype}"


@dataclass(frozen=True)
class Handoff:
    """A prompt's state after `position` tokens: each carried tensor's values by name, shaped as declared."""

    position: int
    state: Mapping[str, np.ndarray]  # a dict; while a push is still making them, a CheckedState


@dataclass(frozen=True)
class Contract:
    """The state a model's decode step carries over a cache of `ctx` positions, layer by layer."""

    model: str
    ctx: int
    hidden: int
    carried: tuple[Carried, ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {c.name: i for i, c in enumerate(self.carried)})

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of everything the contract states: equal fingerprints, equal contracts."""
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def rewindable(self) -> bool:
        """Whether a hand-off after `position` tokens may be loaded by a decoder that runs token `position - 1`
        again (vLLM's always does: it computes the prompt's last token itself). True only when every tensor's rows
        are positions over the whole cache (rows = ctx): running a token again rewrites its row with the same
        values. A tensor whose rows are not positions (a conv ring, a recurrent memory; a per-tensor scale, which
        the contract cannot tell from one) may be a state each token updates in place, and a ring that wraps before
        the cache ends (rows < ctx - 1) has overwritten, by position N > rows, the row that token's window reads:
        neither can be rewound. The producer of a contract that is not rewindable stops one token short and pushes
        the state after N - 1 of a prompt's N tokens (position N - 1); the decoder computes token N - 1 itself
        (docs/contracts.md, the last-token rule)."""
        return all(c.rows_are_positions and (c.cache_rows or c.rows) >= self.ctx - 1 for c in self.carried)

    @cached_property
    def nbytes(self) -> int:
        """Bytes of one hand-off: what a push reserves."""
        return sum(c.nbytes for c in self.carried)

    def index(self, name: str, given: Collection[str] = ()) -> int:
        """The position of `name` in contract order; UnknownTensor if the contract does not carry it, naming the
        carried tensor it resembles that the names `given` with it lack (a misspelling)."""
        try:
            return self._index[name]
        except KeyError:
            like = difflib.get_close_matches(name, [c.name for c in self.carried if c.name not in given], 1)
            raise UnknownTensor(self.model, name, *(like if given else ())) from None

    def tensor(self, name: str) -> Carried:
        return self.carried[self.index(name)]

    def of_layer(self, layer: int) -> Iterator[Carried]:
        """The carried tensors of layer `layer`."""
        return (c for c in self.carried if c.layer == layer)

    def check_position(self, position: int) -> None:
        """A decode after `position` tokens writes row `position` (rows counted from 0), so the cache must have it:
        position < ctx."""
        if position >= self.ctx:
            raise PositionOutOfRange(self.model, position, self.ctx)

    def at(self, position: int) -> Contract:
        """The contract as a hand-off after `position` tokens must meet it: each tensor whose rows are positions
        cut to the rows those tokens filled (a FilledContract, with this contract's fingerprint); the contract
        itself when nothing is cut. PositionOutOfRange when position >= ctx."""
        self.check_position(position)
        carried = tuple(c.filled(position) for c in self.carried)
        if carried == self.carried:
            return self
        return FilledContract(self.model, self.ctx, self.hidden, carried, declared=self)

    def check(self, handoff: Handoff) -> None:
        """Whether `handoff` is this contract's: every carried tensor, as declared, nothing else, a next row."""
        for name in sorted(handoff.state):
            self.index(name, handoff.state)
        if missing := [c.name for c in self.carried if c.name not in handoff.state]:
            raise MissingTensor(self.model, *missing)
        for carried in self.carried:
            check_array(self.model, carried, handoff.state[carried.name])
        self.check_position(handoff.position)

    def take(self, position: int, tensors: Mapping[str, np.ndarray], *, drop_extra: bool = True) -> Handoff:
        """The hand-off a run leaves after `position` tokens: the carried tensors out of `tensors`, checked.

        Tensors the contract does not carry are left behind, as the design card's `take` does; `drop_extra=False`
        refuses the first by name, as `check` does (a client's push, unless its caller opts in to dropping them).
        """
        for name in [] if drop_extra else sorted(tensors):
            self.index(name, tensors)
        if missing := [c.name for c in self.carried if c.name not in tensors]:
            raise MissingTensor(self.model, *missing)
        state = {c.name: tensors[c.name] for c in self.carried}
        handoff = Handoff(position, state)
        self.check(handoff)
        return handoff

    def to_json(self) -> dict:
        """The contract as a manifest states it (the canonical form its fingerprint hashes)."""
        return {
            "model": self.model,
            "ctx": self.ctx,
            "hidden": self.hidden,
            "carried": [_carried_json(c) for c in self.carried],
        }

    @classmethod
    def from_json(cls, data: object, source: str = "<manifest>") -> Contract:
        """The contract a manifest states; ManifestError naming `source` and the field for anything amiss."""
        return _parse_manifest(data, source)

    @classmethod
    def load(cls, path: Path) -> Contract:
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"{path}: not a readable JSON manifest: {e}") from None
        return _parse_manifest(data, str(path))


@dataclass(frozen=True)
class FilledContract(Contract):
    """A contract as one hand-off after `position` tokens meets it (`Contract.at`): the same names, each tensor
    whose rows are positions at its filled rows, and the declared contract's fingerprint. Pushes are checked, bytes
    reserved and pulls shaped against it."""

    declared: Contract = field(repr=False, compare=False, default=None)  # type: ignore[assignment]

    @property
    def fingerprint(self) -> str:  # type: ignore[override]
        return self.declared.fingerprint

    @property
    def rewindable(self) -> bool:
        return self.declared.rewindable

    def at(self, position: int) -> Contract:
        return self.declared.at(position)


def _carried_json(c: Carried) -> dict:
    entry: dict = {"name": c.name, "layer": c.layer, "rows": c.rows, "cols": c.cols, "dtype": c.dtype}
    if c.heads:  # only when stated, so a contract without heads keeps the fingerprint it always had
        entry.update(heads=c.heads, head_dim=c.head_dim)
    if c.rows_are_positions:  # likewise: a manifest without the marker keeps its fingerprint
        entry.update(rows_are_positions=True)
    return entry


def differences(first: Contract, second: Contract, names: tuple[str, str] = ("broker", "caller")) -> list[str]:
    """What differs between two contracts, for a person, over exactly what the fingerprint hashes (their manifests):
    each field that differs with both values (`names` says whose) and the tensors it differs in, in contract order,
    one entry for a field that differs the same way in many tensors (a state dtype in every recurrent layer); the
    tensors only one of them carries; their order. Empty for equal contracts."""
    one, two = first.to_json(), second.to_json()
    found: dict[tuple[str, str, str], list[str]] = {}
    for key in ("model", "ctx", "hidden"):
        if one[key] != two[key]:
            found[(key, str(one[key]), str(two[key]))] = []
    tensors = [{c["name"]: c for c in contract["carried"]} for contract in (one, two)]
    common = [name for name in tensors[0] if name in tensors[1]]
    for name in common:
        a, b = tensors[0][name], tensors[1][name]
        for key in (key for key in {**a, **b} if a.get(key) != b.get(key)):
            found.setdefault((key, str(a.get(key, "-")), str(b.get(key, "-"))), []).append(name)
    out = []
    for (key, a, b), where in found.items():
        shown = ", ".join(f"`{name}`" for name in where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        out.append(f"{key} {a} at the {names[0]}, {b} at the {names[1]}" + (f" ({shown})" if where else ""))
    for mine, theirs, whose in ((0, 1, names[0]), (1, 0, names[1])):
        if only := [name for name in tensors[mine] if name not in tensors[theirs]]:
            out.append(f"{len(only)} tensor(s) only at the {whose} (`{only[0]}`{', ...' if len(only) > 1 else ''})")
    if common != [name for name in tensors[1] if name in tensors[0]]:
        out.append("the order of the tensors")
    return out


def cut_to_filled(contract: Contract, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` with every array given at its tensor's declared rows, where the hand-off carries fewer, cut to its
    filled rows (a view, no copy): a prefill worker may pass its whole cache arrays, and only the filled rows are
    sent. Arrays of any other shape are left for the contract's checks."""
    out = dict(tensors)
    for carried in contract.carried:
        if carried.name in out:
            out[carried.name] = filled_rows(carried, out[carried.name])
    return out


def filled_rows(carried: Carried, array: object) -> object:
    """`array`, given at `carried`'s declared (cache) rows where the hand-off carries fewer, cut to its filled rows
    (a view); anything else as it is, for the contract's checks."""
    if carried.cache_rows and isinstance(array, np.ndarray) and array.shape == (carried.cache_rows, carried.cols):
        return array[: carried.rows]
    return array


def check_array(model: str, carried: Carried, array: np.ndarray) -> None:
    """An array stands for `carried` only at its declared size, shape and dtype: nothing is cast or reshaped."""
    if not isinstance(array, np.ndarray):
        raise WrongLayout(model, carried.name, carried.layout(), f"a {type(array).__name__}, not a numpy array")
    if array.size != carried.values:
        itemsize = carried.numpy_dtype.itemsize
        raise WrongLength(
            model, carried.name, carried.values, array.size * itemsize, carried.dtype, itemsize, carried.filled_note()
        )
    if array.shape != carried.shape or array.dtype != carried.numpy_dtype:
        raise WrongLayout(model, carried.name, carried.layout(), f"{array.shape} {array.dtype}")


def _parse_manifest(data: object, source: str) -> Contract:
    def fail(where: str, why: str) -> ManifestError:
        return ManifestError(f"{source}: {where}: {why}")

    def expect_int(obj: dict, key: str, where: str, least: int) -> int:
        value = obj.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise fail(where, f"must be an integer >= {least}, got {value!r}")
        return value

    def expect_keys(obj: object, where: str, keys: set[str]) -> dict:
        if not isinstance(obj, dict):
            raise fail(where, f"must be a JSON object, got {type(obj).__name__}")
        if missing := sorted(keys - obj.keys() - OPTIONAL_FIELDS):
            raise fail(where, f"lacks {', '.join(missing)}")
        if extra := sorted(obj.keys() - keys):
            raise fail(f"{where}.{extra[0]}", f"is not a contract field (fields: {', '.join(sorted(keys))})")
        return obj

    top = expect_keys(data, "manifest", {"model", "ctx", "hidden", "carried"})
    model = top["model"]
    if not isinstance(model, str) or not MODEL_NAME.fullmatch(model):
        raise fail("model", f"must be a name of letters, digits and ._:/@+- (at most 128), got {model!r}")
    ctx = expect_int(top, "ctx", "ctx", 1)
    hidden = expect_int(top, "hidden", "hidden", 1)
    entries = top["carried"]
    if not isinstance(entries, list) or not entries:
        raise fail("carried", "must be a non-empty list of carried tensors")
    carried: list[Carried] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"carried[{i}]"
        entry = expect_keys(
            entry, where, {"name", "layer", "rows", "cols", "dtype", "heads", "head_dim", "rows_are_positions"}
        )
        name = entry["name"]
        if not isinstance(name, str) or not name or len(name) > 256:
            raise fail(f"{where}.name", f"must be a non-empty string of at most 256 characters, got {name!r}")
        if name in seen:
            raise fail(f"{where}.name", f"`{name}` is declared twice; a contract lists each carried tensor once")
        seen.add(name)
        layer = expect_int(entry, "layer", f"{where}.layer", 0)
        if carried and layer < carried[-1].layer:
            raise fail(f"{where}.layer", f"{layer} comes after layer {carried[-1].layer}; list tensors in layer order")
        rows = expect_int(entry, "rows", f"{where}.rows", 1)
        cols = expect_int(entry, "cols", f"{where}.cols", 1)
        dtype = entry["dtype"]
        if dtype not in DTYPES:
            raise fail(f"{where}.dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
        heads = head_dim = 0
        if "heads" in entry or "head_dim" in entry:
            heads = expect_int(entry, "heads", f"{where}.heads", 1)
            head_dim = expect_int(entry, "head_dim", f"{where}.head_dim", 1)
            if heads * head_dim != cols:
                raise fail(f"{where}.heads", f"{heads} heads x head_dim {head_dim} must make its {cols} columns")
        positional = entry.get("rows_are_positions", False)
        if not isinstance(positional, bool):
            raise fail(f"{where}.rows_are_positions", f"must be true or false, got {positional!r}")
        carried.append(Carried(name, layer, rows, cols, dtype, heads, head_dim, positional))
    return Contract(model, ctx, hidden, tuple(carried))
