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
    "DEFAULT_CHUNK_BYTES": "protocol.limits",
    "DEFAULT_TIMEOUT": "_client",
    "BrokerStatus": "_status",
    "__version__": "_version",
    "HandoffClient": "_handoff",
    "contract_from_config": "_architectures",
    "make_channel": "_calls",
    "PushResult": "_client",
    "PulledTensors": "_pulls",
    "tune_allocator": "memory",
    "Carried": "protocol.contract",
    "Contract": "protocol.contract",
    "Handoff": "protocol.contract",
    "FleetClient": "fleet",
    "Shard": "protocol.shards",
    "ShardContract": "protocol.shards",
    "join_shards": "protocol.shards",
    "shard_arrays": "protocol.shards",
    "from_numpy": "_torch",
    "to_numpy": "_torch",
    "DTYPES": "protocol.dtypes",
    "AlreadyClaimed": "protocol.errors",
    "BadChunk": "protocol.errors",
    "BrokerBusy": "protocol.errors",
    "BrokerRestarted": "protocol.errors",
    "BrokerUnavailable": "protocol.errors",
    "CallCancelled": "protocol.errors",
    "CapacityExhausted": "protocol.errors",
    "ContractViolation": "protocol.errors",
    "DeadlineExceeded": "protocol.errors",
    "DigestMismatch": "protocol.errors",
    "Draining": "protocol.errors",
    "FingerprintMismatch": "protocol.errors",
    "HandoffCancelled": "protocol.errors",
    "HandoffError": "protocol.errors",
    "HandoffExists": "protocol.errors",
    "HandoffGone": "protocol.errors",
    "InternalError": "protocol.errors",
    "LaneBroken": "protocol.errors",
    "MalformedRequest": "protocol.errors",
    "ManifestError": "protocol.errors",
    "MessageTooLarge": "protocol.errors",
    "MissingTensor": "protocol.errors",
    "NotFound": "protocol.errors",
    "NotInShard": "protocol.errors",
    "PermissionDenied": "protocol.errors",
    "PositionOutOfRange": "protocol.errors",
    "Precondition": "protocol.errors",
    "PushAborted": "protocol.errors",
    "RpcFailed": "protocol.errors",
    "ShardLayout": "protocol.errors",
    "ShardMismatch": "protocol.errors",
    "StaleClaim": "protocol.errors",
    "Unauthenticated": "protocol.errors",
    "UnknownHandoff": "protocol.errors",
    "UnknownModel": "protocol.errors",
    "UnknownTensor": "protocol.errors",
    "WaitTimedOut": "protocol.errors",
    "WrongLayout": "protocol.errors",
    "WrongLength": "protocol.errors",
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
    "BrokerRestarted",
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
    "contract_from_config",
    "from_numpy",
    "join_shards",
    "make_channel",
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
    from ._architectures import contract_from_config
    from ._calls import DEFAULT_RETRY, NO_RETRY, RetryPolicy, make_channel
    from ._client import DEFAULT_TIMEOUT, PushResult
    from ._handoff import HandoffClient
    from ._pulls import PulledTensors
    from ._status import BrokerStatus
    from ._torch import from_numpy, to_numpy
    from ._version import __version__ as __version__
    from .fleet import FleetClient
    from .memory import tune_allocator
    from .protocol.contract import Carried, Contract, Handoff
    from .protocol.dtypes import DTYPES
    from .protocol.errors import (
        AlreadyClaimed,
        BadChunk,
        BrokerBusy,
        BrokerRestarted,
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
    from .protocol.limits import DEFAULT_CHUNK_BYTES
    from .protocol.shards import Shard, ShardContract, join_shards, shard_arrays
