"""The errors of a call the broker cannot act on, or cannot finish: malformed, naming what is not there, against
the hand-off's state, out of time or room, refused, broken. client/protocol/errors.py is the whole tree and its mapping to
status."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc

from ._error_base import HandoffError

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

    ADVICE = "fetch the broker's contract (GetContract) or deploy the same manifest on both sides"

    def __init__(
        self, model: str, local: str, remote: str, differences: Sequence[str] = (), advice: str = ADVICE
    ) -> None:
        """`differences`: what differs, where the raiser holds both contracts (protocol.contract.differences), each
        naming the field, the tensors and both values; `advice`: what to do, where the raiser knows better."""
        differ = f"; they differ in {'; '.join(differences)}" if differences else ""
        super().__init__(
            f"{model}: contract fingerprint mismatch. Broker: {local}, caller: {remote}{differ}; {advice}",
            model=model,
            local=local,
            remote=remote,
            differences="; ".join(differences) or None,
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
    """The call's deadline passed before any answer."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"


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
    reason = "BROKER_UNAVAILABLE"


class Draining(BrokerUnavailable):
    """The broker is shutting down and takes no new pushes or claims."""

    reason = "DRAINING"

    def __init__(self) -> None:
        super().__init__("the broker is draining and takes no new hand-offs or claims; use another broker")


class BrokerRestarted(BrokerUnavailable):
    """The pull named the incarnation of the broker its push reached (its ticket's `n`), or that its producer knew
    before the push (`e`), and the broker at that address now is another, holding nothing of the hand-off: it
    restarted since, and the hand-off was lost with the process that held it (or, of an `e`, not pushed within the
    broker's restart grace). Not retried."""

    reason = "BROKER_RESTARTED"

    def __init__(self, model: str, handoff_id: str, expected: str, incarnation: str) -> None:
        super().__init__(
            f"the ticket of {model}/{handoff_id} names this broker's incarnation {expected}, and it is now incarnation "
            f"{incarnation}: the broker restarted since, and holds nothing of the hand-off (lost with the process "
            "that held it, or never pushed)",
            model=model, handoff_id=handoff_id, expected=expected, incarnation=incarnation,
        )  # fmt: skip


class LaneBroken(BrokerUnavailable):
    """The call's lane (docs/lanes.md) was not opened within its wait, or broke, or went silent: the call ended as a
    broken stream does (a pull's claim returned at once; a push freed, or kept for its resume if resumable). The
    client retries on the stream."""

    reason = "LANE_BROKEN"

    def __init__(self, model: str, why: str) -> None:
        super().__init__(f"{model}: {why}", model=model)


class CallCancelled(HandoffError):
    """The call was cancelled: by its caller, or by the broker ending a call it may not keep (silent, stalled)."""

    code = grpc.StatusCode.CANCELLED
    reason = "CALL_CANCELLED"


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
    """A gRPC failure that carries none of our reasons; `status` keeps its code (and metadata `code` names it)."""

    reason = "RPC_FAILED"

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{status.name}: {message}", code=status.name)
        self.status = status
        self.code = status  # type: ignore[misc]  # this instance's real code, not the class's UNKNOWN

    @classmethod
    def _rebuild(cls, message: str, fields: Mapping[str, str]) -> HandoffError:
        error = super()._rebuild(message, fields)
        error.status = error.code = grpc.StatusCode.__members__.get(fields.get("code", ""), grpc.StatusCode.UNKNOWN)  # type: ignore[attr-defined,misc]
        return error
