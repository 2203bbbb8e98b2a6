"""Tensor-parallel shards of a hand-off: which heads of which tensor each rank holds, pushes and pulls.

A prefill engine at TP size `p` and a decode engine at TP size `d` hold each attention layer's KV heads split
differently. The contract says how: a carried tensor with `heads` (cols = heads × head_dim) is split by head, one
with none is held whole by every rank (an MLA latent). A recurrent layer's conv ring and state are split by head too
(handoff_client._hybrids), so they reshard as attention heads do. For a split tensor of H heads at TP size t:

    t divides H      rank r holds heads [r·H/t, (r+1)·H/t)                   (Megatron column split)
    H divides t      rank r holds head r·H/t, each head by t/H ranks         (vLLM replicates KV heads, GQA)
    neither          refused: ShardLayout names the tensor, the heads and the TP size

A rank's part of a split tensor is the contiguous (rows, its heads × head_dim) array; of a tensor not split, the
whole. A push sends each byte once: a split tensor's heads by the first rank holding them, a tensor not split by
rank 0. A pull receives everything its rank holds. `ShardContract` is a rank's view as a contract (the same names,
its own shapes), so the seed's checks, chunk spans and digests work on a shard exactly as on a whole hand-off, on
both sides; `shard_arrays` cuts whole arrays into a rank's and `join_shards` puts every rank's back together.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .contract import Carried, Contract, Handoff
from .errors import NotInShard, ShardLayout


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of a tensor-parallel engine of `size` ranks; `Shard(0, 1)` is the whole hand-off."""

    rank: int = 0
    size: int = 1

    @property
    def whole(self) -> bool:
        return self.size == 1

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.size}"


WHOLE = Shard()

MAX_TP_SIZE = 256
"""The largest tensor-parallel size a shard may name: past any engine's, and a bound on the per-rank work (plans,
parts) one request can make the broker do."""


def as_shard(model: str, value: Shard | tuple[int, int] | None) -> Shard:
    """A Shard from what a caller passed (`(rank, size)`, a Shard, or None for the whole); ShardLayout if it is not
    a rank of a TP size."""
    if value is None:
        return WHOLE
    shard = value if isinstance(value, Shard) else Shard(*value)
    if shard.size < 1 or not 0 <= shard.rank < shard.size:
        raise ShardLayout(model, f"shard rank {shard.rank} of TP size {shard.size}: a rank must be in [0, size)")
    if shard.size > MAX_TP_SIZE:
        raise ShardLayout(model, f"a TP size of {shard.size} is past the largest the broker takes, {MAX_TP_SIZE}")
    return shard


def held_heads(model: str, carried: Carried, shard: Shard) -> tuple[int, int] | None:
    """The heads [first, end) `shard` holds of `carried`; None when the tensor is not split (held whole)."""
    heads, size = carried.heads, shard.size
    if not heads:
        return None
    if heads % size == 0:
        each = heads // size
        return shard.rank * each, (shard.rank + 1) * each
    if size % heads == 0:
        head = shard.rank * heads // size
        return head, head + 1
    raise ShardLayout(
        model,
        f"`{carried.name}` has {heads} heads, which a TP size of {size} cannot share: the TP size must divide "
        f"the heads, or the heads the TP size",
        carried.name,
    )


def pushes(model: str, carried: Carried, shard: Shard) -> bool:
    """Whether `shard`'s push sends `carried`: each byte is pushed once, by the first rank holding it."""
    held = held_heads(model, carried, shard)
    if held is None:
        return shard.rank == 0
    first_holder = -(-held[0] * shard.size // carried.heads)  # the lowest rank r with r·H/t rounding down to it
    return carried.heads % shard.size == 0 or shard.rank == first_holder


def _local(carried: Carried, held: tuple[int, int] | None) -> Carried:
    if held is None:
        return carried
    heads = held[1] - held[0]
    return replace(carried, cols=heads * carried.head_dim, heads=heads)


@dataclass(frozen=True)
class ShardContract(Contract):
    """One rank's view of a contract: the tensors it pushes (or pulls), each at its own shape, under the same
    names and the whole contract's fingerprint. Naming a tensor of the contract that another rank pushes raises
    NotInShard; one the contract lacks, UnknownTensor, as the whole contract does."""

    whole: Contract = field(repr=False, compare=False, default=None)  # type: ignore[assignment]
    shard: Shard = WHOLE
    pushing: bool = False
    heads: tuple[tuple[int, int] | None, ...] = field(repr=False, compare=False, default=())

    @classmethod
    def of(cls, contract: Contract, shard: Shard, *, pushing: bool) -> ShardContract:
        """`shard`'s view: what it pushes when `pushing`, else what it pulls; ShardLayout if a tensor cannot split."""
        kept, heads = [], []
        for carried in contract.carried:
            held = held_heads(contract.model, carried, shard)
            if pushing and not pushes(contract.model, carried, shard):
                continue
            kept.append(_local(carried, held))
            heads.append(held)
        return cls(contract.model, contract.ctx, contract.hidden, tuple(kept), contract, shard, pushing, tuple(heads))

    @property
    def fingerprint(self) -> str:  # type: ignore[override]
        return self.whole.fingerprint

    @property
    def rewindable(self) -> bool:
        return self.whole.rewindable

    def index(self, name: str, given: Collection[str] = ()) -> int:
        try:
            return self._index[name]
        except KeyError:
            carried = self.whole.carried[self.whole.index(name, given)]  # UnknownTensor: not carried at all
        if carried.heads:
            why = f"its heads {held_heads(self.model, carried, self.shard)} are pushed by a lower rank holding them"
        else:
            why = "it is not split, and rank 0 pushes it"
        raise NotInShard(self.model, name, self.shard.rank, self.shard.size, why)


def view(contract: Contract, shard: Shard, *, pushing: bool) -> Contract:
    """What `shard` pushes (or pulls) as a contract: the contract itself for the whole hand-off, else its view."""
    return contract if shard.whole else ShardContract.of(contract, shard, pushing=pushing)


def shard_arrays(contract: Contract, tensors: Mapping[str, np.ndarray], shard: Shard, *, pushing: bool) -> dict:
    """`shard`'s arrays cut from whole ones: its heads of each split tensor as contiguous arrays, and (when pulling,
    or for rank 0 when pushing) the tensors not split. What a TP engine's rank holds, made from a TP=1 hand-off."""
    view = ShardContract.of(contract, shard, pushing=pushing)
    out = {}
    for carried, held in zip(view.carried, view.heads):
        array = tensors[carried.name]
        if held is not None:
            width = carried.head_dim
            array = np.ascontiguousarray(array[:, held[0] * width : held[1] * width])
        out[carried.name] = array
    return out


def join_shards(contract: Contract, shards: Sequence[Handoff], size: int) -> Handoff:
    """The whole hand-off from every rank's pulled shard (in rank order): the inverse of `shard_arrays` when pulling.
    Heads that several ranks hold must agree."""
    if len(shards) != size:
        raise ValueError(f"{contract.model}: joining needs all {size} ranks' shards, got {len(shards)}")
    state: dict[str, np.ndarray] = {}
    for carried in contract.carried:
        whole = np.empty(carried.shape, carried.numpy_dtype)
        filled: set[tuple[int, int] | None] = set()
        for rank, part in enumerate(shards):
            held = held_heads(contract.model, carried, Shard(rank, size))
            columns = slice(None) if held is None else slice(held[0] * carried.head_dim, held[1] * carried.head_dim)
            piece = part.state[carried.name]
            if held in filled:
                if not np.array_equal(whole[:, columns].view(np.uint8), piece.view(np.uint8)):
                    raise ValueError(f"{contract.model}: ranks disagree on `{carried.name}` heads {held}")
                continue
            whole[:, columns] = piece
            filled.add(held)
        state[carried.name] = whole
    return Handoff(shards[0].position, state)
