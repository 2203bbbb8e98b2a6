"""The errors of a hand-off that does not meet its contract: the seed's checks by name (Unknown, Missing, Length,
Position) and the ones chunks, layouts and shards add. All travel as INVALID_ARGUMENT but PositionOutOfRange
(OUT_OF_RANGE); client/protocol/errors.py is the whole tree and its mapping to status."""

from __future__ import annotations

import grpc

from ._error_base import MAX_FIELD_CHARS, HandoffError, bounded

# -- the hand-off does not meet its contract ------------------------------------------------------------------------


class ContractViolation(HandoffError):
    """The hand-off does not meet its model's contract."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownTensor(ContractViolation):
    """A tensor the contract does not carry."""

    reason = "UNKNOWN_TENSOR"

    def __init__(self, model: str, tensor: str, like: str | None = None) -> None:
        tensor = bounded(tensor, MAX_FIELD_CHARS)  # a name a client made up: echoed bounded
        hint = f" (a misspelling of the carried `{like}`, which it leaves out?)" if like else ""
        super().__init__(
            f"{model}: the hand-off carries `{tensor}`, which no decode step reads{hint}", model=model, tensor=tensor
        )


class MissingTensor(ContractViolation):
    """A carried tensor the hand-off leaves out."""

    reason = "MISSING_TENSOR"

    def __init__(self, model: str, tensor: str, *others: str) -> None:
        more = ""
        if others:
            shown = ", ".join(f"`{name}`" for name in others[:4])
            more = f" and {len(others)} more ({shown}{', ...' if len(others) > 4 else ''})"
        super().__init__(
            f"{model}: the hand-off leaves out the carried `{tensor}`{more}",
            model=model,
            tensor=tensor,
            missing=1 + len(others),
        )


class WrongLength(ContractViolation):
    """A carried tensor of the wrong size: `want_values` (`want_bytes`) in the contract, `got_bytes` in the hand-off.
    Where the hand-off carries only the rows its position filled, `want` is that filled size and `filled` says so."""

    reason = "WRONG_LENGTH"

    def __init__(
        self, model: str, tensor: str, want: int, got_bytes: int, dtype: str, itemsize: int, filled: str = ""
    ) -> None:
        got_values, ragged = divmod(got_bytes, itemsize)
        got = f"{got_values}" if not ragged else f"{got_bytes} bytes, not a whole number of {dtype} values,"
        note = f" ({filled})" if filled else ""
        super().__init__(
            f"{model}: `{tensor}` is {want} values in the contract{note} and {got} in the hand-off "
            f"({want * itemsize} and {got_bytes} bytes of {dtype})",
            model=model,
            tensor=tensor,
            want=want,  # (values, as want_values: kept for readers written before the units were named)
            want_values=want,
            want_bytes=want * itemsize,
            got_bytes=got_bytes,
            dtype=dtype,
        )


class WrongLayout(ContractViolation):
    """An array of the right size but the wrong shape or dtype, which the client refuses to reshape or cast."""

    reason = "WRONG_LAYOUT"

    def __init__(self, model: str, tensor: str, want: str, got: str) -> None:
        super().__init__(
            f"{model}: `{tensor}` is {want} in the contract and {got} in the hand-off; pass it as declared, "
            "nothing is cast or reshaped",
            model=model,
            tensor=tensor,
            want=want,
            got=got,
        )


class BadChunk(ContractViolation):
    """A chunk that cannot be part of its tensor: past its end, over bytes already received, or corrupt."""

    reason = "BAD_CHUNK"

    def __init__(self, model: str, tensor: str, offset: int, length: int, why: str) -> None:
        super().__init__(
            f"{model}: the chunk of `{tensor}` at byte {offset} ({length} bytes) {why}",
            model=model,
            tensor=tensor,
            offset=offset,
            length=length,
        )


class NotInShard(ContractViolation):
    """A sharded push sends a tensor, or heads of one, that belong to another rank's push."""

    reason = "NOT_IN_SHARD"

    def __init__(self, model: str, tensor: str, rank: int, size: int, why: str) -> None:
        super().__init__(
            f"{model}: `{tensor}` is not rank {rank} of {size}'s to push: {why}",
            model=model,
            tensor=tensor,
            rank=rank,
            size=size,
        )


class ShardLayout(ContractViolation):
    """A shard that cannot be cut: a rank not below the TP size, or heads that the TP size cannot share."""

    reason = "SHARD_LAYOUT"

    def __init__(self, model: str, why: str, tensor: str | None = None) -> None:
        super().__init__(f"{model}: {why}", model=model, tensor=tensor)


class PositionOutOfRange(ContractViolation):
    """A position whose next token's row the cache does not have (position >= ctx)."""

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "POSITION_OUT_OF_RANGE"

    def __init__(self, model: str, position: int, ctx: int) -> None:
        super().__init__(
            f"{model}: after {position} tokens the next decode writes row {position} (counted from 0); "
            f"a cache of {ctx} has rows 0 to {ctx - 1}",
            model=model,
            position=position,
            ctx=ctx,
        )
