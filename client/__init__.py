"""handoff_client: hand a model's carried decode state from a prefill worker to a decode worker through the broker.

from handoff_client import HandoffClient
c = HandoffClient("127.0.0.1:50051")
contract = c.get_contract("demo-hybrid")
c.push("demo-hybrid", "req-42", position=17, tensors={name: array, ...})
h = c.pull("demo-hybrid", "req-42", timeout=30)       # h.position, h.state[name] -> ndarray
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

PROTO_PATH = Path(__file__).with_name("handoff.proto")
"""The .proto this client speaks, shipped with it (with its comments, the wire's specification): for generating a
client in another language, or reading what each field means."""

_HOMES: dict[str, str] = {
    "DEFAULT_RETRY": "_calls",
    "NO_RETRY": "_calls",
    "RetryPolicy": "_calls",
    "DEFAULT_CHUNK_BYTES": "_client",
    "DEFAULT_TIMEOUT": "_client",
    "BrokerStatus": "_status",
    "__version__": "_version",
    "HandoffClient": "_client",
    "PushResult": "_client",
    "PulledTensors": "_pulls",
    "tune_allocator": "_allocator",
    "Carried": "_contract",
    "Contract": "_contract",
    "Handoff": "_contract",
    "FleetClient": "_fleet",
    "Shard": "_shards",
    "ShardContract": "_shards",
    "join_shards": "_shards",
    "shard_arrays": "_shards",
    "from_numpy": "_torch",
    "to_numpy": "_torch",
    "DTYPES": "_dtypes",
    "AlreadyClaimed": "_errors",
    "BadChunk": "_errors",
    "BrokerBusy": "_errors",
    "BrokerUnavailable": "_errors",
    "CallCancelled": "_errors",
    "CapacityExhausted": "_errors",
    "ContractViolation": "_errors",
    "DeadlineExceeded": "_errors",
    "DigestMismatch": "_errors",
    "Draining": "_errors",
    "FingerprintMismatch": "_errors",
    "HandoffCancelled": "_errors",
    "HandoffError": "_errors",
    "HandoffExists": "_errors",
    "HandoffGone": "_errors",
    "InternalError": "_errors",
    "LaneBroken": "_errors",
    "MalformedRequest": "_errors",
    "ManifestError": "_errors",
    "MessageTooLarge": "_errors",
    "MissingTensor": "_errors",
    "NotFound": "_errors",
    "NotInShard": "_errors",
    "PermissionDenied": "_errors",
    "PositionOutOfRange": "_errors",
    "Precondition": "_errors",
    "PushAborted": "_errors",
    "RpcFailed": "_errors",
    "ShardLayout": "_errors",
    "ShardMismatch": "_errors",
    "StaleClaim": "_errors",
    "Unauthenticated": "_errors",
    "UnknownHandoff": "_errors",
    "UnknownModel": "_errors",
    "UnknownTensor": "_errors",
    "WaitTimedOut": "_errors",
    "WrongLayout": "_errors",
    "WrongLength": "_errors",
}
"""Each public name and the module that defines it, imported when the name is first used: `import handoff_client`
costs nothing until then (the broker's health check, a client-only command, imports no numpy or ml_dtypes)."""

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RETRY",
    "DEFAULT_TIMEOUT",
    "DTYPES",
    "NO_RETRY",
    "PROTO_PATH",
    "AlreadyClaimed",
    "BadChunk",
    "BrokerBusy",
    "BrokerStatus",
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
    "PulledTensors",
    "PushAborted",
    "PushResult",
    "RetryPolicy",
    "RpcFailed",
    "Shard",
    "ShardContract",
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
    "from_numpy",
    "join_shards",
    "shard_arrays",
    "to_numpy",
    "tune_allocator",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # the same names, eagerly, for type checkers and editors
    from ._allocator import tune_allocator
    from ._calls import DEFAULT_RETRY, NO_RETRY, RetryPolicy
    from ._client import DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT, HandoffClient, PushResult
    from ._contract import Carried, Contract, Handoff
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
        LaneBroken,
        MalformedRequest,
        ManifestError,
        MessageTooLarge,
        MissingTensor,
        NotFound,
        NotInShard,
        PermissionDenied,
        PositionOutOfRange,
        Precondition,
        PushAborted,
        RpcFailed,
        ShardLayout,
        ShardMismatch,
        StaleClaim,
        Unauthenticated,
        UnknownHandoff,
        UnknownModel,
        UnknownTensor,
        WaitTimedOut,
        WrongLayout,
        WrongLength,
    )
    from ._fleet import FleetClient
    from ._pulls import PulledTensors
    from ._shards import Shard, ShardContract, join_shards, shard_arrays
    from ._status import BrokerStatus
    from ._torch import from_numpy, to_numpy
    from ._version import __version__ as __version__
