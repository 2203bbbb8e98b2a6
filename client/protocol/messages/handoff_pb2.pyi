from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LaneSealing(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LANE_SEALING_NONE: _ClassVar[LaneSealing]
    LANE_SEALING_AES_256_GCM: _ClassVar[LaneSealing]

class LaneKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LANE_KIND_UNSPECIFIED: _ClassVar[LaneKind]
    LANE_KIND_TCP: _ClassVar[LaneKind]
    LANE_KIND_SHM: _ClassVar[LaneKind]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    UNKNOWN_TENSOR: _ClassVar[ErrorReason]
    MISSING_TENSOR: _ClassVar[ErrorReason]
    WRONG_LENGTH: _ClassVar[ErrorReason]
    WRONG_LAYOUT: _ClassVar[ErrorReason]
    BAD_CHUNK: _ClassVar[ErrorReason]
    POSITION_OUT_OF_RANGE: _ClassVar[ErrorReason]
    MALFORMED_REQUEST: _ClassVar[ErrorReason]
    UNKNOWN_MODEL: _ClassVar[ErrorReason]
    UNKNOWN_HANDOFF: _ClassVar[ErrorReason]
    HANDOFF_GONE: _ClassVar[ErrorReason]
    HANDOFF_EXISTS: _ClassVar[ErrorReason]
    FINGERPRINT_MISMATCH: _ClassVar[ErrorReason]
    ALREADY_CLAIMED: _ClassVar[ErrorReason]
    STALE_CLAIM: _ClassVar[ErrorReason]
    WAIT_TIMED_OUT: _ClassVar[ErrorReason]
    CAPACITY_EXHAUSTED: _ClassVar[ErrorReason]
    DRAINING: _ClassVar[ErrorReason]
    HANDOFF_CANCELLED: _ClassVar[ErrorReason]
    INTERNAL_ERROR: _ClassVar[ErrorReason]
    DIGEST_MISMATCH: _ClassVar[ErrorReason]
    PUSH_ABORTED: _ClassVar[ErrorReason]
    UNAUTHENTICATED: _ClassVar[ErrorReason]
    PERMISSION_DENIED: _ClassVar[ErrorReason]
    MESSAGE_TOO_LARGE: _ClassVar[ErrorReason]
    SHARD_LAYOUT: _ClassVar[ErrorReason]
    SHARD_MISMATCH: _ClassVar[ErrorReason]
    NOT_IN_SHARD: _ClassVar[ErrorReason]
    BROKER_BUSY: _ClassVar[ErrorReason]
    LANE_BROKEN: _ClassVar[ErrorReason]
    BROKER_UNAVAILABLE: _ClassVar[ErrorReason]
    CALL_CANCELLED: _ClassVar[ErrorReason]
    DEADLINE_EXCEEDED: _ClassVar[ErrorReason]
    RPC_FAILED: _ClassVar[ErrorReason]
    BROKER_RESTARTED: _ClassVar[ErrorReason]
LANE_SEALING_NONE: LaneSealing
LANE_SEALING_AES_256_GCM: LaneSealing
LANE_KIND_UNSPECIFIED: LaneKind
LANE_KIND_TCP: LaneKind
LANE_KIND_SHM: LaneKind
ERROR_REASON_UNSPECIFIED: ErrorReason
UNKNOWN_TENSOR: ErrorReason
MISSING_TENSOR: ErrorReason
WRONG_LENGTH: ErrorReason
WRONG_LAYOUT: ErrorReason
BAD_CHUNK: ErrorReason
POSITION_OUT_OF_RANGE: ErrorReason
MALFORMED_REQUEST: ErrorReason
UNKNOWN_MODEL: ErrorReason
UNKNOWN_HANDOFF: ErrorReason
HANDOFF_GONE: ErrorReason
HANDOFF_EXISTS: ErrorReason
FINGERPRINT_MISMATCH: ErrorReason
ALREADY_CLAIMED: ErrorReason
STALE_CLAIM: ErrorReason
WAIT_TIMED_OUT: ErrorReason
CAPACITY_EXHAUSTED: ErrorReason
DRAINING: ErrorReason
HANDOFF_CANCELLED: ErrorReason
INTERNAL_ERROR: ErrorReason
DIGEST_MISMATCH: ErrorReason
PUSH_ABORTED: ErrorReason
UNAUTHENTICATED: ErrorReason
PERMISSION_DENIED: ErrorReason
MESSAGE_TOO_LARGE: ErrorReason
SHARD_LAYOUT: ErrorReason
SHARD_MISMATCH: ErrorReason
NOT_IN_SHARD: ErrorReason
BROKER_BUSY: ErrorReason
LANE_BROKEN: ErrorReason
BROKER_UNAVAILABLE: ErrorReason
CALL_CANCELLED: ErrorReason
DEADLINE_EXCEEDED: ErrorReason
RPC_FAILED: ErrorReason
BROKER_RESTARTED: ErrorReason

class Carried(_message.Message):
    __slots__ = ("name", "layer", "rows", "cols", "dtype", "heads", "head_dim", "rows_are_positions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    ROWS_ARE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    layer: int
    rows: int
    cols: int
    dtype: str
    heads: int
    head_dim: int
    rows_are_positions: bool
    def __init__(self, name: _Optional[str] = ..., layer: _Optional[int] = ..., rows: _Optional[int] = ..., cols: _Optional[int] = ..., dtype: _Optional[str] = ..., heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., rows_are_positions: _Optional[bool] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("rank", "size")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    size: int
    def __init__(self, rank: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class Contract(_message.Message):
    __slots__ = ("model", "ctx", "hidden", "carried", "fingerprint")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CTX_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    CARRIED_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model: str
    ctx: int
    hidden: int
    carried: _containers.RepeatedCompositeFieldContainer[Carried]
    fingerprint: str
    def __init__(self, model: _Optional[str] = ..., ctx: _Optional[int] = ..., hidden: _Optional[int] = ..., carried: _Optional[_Iterable[_Union[Carried, _Mapping]]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class ListContractsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListContractsResponse(_message.Message):
    __slots__ = ("contracts",)
    CONTRACTS_FIELD_NUMBER: _ClassVar[int]
    contracts: _containers.RepeatedCompositeFieldContainer[Contract]
    def __init__(self, contracts: _Optional[_Iterable[_Union[Contract, _Mapping]]] = ...) -> None: ...

class GetContractRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("tensor", "offset", "crc32c", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    offset: int
    crc32c: int
    data: bytes
    def __init__(self, tensor: _Optional[str] = ..., offset: _Optional[int] = ..., crc32c: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("model", "handoff_id", "position", "fingerprint", "ttl_seconds", "no_wait", "resumable", "resume", "shard", "lane_capability", "lane_connections")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NO_WAIT_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LANE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    LANE_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    handoff_id: str
    position: int
    fingerprint: str
    ttl_seconds: float
    no_wait: bool
    resumable: bool
    resume: bool
    shard: Shard
    lane_capability: bytes
    lane_connections: int
    def __init__(self, model: _Optional[str] = ..., handoff_id: _Optional[str] = ..., position: _Optional[int] = ..., fingerprint: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., no_wait: _Optional[bool] = ..., resumable: _Optional[bool] = ..., resume: _Optional[bool] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ..., lane_capability: _Optional[bytes] = ..., lane_connections: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("handoff_id", "bytes", "chunks", "digest", "duplicate", "incarnation")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    bytes: int
    chunks: int
    digest: str
    duplicate: bool
    incarnation: str
    def __init__(self, handoff_id: _Optional[str] = ..., bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., digest: _Optional[str] = ..., duplicate: _Optional[bool] = ..., incarnation: _Optional[str] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("model", "handoff_id", "supersedes", "shard", "wait_seconds", "lane_capability", "lane_kind", "lane_connections", "incarnation", "incarnation_before_push", "audit")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDES_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LANE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    LANE_KIND_FIELD_NUMBER: _ClassVar[int]
    LANE_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_BEFORE_PUSH_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    model: str
    handoff_id: str
    supersedes: int
    shard: Shard
    wait_seconds: float
    lane_capability: bytes
    lane_kind: LaneKind
    lane_connections: int
    incarnation: str
    incarnation_before_push: bool
    audit: bool
    def __init__(self, model: _Optional[str] = ..., handoff_id: _Optional[str] = ..., supersedes: _Optional[int] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ..., wait_seconds: _Optional[float] = ..., lane_capability: _Optional[bytes] = ..., lane_kind: _Optional[_Union[LaneKind, str]] = ..., lane_connections: _Optional[int] = ..., incarnation: _Optional[str] = ..., incarnation_before_push: _Optional[bool] = ..., audit: _Optional[bool] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("model", "handoff_id", "position", "fingerprint", "claim", "bytes", "chunks", "shard", "lane")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    model: str
    handoff_id: str
    position: int
    fingerprint: str
    claim: int
    bytes: int
    chunks: int
    shard: Shard
    lane: Lane
    def __init__(self, model: _Optional[str] = ..., handoff_id: _Optional[str] = ..., position: _Optional[int] = ..., fingerprint: _Optional[str] = ..., claim: _Optional[int] = ..., bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ..., lane: _Optional[_Union[Lane, _Mapping]] = ...) -> None: ...

class PullEnd(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("header", "chunk", "end")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: Chunk
    end: PullEnd
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., end: _Optional[_Union[PullEnd, _Mapping]] = ...) -> None: ...

class ConfirmRequest(_message.Message):
    __slots__ = ("model", "handoff_id", "claim", "shard")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    model: str
    handoff_id: str
    claim: int
    shard: Shard
    def __init__(self, model: _Optional[str] = ..., handoff_id: _Optional[str] = ..., claim: _Optional[int] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ...) -> None: ...

class ConfirmResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("model", "handoff_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    handoff_id: str
    def __init__(self, model: _Optional[str] = ..., handoff_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class PushProgressRequest(_message.Message):
    __slots__ = ("model", "handoff_id", "shard")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    model: str
    handoff_id: str
    shard: Shard
    def __init__(self, model: _Optional[str] = ..., handoff_id: _Optional[str] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ...) -> None: ...

class TensorProgress(_message.Message):
    __slots__ = ("tensor", "received")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    received: _containers.RepeatedCompositeFieldContainer[ByteRange]
    def __init__(self, tensor: _Optional[str] = ..., received: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PushProgress(_message.Message):
    __slots__ = ("tensors", "complete", "position")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorProgress]
    complete: bool
    position: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorProgress, _Mapping]]] = ..., complete: _Optional[bool] = ..., position: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Lane(_message.Message):
    __slots__ = ("kind", "host", "port", "min_bytes", "path", "host_id", "sealing", "max_connections", "max_frame_bytes", "salted_keys")
    KIND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SEALING_FIELD_NUMBER: _ClassVar[int]
    MAX_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    SALTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    kind: LaneKind
    host: str
    port: int
    min_bytes: int
    path: str
    host_id: str
    sealing: LaneSealing
    max_connections: int
    max_frame_bytes: int
    salted_keys: bool
    def __init__(self, kind: _Optional[_Union[LaneKind, str]] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., min_bytes: _Optional[int] = ..., path: _Optional[str] = ..., host_id: _Optional[str] = ..., sealing: _Optional[_Union[LaneSealing, str]] = ..., max_connections: _Optional[int] = ..., max_frame_bytes: _Optional[int] = ..., salted_keys: _Optional[bool] = ...) -> None: ...

class LanesRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class LanesResponse(_message.Message):
    __slots__ = ("lanes", "incarnation")
    LANES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    lanes: _containers.RepeatedCompositeFieldContainer[Lane]
    incarnation: str
    def __init__(self, lanes: _Optional[_Iterable[_Union[Lane, _Mapping]]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("receiving", "ready", "claimed", "resident_bytes", "max_bytes", "oldest_seconds", "tombstones", "draining", "contracts", "incarnation")
    RECEIVING_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CONTRACTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    receiving: int
    ready: int
    claimed: int
    resident_bytes: int
    max_bytes: int
    oldest_seconds: float
    tombstones: int
    draining: bool
    contracts: _containers.RepeatedCompositeFieldContainer[Contract]
    incarnation: str
    def __init__(self, receiving: _Optional[int] = ..., ready: _Optional[int] = ..., claimed: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., oldest_seconds: _Optional[float] = ..., tombstones: _Optional[int] = ..., draining: _Optional[bool] = ..., contracts: _Optional[_Iterable[_Union[Contract, _Mapping]]] = ..., incarnation: _Optional[str] = ...) -> None: ...
