"""handoff_client: hand a model's carried decode state from a prefill worker to a decode worker through the broker.

    from handoff_client import HandoffClient
    c = HandoffClient("127.0.0.1:50051")
    contract = c.get_contract("demo-hybrid")
    c.push("demo-hybrid", "req-42", position=17, tensors={name: array, ...})
    h = c.pull("demo-hybrid", "req-42", timeout=30)       # h.position, h.state[name] -> ndarray
"""

from ._client import DEFAULT_CHUNK_BYTES, DEFAULT_RETRY, DEFAULT_TIMEOUT, NO_RETRY, HandoffClient, PulledTensors, PushResult, RetryPolicy
from ._contract import Carried, Contract, Handoff, ManifestError
from ._dtypes import DTYPES
from ._errors import (
    AlreadyClaimed,
    BadChunk,
    BrokerUnavailable,
    CallCancelled,
    CapacityExhausted,
    ContractViolation,
    DeadlineExceeded,
    DigestMismatch,
    Draining,
    FingerprintMismatch,
    HandoffCancelled,
    HandoffError,
    HandoffExists,
    HandoffGone,
    InternalError,
    MalformedRequest,
    MissingTensor,
    NotFound,
    PositionOutOfRange,
    Precondition,
    PushAborted,
    RpcFailed,
    StaleClaim,
    UnknownHandoff,
    UnknownModel,
    UnknownTensor,
    WaitTimedOut,
    WrongLayout,
    WrongLength,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RETRY",
    "DEFAULT_TIMEOUT",
    "NO_RETRY",
    "DTYPES",
    "AlreadyClaimed",
    "BadChunk",
    "BrokerUnavailable",
    "CallCancelled",
    "CapacityExhausted",
    "Carried",
    "Contract",
    "ContractViolation",
    "DeadlineExceeded",
    "DigestMismatch",
    "Draining",
    "FingerprintMismatch",
    "Handoff",
    "HandoffCancelled",
    "HandoffClient",
    "HandoffError",
    "HandoffExists",
    "HandoffGone",
    "InternalError",
    "MalformedRequest",
    "ManifestError",
    "MissingTensor",
    "NotFound",
    "PositionOutOfRange",
    "Precondition",
    "PushAborted",
    "PulledTensors",
    "PushAborted",
    "PushResult",
    "RetryPolicy",
    "RpcFailed",
    "StaleClaim",
    "UnknownHandoff",
    "UnknownModel",
    "UnknownTensor",
    "WaitTimedOut",
    "WrongLayout",
    "WrongLength",
]
