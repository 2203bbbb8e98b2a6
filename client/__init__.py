"""handoff_client: hand a model's carried decode state from a prefill worker to a decode worker through the broker.

from handoff_client import HandoffClient
c = HandoffClient("127.0.0.1:50051")
contract = c.get_contract("demo-hybrid")
c.push("demo-hybrid", "req-42", position=17, tensors={name: array, ...})
h = c.pull("demo-hybrid", "req-42", timeout=30)       # h.position, h.state[name] -> ndarray
"""

from pathlib import Path

from ._client import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_RETRY,
    DEFAULT_TIMEOUT,
    NO_RETRY,
    HandoffClient,
    PushResult,
    RetryPolicy,
)
from ._pulls import PulledTensors

PROTO_PATH = Path(__file__).with_name("handoff.proto")
"""The .proto this client speaks, shipped with it (with its comments, the wire's specification): for generating a
client in another language, or reading what each field means."""
from ._allocator import tune_allocator
from ._contract import Carried, Contract, Handoff, ManifestError
from ._fleet import FleetClient
from ._shards import Shard, ShardContract, join_shards, shard_arrays
from ._torch import from_numpy, to_numpy
from ._dtypes import DTYPES
from ._errors import (
    AlreadyClaimed,
    BadChunk,
    BrokerBusy,
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
    MessageTooLarge,
    MissingTensor,
    NotFound,
    PermissionDenied,
    PositionOutOfRange,
    Precondition,
    PushAborted,
    RpcFailed,
    StaleClaim,
    UnknownHandoff,
    UnknownModel,
    UnknownTensor,
    Unauthenticated,
    WaitTimedOut,
    WrongLayout,
    WrongLength,
    NotInShard,
    ShardLayout,
    ShardMismatch,
)

__all__ = [
    "PROTO_PATH",
    "from_numpy",
    "to_numpy",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RETRY",
    "DEFAULT_TIMEOUT",
    "NO_RETRY",
    "DTYPES",
    "AlreadyClaimed",
    "BadChunk",
    "BrokerBusy",
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
    "FleetClient",
    "Handoff",
    "HandoffCancelled",
    "HandoffClient",
    "HandoffError",
    "HandoffExists",
    "HandoffGone",
    "InternalError",
    "MalformedRequest",
    "MessageTooLarge",
    "ManifestError",
    "MissingTensor",
    "NotFound",
    "PermissionDenied",
    "PositionOutOfRange",
    "Precondition",
    "PushAborted",
    "PulledTensors",
    "PushResult",
    "RetryPolicy",
    "RpcFailed",
    "StaleClaim",
    "UnknownHandoff",
    "UnknownModel",
    "UnknownTensor",
    "Unauthenticated",
    "WaitTimedOut",
    "WrongLayout",
    "WrongLength",
    "NotInShard",
    "Shard",
    "ShardContract",
    "ShardLayout",
    "ShardMismatch",
    "join_shards",
    "shard_arrays",
    "tune_allocator",
]
