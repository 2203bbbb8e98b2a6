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
    ├── DeadlineExceeded              the call's deadline passed                         DEADLINE_EXCEEDED
    │   └── WaitTimedOut              the hand-off did not come in time
    ├── CapacityExhausted             no room for the hand-off's bytes now               RESOURCE_EXHAUSTED
    ├── MessageTooLarge               a message over the broker's limit                  RESOURCE_EXHAUSTED
    ├── BrokerBusy                    at its limit of open streams or waiting calls      RESOURCE_EXHAUSTED
    ├── BrokerUnavailable             the broker cannot be reached (BROKER_UNAVAILABLE)  UNAVAILABLE
    │   ├── Draining                  the broker is shutting down; go elsewhere
    │   ├── BrokerRestarted           the ticket's broker restarted since the push: the hand-off is gone
    │   └── LaneBroken                the call's lane was not opened in time, or broke
    ├── CallCancelled                 cancelled by its caller, or ended by the broker    CANCELLED
    │   └── HandoffCancelled          the router cancelled the hand-off
    ├── PushAborted                   the push a pull was streaming failed; discard it   ABORTED
    ├── Unauthenticated               no token, or an unknown one                        UNAUTHENTICATED
    ├── PermissionDenied              the token's roles or models do not cover the call  PERMISSION_DENIED
    ├── DigestMismatch                what a pull received does not match its digest     DATA_LOSS
    ├── InternalError                 a bug in the broker; the detail is in its log      INTERNAL
    └── RpcFailed                     any other gRPC failure, code kept (RPC_FAILED)     its own

The broker raises these and `to_status` turns one into a google.rpc.Status whose ErrorInfo (domain "handoff.v1")
names the reason and carries the fields; the client's `from_rpc_error` turns that back into the same class with the
same message. The client's own checks raise the same classes with the same messages, so a caller sees one
exception whichever side found the fault.

The classes are written in three modules, each small enough to read at once: _error_base.py (the base and its
bounds), _contract_errors.py (the first branch above) and _call_errors.py (the rest). Import them from here, where
all of them are mapped to status.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from ._call_errors import (
    AlreadyClaimed,
    BrokerBusy,
    BrokerRestarted,
    BrokerUnavailable,
    CallCancelled,
    CapacityExhausted,
    DeadlineExceeded,
    DigestMismatch,
    Draining,
    FingerprintMismatch,
    HandoffCancelled,
    HandoffExists,
    HandoffGone,
    InternalError,
    LaneBroken,
    MalformedRequest,
    MessageTooLarge,
    NotFound,
    PermissionDenied,
    Precondition,
    PushAborted,
    RpcFailed,
    ShardMismatch,
    StaleClaim,
    Unauthenticated,
    UnknownHandoff,
    UnknownModel,
    WaitTimedOut,
)
from ._contract_errors import (
    BadChunk,
    ContractViolation,
    MissingTensor,
    NotInShard,
    PositionOutOfRange,
    ShardLayout,
    UnknownTensor,
    WrongLayout,
    WrongLength,
)
from ._error_base import DOMAIN, MAX_FIELD_CHARS, MAX_MESSAGE_CHARS, HandoffError, ManifestError, bounded

__all__ = [
    "BY_REASON",
    "DOMAIN",
    "MAX_FIELD_CHARS",
    "MAX_MESSAGE_CHARS",
    "AlreadyClaimed",
    "BadChunk",
    "BrokerBusy",
    "BrokerRestarted",
    "BrokerUnavailable",
    "CallCancelled",
    "CapacityExhausted",
    "ContractViolation",
    "DeadlineExceeded",
    "DigestMismatch",
    "Draining",
    "FingerprintMismatch",
    "HandoffCancelled",
    "HandoffError",
    "HandoffExists",
    "HandoffGone",
    "InternalError",
    "LaneBroken",
    "MalformedRequest",
    "ManifestError",
    "MessageTooLarge",
    "MissingTensor",
    "NotFound",
    "NotInShard",
    "PermissionDenied",
    "PositionOutOfRange",
    "Precondition",
    "PushAborted",
    "RpcFailed",
    "ShardLayout",
    "ShardMismatch",
    "StaleClaim",
    "Unauthenticated",
    "UnknownHandoff",
    "UnknownModel",
    "UnknownTensor",
    "WaitTimedOut",
    "WrongLayout",
    "WrongLength",
    "bounded",
    "from_rpc_error",
    "from_status",
    "to_status",
]


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
    grpc.StatusCode.UNAVAILABLE: BrokerUnavailable,  # no connection, or the broker went away: BROKER_UNAVAILABLE
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: CallCancelled,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,  # (a TLS handshake or a proxy's check, before the broker's)
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}
"""What a status carrying none of our reasons is, by its code; any other code is RpcFailed (RPC_FAILED), its code
kept. So every failure a caller sees has a reason of the error model, never ERROR_REASON_UNSPECIFIED."""


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
    return RpcFailed(code if code in grpc.StatusCode else grpc.StatusCode.UNKNOWN, message)


def from_rpc_error(error: grpc.RpcError) -> HandoffError:
    """Our exception for a failed call, read from its status details (trailing metadata)."""
    from grpc_status import rpc_status

    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    message = error.details() if isinstance(error, grpc.Call) else str(error)
    status = rpc_status.from_call(error) if isinstance(error, grpc.Call) else None
    return from_status(code, message or "", list(status.details) if status is not None else [])
