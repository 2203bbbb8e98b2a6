"""docs/lanes.md's vectors for the sealed TCP lane are what the client puts on the wire, and what the text's
construction gives when built from `cryptography`'s HKDF and AES-GCM alone: HKDF-SHA256 of the capability (the
opening value with no salt, the keys with the broker's salt; info `handoff lane v1 <purpose>`), AES-256-GCM with the message's number as the nonce (u64 little-endian, 4 zero
bytes), a frame's 20-byte header and its bytes sealed as two messages, the end marker as a third."""

from __future__ import annotations

import re
import socket
import struct
from pathlib import Path

import pytest

pytest.importorskip("cryptography", reason="cryptography is not installed: pip install '.[server]'")

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from handoff_client.protocol.frames import crc32c
from handoff_client.protocol.seal import SealedFrames, lane_key, sealed_opening

SEALED = (Path(__file__).resolve().parent.parent / "docs" / "lanes.md").read_text().split("## The sealed TCP lane")[1]
VECTORS = dict(re.findall(r"^\| ([\w ',]+) \| `([0-9a-f]+)` \|$", SEALED.split("\n## ")[0], re.MULTILINE))
CAPABILITY = bytes(range(32))
SALT = bytes(range(32, 64))  # the broker's, sent after READY
FRAME = struct.Struct("<IQII")  # index, offset, length, crc32c (docs/lanes.md)
DATA = b"handoff!"


def hkdf(purpose: str, salt: bytes | None = SALT) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt=salt, info=f"handoff lane v1 {purpose}".encode()).derive(CAPABILITY)


def nonce(number: int) -> bytes:
    return number.to_bytes(8, "little") + bytes(4)


def test_the_keys_and_the_opening_value_are_hkdf_of_the_capability():
    assert len(VECTORS) == 6
    assert hkdf("opening", salt=None).hex() == VECTORS["opening value"]
    for purpose, name in (("push", "push key"), ("pull", "pull key")):
        assert hkdf(purpose).hex() == VECTORS[name]
    assert sealed_opening(CAPABILITY).hex() == VECTORS["opening value"]
    assert lane_key(CAPABILITY, "push", SALT).hex() == VECTORS["push key"]
    assert lane_key(CAPABILITY, "pull", SALT).hex() == VECTORS["pull key"]
    assert lane_key(CAPABILITY, "push", bytes(32)) != lane_key(CAPABILITY, "push", SALT)  # the salt is in the key


def test_a_sealed_push_lane_puts_the_documented_messages_on_the_wire_and_they_open_as_the_text_says():
    assert crc32c(DATA) == 0xE71D7703
    ours, theirs = socket.socketpair()
    with ours, theirs:
        frames = SealedFrames(ours, CAPABILITY, "push", SALT)
        frames.send(1, 0, DATA, crc32c(DATA))
        frames.end()
        ours.shutdown(socket.SHUT_WR)
        wire = b""
        while chunk := theirs.recv(1 << 16):
            wire += chunk
    header, data, end = wire[:36], wire[36 : 36 + len(DATA) + 16], wire[36 + len(DATA) + 16 :]
    assert header.hex() == VECTORS["the frame's header, sealed"]
    assert data.hex() == VECTORS["the frame's bytes, sealed"]
    assert end.hex() == VECTORS["the end marker, sealed"]
    aead = AESGCM(hkdf("push"))
    assert FRAME.unpack(aead.decrypt(nonce(0), header, None)) == (1, 0, len(DATA), 0xE71D7703)
    assert aead.decrypt(nonce(1), data, None) == DATA
    assert FRAME.unpack(aead.decrypt(nonce(2), end, None)) == (0xFFFFFFFF, 0, 0, 0)
