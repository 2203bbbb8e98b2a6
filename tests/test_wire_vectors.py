"""Test vectors for an implementer in another language: the hand-off digest and the contract fingerprint, exactly as
the .proto and docs/protocol.md define them, each built here byte by byte and checked against the library and a fixed
hex value (copy these into your own tests)."""

from __future__ import annotations

import hashlib
import json
import struct

from handoff_client.protocol.contract import Carried, Contract
from handoff_client.protocol.frames import handoff_digest

# (tensor index, offset, length, crc32c) of three chunks, in the order they arrived
CHUNKS = [(0, 0, 4, 0x12345678), (1, 1048576, 6, 0xDEADBEEF), (0, 4, 4, 0xCAFEF00D)]
DIGEST = "3cd864223d33f81a28df6c2676dad834eb6f1d33b700c1b026da339732676637"

CONTRACT = Contract(
    "tiny",
    16,
    8,
    (
        Carried("k", 0, 16, 8, "bfloat16", rows_are_positions=True),
        Carried("memory", 0, 2, 4, "float32"),
        Carried("v.split", 1, 16, 8, "float16", heads=2, head_dim=4),
    ),
)
CANONICAL = (
    '{"carried":[{"cols":8,"dtype":"bfloat16","layer":0,"name":"k","rows":16,"rows_are_positions":true},'
    '{"cols":4,"dtype":"float32","layer":0,"name":"memory","rows":2},'
    '{"cols":8,"dtype":"float16","head_dim":4,"heads":2,"layer":1,"name":"v.split","rows":16}],'
    '"ctx":16,"hidden":8,"model":"tiny"}'
)
FINGERPRINT = "6a5166f041267c2287190a7a03c237f5714298bc0a8d09ff327316e049964cb1"


def test_the_digest_is_sha256_over_24_byte_little_endian_entries_in_ascending_order():
    entries = b"".join(struct.pack("<IQQI", *chunk) for chunk in sorted(CHUNKS))  # u32, u64, u64, u32
    assert len(entries) == 24 * len(CHUNKS)
    assert hashlib.sha256(entries).hexdigest() == DIGEST  # lowercase hex, 64 characters
    assert handoff_digest(CHUNKS) == DIGEST  # arrival order does not matter


def test_the_fingerprint_is_sha256_of_the_canonical_json():
    """Keys sorted, no whitespace, ASCII; a tensor's `heads`/`head_dim` and `rows_are_positions` only when stated."""
    assert json.dumps(CONTRACT.to_json(), sort_keys=True, separators=(",", ":")) == CANONICAL
    assert hashlib.sha256(CANONICAL.encode()).hexdigest() == FINGERPRINT
    assert CONTRACT.fingerprint == FINGERPRINT


def test_the_proto_ships_with_the_client_and_is_the_one_in_the_repository():
    from pathlib import Path

    from handoff_client import PROTO_PATH

    source = Path(__file__).resolve().parent.parent / "proto" / "handoff" / "v1" / "handoff.proto"
    assert PROTO_PATH.read_text() == source.read_text()
