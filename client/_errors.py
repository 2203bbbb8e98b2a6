"""One error model for the broker and its clients, mapped to gRPC status once, here.

    HandoffError                      base: every error carries its gRPC status code, its reason and its fields
    ├── ContractViolation             the hand-off does not meet its contract            INVALID_ARGUMENT
    │   ├── UnknownTensor             a tensor the contract does not carry (seed: Unknown)
    │   ├── MissingTensor             carried tensors left out, each named (seed: Missing)
    │   ├── WrongLength               a carried tensor of the wrong size (seed: Length)
    │   ├── WrongLayout               right size, wrong shape or dtype (refused, never cast)
    │   ├── BadChunk                  past its tensor's end, overlapping, or failing its checksum
    │   ├── NotInShard                a sharded push sends what another rank sends
    │   ├── ShardLayout               a rank past the TP size, or heads the TP size cannot share
    │   └── PositionOutOfRange        position >= ctx (seed: Position)                   OUT_OF_RANGE
    ├── MalformedRequest              no header, two headers, an empty id                INVALID_ARGUMENT
    ├── NotFound                                                                         NOT_FOUND
    │   ├── UnknownModel
    │   ├── UnknownHandoff
    │   └── HandoffGone               expired unclaimed, cancelled, or already confirmed
    ├── HandoffExists                 same id, different content                         ALREADY_EXISTS
    ├── Precondition                                                                     FAILED_PRECONDITION
    │   ├── FingerprintMismatch       the two sides hold different contracts
    │   ├── AlreadyClaimed            another decode worker holds the claim
    │   ├── StaleClaim                a confirm from a superseded claim
    │   └── ShardMismatch             a TP size other than the hand-off's other ranks use
    ├── DeadlineExceeded                                                                 DEADLINE_EXCEEDED
    │   └── WaitTimedOut              the hand-off did not come in time
    ├── CapacityExhausted             no room for the hand-off's bytes now               RESOURCE_EXHAUSTED
    ├── MessageTooLarge               a message over the broker's limit                  RESOURCE_EXHAUSTED
    ├── BrokerBusy                    at its limit of open streams or waiting calls      RESOURCE_EXHAUSTED
    ├── BrokerUnavailable             the broker cannot be reached                       UNAVAILABLE
    │   ├── Draining                  the broker is shutting down; go elsewhere
    │   └── LaneBroken                the call's lane was not opened in time, or broke
    ├── CallCancelled                                                                    CANCELLED
    │   └── HandoffCancelled          the router cancelled the hand-off
    ├── PushAborted                   the push a pull was streaming failed; discard it   ABORTED
    ├── Unauthenticated               no token, or an unknown one                        UNAUTHENTICATED
    ├── PermissionDenied              the token's roles or models do not cover the call  PERMISSION_DENIED
    ├── DigestMismatch                what a pull received does not match its digest     DATA_LOSS
    ├── InternalError                 a bug in the broker; the detail is in its log      INTERNAL
    └── RpcFailed                     any other gRPC failure, code kept

The broker raises these and `to_status` turns one into a google.rpc.Status whose ErrorInfo (domain "handoff.v1")
names the reason and carries the fields; the client's `from_rpc_error` turns that back into the same class with the
same message. The client's own checks raise the same classes with the same messages, so a caller sees one
exception whichever side found the fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "handoff.v1"


class ManifestError(ValueError):
    """A manifest that is not a contract; the message names the file and the field. (A local error, never a call's:
    kept here, where nothing heavy is imported, so the command line can catch it cheaply.)"""


MAX_MESSAGE_CHARS = 2048
MAX_FIELD_CHARS = 256
"""What an error echoes of what a caller sent is bounded: a status must fit gRPC's metadata limit (8 KiB), and a
log line must not carry a megabyte a client made up."""


def bounded(text: str, limit: int) -> str:
    """`text`, or its first characters and how long it was."""
    if len(text) <= limit:
        return text
    note = f"… ({len(text)} characters)"
    return text[: limit - len(note)] + note


class HandoffError(Exception):
    """Base of every error a hand-off can meet; `code` and `reason` say how it travels on the wire."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    reason: ClassVar[str] = "ERROR_REASON_UNSPECIFIED"

    def __init__(self, message: str, **fields: object) -> None:
        message = bounded(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.fields: dict[str, str] = {
            key: bounded(str(value), MAX_FIELD_CHARS) for key, value in fields.items() if value is not None
        }

    @property
    def model(self) -> str | None:
        return self.fields.get("model")

    @property
    def tensor(self) -> str | None:
        return self.fields.get("tensor")

    @property
    def handoff_id(self) -> str | None:
        return self.fields.get("handoff_id")

    @classmethod
    def _rebuild(cls, message: str, fields: Mapping[str, str]) -> HandoffError:
        """The error as the other side raised it, without running a subclass's message-building constructor."""
        error = cls.__new__(cls)
        HandoffError.__init__(error, message, **fields)
        return error


# -- the hand-off does not meet its contract ------------------------------------------------------------------------


class ContractViolation(HandoffError):
    """The hand-off does not meet its model's contract."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownTensor(ContractViolation):
    """A tensor the contract does not carry."""

    reason = "UNKNOWN_TENSOR"

    def __init__(self, model: str, tensor: str) -> None:
        tensor = bounded(tensor, MAX_FIELD_CHARS)  # a name a client made up: echoed bounded
        super().__init__(
            f"{model}: the hand-off carries `{tensor}`, which no decode step reads", model=model, tensor=tensor
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
            f"{model}: after {position} tokens the next decode writes row {position + 1} of a cache of {ctx}",
            model=model,
            position=position,
            ctx=ctx,
        )


# -- requests the broker cannot act on ------------------------------------------------------------------------------


class MalformedRequest(HandoffError):
    """A request that is not well formed: no header, a second header, an empty or oversized field."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "MALFORMED_REQUEST"

    def __init__(self, why: str, model: str | None = None) -> None:
        super().__init__(why if model is None else f"{model}: {why}", model=model)


class NotFound(HandoffError):
    """Something the call names is not there."""

    code = grpc.StatusCode.NOT_FOUND


class UnknownModel(NotFound):
    """The broker serves no contract for this model."""

    reason = "UNKNOWN_MODEL"

    def __init__(self, model: str, served: list[str]) -> None:
        listed = ", ".join(served) if served else "none"
        shown = model if len(model) <= 128 else model[:128] + "…"
        super().__init__(f"no contract for model `{shown}`; this broker serves: {listed}", model=shown)


class UnknownHandoff(NotFound):
    """No hand-off with this id, and none recently."""

    reason = "UNKNOWN_HANDOFF"

    def __init__(self, model: str, handoff_id: str) -> None:
        super().__init__(f"{model}: no hand-off `{handoff_id}`", model=model, handoff_id=handoff_id)


class HandoffGone(NotFound):
    """The hand-off was here and is no longer: expired unclaimed, cancelled, or confirmed by its decoder."""

    reason = "HANDOFF_GONE"

    def __init__(self, model: str, handoff_id: str, how: str) -> None:
        super().__init__(f"{model}: hand-off `{handoff_id}` {how}", model=model, handoff_id=handoff_id, how=how)


class HandoffExists(HandoffError):
    """A hand-off with this id is already held, with different content."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "HANDOFF_EXISTS"

    def __init__(self, model: str, handoff_id: str, why: str) -> None:
        super().__init__(
            f"{model}: hand-off `{handoff_id}` is already held and {why}; a retry must repeat it byte for byte",
            model=model,
            handoff_id=handoff_id,
        )


class Precondition(HandoffError):
    """The call is well formed but the broker's state does not allow it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class FingerprintMismatch(Precondition):
    """The two sides hold different contracts for the same model."""

    reason = "FINGERPRINT_MISMATCH"

    def __init__(self, model: str, local: str, remote: str) -> None:
        super().__init__(
            f"{model}: contract fingerprint mismatch. Broker: {local}, caller: {remote}; "
            "fetch the broker's contract (GetContract) or deploy the same manifest on both sides",
            model=model,
            local=local,
            remote=remote,
        )


class AlreadyClaimed(Precondition):
    """Another decode worker holds the hand-off's claim."""

    reason = "ALREADY_CLAIMED"

    def __init__(self, model: str, handoff_id: str, part: str = "") -> None:
        super().__init__(
            f"{model}: hand-off `{handoff_id}`{f' ({part})' if part else ''} is claimed by another decode worker",
            model=model,
            handoff_id=handoff_id,
        )


class StaleClaim(Precondition):
    """A confirm from a claim that is no longer the hand-off's current one."""

    reason = "STALE_CLAIM"

    def __init__(self, model: str, handoff_id: str, claim: int, why: str) -> None:
        super().__init__(
            f"{model}: claim {claim} on hand-off `{handoff_id}` {why}",
            model=model,
            handoff_id=handoff_id,
            claim=claim,
        )


class ShardMismatch(Precondition):
    """A push or pull at a TP size other than the one the hand-off's other ranks use."""

    reason = "SHARD_MISMATCH"

    def __init__(self, model: str, handoff_id: str, side: str, have: int, got: int) -> None:
        super().__init__(
            f"{model}: hand-off `{handoff_id}` is {side} at TP size {have}, not {got}; every rank of one "
            f"hand-off's {'push' if side == 'pushed' else 'pull'} uses the same TP size",
            model=model,
            handoff_id=handoff_id,
            have=have,
            got=got,
        )


class DeadlineExceeded(HandoffError):
    """The call's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class WaitTimedOut(DeadlineExceeded):
    """The hand-off did not arrive within the puller's deadline."""

    reason = "WAIT_TIMED_OUT"

    def __init__(self, model: str, handoff_id: str, waited: float) -> None:
        super().__init__(
            f"{model}: hand-off `{handoff_id}` was not pushed within {waited:.3g} s",
            model=model,
            handoff_id=handoff_id,
        )


class CapacityExhausted(HandoffError):
    """The broker cannot hold the hand-off's bytes now; `retry_after` says when trying again makes sense."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "CAPACITY_EXHAUSTED"
    retry_after = 1.0

    def __init__(self, model: str, asked: int, free: int, capacity: int, what: str = "bytes") -> None:
        never = " (more than it can ever hold: raise --max-bytes)" if asked > capacity else ""
        super().__init__(
            f"{model}: the hand-off needs {asked} {what} and the broker has {free} of {capacity} free{never}",
            model=model,
            asked=asked,
            free=free,
            capacity=capacity,
        )


class MessageTooLarge(HandoffError):
    """A message larger than the broker accepts (--max-message-bytes): send smaller chunks."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "MESSAGE_TOO_LARGE"

    def __init__(self, model: str, size: int, limit: int) -> None:
        super().__init__(
            f"{model}: a message of {size} bytes is over the broker's limit of {limit}; send smaller chunks",
            model=model,
            size=size,
            limit=limit,
        )


class BrokerBusy(HandoffError):
    """The broker is at a limit on concurrent work (open push and pull streams, or calls waiting for a push or for
    room), which keeps threads free for health, status and the work under way; a retry shortly may be taken."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "BROKER_BUSY"
    retry_after = 0.5

    def __init__(self, what: str, limit: int, model: str | None = None) -> None:
        super().__init__(
            f"the broker already has {limit} {what}, its limit; retry shortly", model=model, what=what, limit=limit
        )


class BrokerUnavailable(HandoffError):
    """The broker cannot be reached or will not take the call now; another broker, or a retry, may."""

    code = grpc.StatusCode.UNAVAILABLE


class Draining(BrokerUnavailable):
    """The broker is shutting down and takes no new pushes or claims."""

    reason = "DRAINING"

    def __init__(self) -> None:
        super().__init__("the broker is draining and takes no new hand-offs or claims; use another broker")


class LaneBroken(BrokerUnavailable):
    """The call's lane (docs/lanes.md) was not opened within its wait, or broke, or went silent: the call ended as a
    broken stream does (a pull's claim returned at once; a push freed, or kept for its resume if resumable). The
    client retries on the stream."""

    reason = "LANE_BROKEN"

    def __init__(self, model: str, why: str) -> None:
        super().__init__(f"{model}: {why}", model=model)


class CallCancelled(HandoffError):
    """The call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class HandoffCancelled(CallCancelled):
    """The hand-off was cancelled (CancelHandoff) while this call was under way."""

    reason = "HANDOFF_CANCELLED"

    def __init__(self, model: str, handoff_id: str) -> None:
        super().__init__(f"{model}: hand-off `{handoff_id}` was cancelled", model=model, handoff_id=handoff_id)


class PushAborted(HandoffError):
    """The push a pull was streaming before it ended failed, or was replaced by a retry: discard what arrived."""

    code = grpc.StatusCode.ABORTED
    reason = "PUSH_ABORTED"

    def __init__(self, model: str, handoff_id: str, why: str | None = None) -> None:
        super().__init__(
            f"{model}: the push of hand-off `{handoff_id}` "
            + (why or "failed or was replaced while it streamed; discard what arrived and pull again"),
            model=model,
            handoff_id=handoff_id,
        )


class Unauthenticated(HandoffError):
    """No bearer token, or one the broker does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"

    def __init__(self, why: str) -> None:
        super().__init__(f"{why}; send `authorization: Bearer <token>` with a token the broker was given (--tokens)")


class PermissionDenied(HandoffError):
    """The caller's token does not grant this call: a role it lacks, or a model outside its scope."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"

    def __init__(self, who: str, why: str, model: str | None = None) -> None:
        super().__init__(f"token `{who}` {why}", model=model, principal=who)


class DigestMismatch(HandoffError):
    """What a pull received does not match the digest the broker computed when the push was checked."""

    code = grpc.StatusCode.DATA_LOSS
    reason = "DIGEST_MISMATCH"

    def __init__(self, model: str, handoff_id: str, want: str, got: str) -> None:
        super().__init__(
            f"{model}: hand-off `{handoff_id}` arrived with digest {got}, the broker sent {want}; nothing was kept",
            model=model,
            handoff_id=handoff_id,
        )


class InternalError(HandoffError):
    """A bug in the broker; the detail is in the broker's log, never on the wire."""

    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL_ERROR"

    def __init__(self) -> None:
        super().__init__("internal error in the broker; its log has the detail")


class RpcFailed(HandoffError):
    """A gRPC failure that carries none of our reasons; `status` keeps its code."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.code = status  # type: ignore[misc]  # this instance's real code, not the class's UNKNOWN


def _concrete(cls: type[HandoffError]) -> list[type[HandoffError]]:
    found = []
    for sub in cls.__subclasses__():
        if "reason" in sub.__dict__:
            found.append(sub)
        found.extend(_concrete(sub))
    return found


BY_REASON: dict[str, type[HandoffError]] = {cls.reason: cls for cls in _concrete(HandoffError)}
"""Every error kind that travels, by its ErrorReason name."""

_BY_CODE: dict[grpc.StatusCode, type[HandoffError]] = {
    grpc.StatusCode.UNAVAILABLE: BrokerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: CallCancelled,
}


def to_status(error: HandoffError) -> status_pb2.Status:
    """The google.rpc.Status that carries `error` to the other side."""
    details = [error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=error.fields)]
    if isinstance(error, (CapacityExhausted, BrokerBusy)):
        delay = error_details_pb2.RetryInfo()
        delay.retry_delay.FromNanoseconds(int(error.retry_after * 1e9))
        details.append(delay)
    packed = []
    for detail in details:
        packed.append(any_pb2.Any())
        packed[-1].Pack(detail)
    return status_pb2.Status(code=error.code.value[0], message=error.message, details=packed)


def from_status(code: grpc.StatusCode, message: str, details: list[any_pb2.Any]) -> HandoffError:
    """The error a status stands for: by its ErrorInfo reason first, its status code second."""
    for detail in details:
        info = error_details_pb2.ErrorInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == DOMAIN and info.reason in BY_REASON:
            return BY_REASON[info.reason]._rebuild(message, dict(info.metadata))
    by_code = _BY_CODE.get(code)
    if by_code is not None:
        return by_code._rebuild(message, {})
    return RpcFailed(code, message)


def from_rpc_error(error: grpc.RpcError) -> HandoffError:
    """Our exception for a failed call, read from its status details (trailing metadata)."""
    from grpc_status import rpc_status  # noqa: PLC0415 - only failed calls pay for the import

    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    message = error.details() if isinstance(error, grpc.Call) else str(error)
    status = rpc_status.from_call(error) if isinstance(error, grpc.Call) else None
    return from_status(code, message or "", list(status.details) if status is not None else [])
