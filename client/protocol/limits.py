"""The wire's sizes and the broker's default port, the same on both sides (imports nothing: the health check and
the client-only commands read them without loading numpy or protobuf)."""

DEFAULT_PORT = 50051
"""The broker's port when a target names none (gRPC itself would dial 443)."""

MAX_MESSAGE_BYTES = 64 << 20
"""The largest message either side accepts: a chunk of up to this size minus its few header bytes."""

DEFAULT_CHUNK_BYTES = (1 << 20) - 1024
"""Payload bytes per chunk: 1 MiB less room for the frame's few header bytes. Measured end to end on 2-core
machines (benchmarks/bench.py), 512 KiB to 2 MiB cost the least CPU: every copy gRPC's Python layer makes of a frame
stays within a core's 2 MiB L2 cache, where 4 MiB frames spilled and cost ~15 % more CPU in all three processes;
256 KiB paid more per message. Well under gRPC's default 4 MiB message limit, so a peer built from the .proto with
default settings reads every frame."""

MAX_HANDOFF_ID = 256
"""The longest hand-off id, in characters (printable ones only): the broker refuses any other id with
MALFORMED_REQUEST, and a client making ids (the vLLM connector) keeps within it."""
