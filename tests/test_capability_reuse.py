"""Issue 27's suspicion, proven and made harmless: the broker remembers a capability whose call ended only for its
last 4,096 voids, so a client may have it taken again after that. A sealed lane's keys take a salt the broker draws
afresh for each connection (handoff_client/protocol/seal.py), so that lane is keyed anew: no AES-GCM key and nonce ever
seal twice. Without the salt the second lane put the very same ciphertexts on the wire (seen)."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("cryptography", reason="cryptography is not installed: pip install '.[server]'")

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from handoff_broker.lane_calls import LaneCall
from handoff_broker.lanes import VOIDED_REMEMBERED, LaneListener
from handoff_client.protocol.frames import crc32c
from handoff_client.protocol.lane import FRAME, MAGIC, READY, new_capability
from handoff_client.protocol.seal import SALT_BYTES, lane_key, sealed_opening

DATA = b"the same bytes, pulled twice"


def pulled_wire(lanes: LaneListener, capability: bytes) -> bytes:
    """Everything the broker puts on a sealed pull lane opened with `capability` that carries one frame of DATA."""
    call = LaneCall(lanes, capability, "m")
    try:
        with socket.create_connection(("127.0.0.1", lanes.port), timeout=10) as sock:
            sock.sendall(MAGIC + sealed_opening(capability))
            frames = call.open(10, len(DATA), "pull")
            frames.send(0, 0, DATA, crc32c(DATA))
            frames.end()
            call.close()
            wire = b""
            while chunk := sock.recv(1 << 16):
                wire += chunk
    finally:
        call.close()
    return wire


def sealed_messages(wire: bytes) -> list[bytes]:
    """The three sealed messages at the end of a pull lane: the frame's header, its bytes, the end marker."""
    header, data = FRAME.size + 16, len(DATA) + 16
    tail = wire[-(header + data + header) :]
    return [tail[:header], tail[header : header + data], tail[header + data :]]


def test_a_capability_taken_again_after_thousands_of_calls_never_seals_under_a_key_used_before():
    lanes = LaneListener(("127.0.0.1", 0), sealed=True)
    lanes.start()
    try:
        reused = new_capability()
        first = pulled_wire(lanes, reused)
        with pytest.raises(ValueError):  # at once, it is refused: single-use
            lanes.expect(reused)
        for _ in range(VOIDED_REMEMBERED):
            lanes.forget(lanes.expect(new_capability()))
        second = pulled_wire(lanes, reused)  # ... but no longer remembered: it opens a lane again
    finally:
        lanes.close()
    assert len(first) == len(second) == len(READY) + SALT_BYTES + 2 * (FRAME.size + 16) + len(DATA) + 16
    for a, b in zip(sealed_messages(first), sealed_messages(second)):
        assert a != b, "the same message under the same key and nonce: a key was used again"
    for wire in (first, second):  # each opens under the documented key, from that connection's own salt
        assert wire[:1] == READY
        aead = AESGCM(lane_key(reused, "pull", wire[1 : 1 + SALT_BYTES]))
        header, data, end = sealed_messages(wire)
        assert FRAME.unpack(aead.decrypt(bytes(12), header, None)) == (0, 0, len(DATA), crc32c(DATA))
        assert aead.decrypt((1).to_bytes(8, "little") + bytes(4), data, None) == DATA
        assert FRAME.unpack(aead.decrypt((2).to_bytes(8, "little") + bytes(4), end, None))[0] == 0xFFFFFFFF


def test_registering_and_forgetting_capabilities_never_waits_on_the_listeners_reading_thread():
    """Each registration and each forget wakes the thread that reads openings, through a socket pair: written
    blocking, a few hundred wakes that thread had not yet read made the next call's thread wait for it."""
    lanes = LaneListener(("127.0.0.1", 0), sealed=True)  # (its reading thread not started: nothing reads the wakes)
    try:
        started = time.monotonic()
        for _ in range(2000):
            lanes.forget(lanes.expect(new_capability()))
        assert time.monotonic() - started < 10
    finally:
        lanes.close()


def test_a_client_takes_a_sealed_lane_only_when_its_keys_take_the_brokers_salt():
    """A broker of 0.1 offered its sealed TCP lane without `salted_keys` (keys from the capability alone), and a
    sealing a client does not know must never be taken as the clear: both keep the client on the streams."""
    from handoff_client._lane_choice import choose
    from handoff_client.protocol.messages import handoff_pb2 as pb

    offer = {"kind": pb.LANE_KIND_TCP, "host": "127.0.0.1", "port": 1, "min_bytes": 1}
    assert choose([pb.Lane(**offer, sealing=pb.LANE_SEALING_AES_256_GCM, salted_keys=True)], 1 << 20) is not None
    assert choose([pb.Lane(**offer, sealing=pb.LANE_SEALING_AES_256_GCM)], 1 << 20) is None
    assert choose([pb.Lane(**offer, sealing=7, salted_keys=True)], 1 << 20) is None  # (a sealing of a later broker)
    assert choose([pb.Lane(**offer)], 1 << 20) is not None  # (a broker serving no TLS: its lane is in the clear)
