"""A TCP lane striped over several connections (docs/lanes.md, "Striping"): each connection presents a capability
derived from the call's, frames go whole on any of them, each ends with its own end marker, and every guarantee
of the one-connection lane holds. Each test runs a real broker on loopback; the faults are made by speaking the
wire by hand."""

from __future__ import annotations

import hashlib
import hmac
import os
import resource
import socket

import numpy as np
import pytest
from certs import Authority
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import HandoffClient
from handoff_client.protocol.errors import LaneBroken, MalformedRequest
from handoff_client.protocol.frames import crc32c, handoff_digest
from handoff_client.protocol.lane import (
    MAGIC,
    READY,
    LaneClosed,
    connection_capabilities,
    hkdf_sha256,
    new_capability,
    open_lane,
    open_lanes,
    read_header,
    recv_exact,
    send_end,
    send_frame,
)
from handoff_client.protocol.messages import handoff_pb2 as pb
from lane_wire import LARGE, TCP_ONLY, claimed_on_a_lane, lane_frames, lane_port, pull_call, push_call, result
from support import raises_handoff_error


@pytest.fixture
def lane_broker(start_broker):
    return start_broker(contracts={"large": LARGE}, idle_timeout=2.0, max_bytes=256 << 20, **TCP_ONLY)


# -- what each connection presents ----------------------------------------------------------------------------------


def test_hkdf_is_rfc_5869s_and_each_connection_presents_its_own_derived_capability():
    # RFC 5869, test case 3 (SHA-256, no salt, no info): the first 32 bytes of its OKM.
    okm = "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"
    assert hkdf_sha256(bytes([0x0B] * 22), b"").hex() == okm
    capability = bytes(range(32))
    first, second, third = connection_capabilities(capability, 3)
    assert first == capability  # one connection presents the call's own: the lane as it always was
    prk = hmac.new(bytes(32), capability, hashlib.sha256).digest()
    assert second == hmac.new(prk, b"handoff lane v1 connection 1\x01", hashlib.sha256).digest()
    assert third == hkdf_sha256(capability, b"handoff lane v1 connection 2") and len({first, second, third}) == 3
    # the vector docs/lanes.md gives an implementer
    assert second.hex() == "36634a50963a95901d94de80e102b48d58d4957003388290aaa7e09a276600b1"


# -- end to end ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("connections", [2, 4])
def test_a_hand_off_striped_over_several_connections_arrives_bit_for_bit_both_ways(lane_broker, connections):
    tensors = seeded_tensors(LARGE)
    with HandoffClient(lane_broker.address, lane_connections=connections) as client:
        assert client.lane().max_connections == 8  # the broker's default
        client.push("large", "r", 1, tensors)
        assert_same_bits(client.pull("large", "r").state, tensors)
    moved = {kind: lane_broker.registry.get_sample_value("handoff_lane_bytes_total",
                                                         {"model": "large", "kind": kind, "lane": "tcp"})
             for kind in ("push", "pull")}  # fmt: skip
    assert moved == {"push": LARGE.nbytes, "pull": LARGE.nbytes}
    assert_holds_nothing(lane_broker)


def test_a_striped_lane_works_with_its_sockets_numbered_past_1024(lane_broker, caplog):
    """select() cannot watch a descriptor numbered 1024 or more: with 1,100 files open, every striped push and pull
    once failed ("filedescriptor out of range in select()") and fell back to the stream. Here the client and the
    broker share the process, so both sides' sockets are numbered past 1,100."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1400
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        tensors = seeded_tensors(LARGE)
        with HandoffClient(lane_broker.address, lane_connections=4) as client:
            client.push("large", "r", 1, tensors)
            assert_same_bits(client.pull("large", "r").state, tensors)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fallbacks = [r.getMessage() for r in caplog.records if getattr(r, "lane_fallback", False)]
    assert not fallbacks, fallbacks
    moved = [lane_broker.registry.get_sample_value("handoff_lane_bytes_total",
                                                   {"model": "large", "kind": kind, "lane": "tcp"})
             for kind in ("push", "pull")]  # fmt: skip
    assert moved == [LARGE.nbytes, LARGE.nbytes]


def test_a_sealed_lane_is_striped_with_every_connection_sealed_under_its_own_key(start_broker):
    ca = Authority("handoff test CA")
    server = ca.issue("localhost", server=True)
    broker = start_broker(contracts={"large": LARGE}, tls_cert=server.cert, tls_key=server.key, **TCP_ONLY)
    tensors = seeded_tensors(LARGE, seed=3)
    with HandoffClient(broker.address, tls_root_certificates=ca.pem, tls_server_name="localhost",
                       lane_connections=3) as client:  # fmt: skip
        assert client.lane().sealing == pb.LANE_SEALING_AES_256_GCM
        client.push("large", "r", 1, tensors)
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert_holds_nothing(broker)


def test_the_shared_memory_lane_is_never_striped(start_broker):
    broker = start_broker(contracts={"large": LARGE})  # clients here take its shared-memory lane
    tensors = seeded_tensors(LARGE, seed=4)
    with HandoffClient(broker.address, lane_connections=4) as client:
        assert client.lane().kind == pb.LANE_KIND_SHM
        client.push("large", "r", 1, tensors)
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert_holds_nothing(broker)


# -- the broker's side of the wire ----------------------------------------------------------------------------------


def test_a_striped_pull_spreads_its_frames_over_every_connection_and_ends_each(lane_broker):
    tensors = seeded_tensors(LARGE, seed=5)
    with HandoffClient(lane_broker.address, chunk_bytes=1 << 20) as client:
        capability, stream, header = claimed_on_a_lane(client, lane_broker, tensors, lane_connections=3)
        lanes = open_lanes("127.0.0.1", header.lane.port, connection_capabilities(capability, 3), timeout=10)
        received = {name: np.empty_like(array) for name, array in tensors.items()}
        per_connection, entries = [0, 0, 0], []
        unended = set(range(3))
        while unended:  # (one connection at a time: the broker's socket buffers hold what the others send)
            for number in sorted(unended):
                frame = read_header(lanes[number])
                if frame.end:
                    unended.discard(number)
                    continue
                data = recv_exact(lanes[number], frame.length)
                assert crc32c(data) == frame.crc
                name = LARGE.carried[frame.index].name
                received[name].reshape(-1).view(np.uint8)[frame.offset : frame.offset + frame.length] = np.frombuffer(
                    data, np.uint8
                )
                per_connection[number] += 1
                entries.append((frame.index, frame.offset, frame.length, frame.crc))
        for lane in lanes:
            lane.close()
        end = next(stream)
        assert isinstance(end, pb.PullEnd) and end.digest == handoff_digest(entries)
        assert all(count >= 4 for count in per_connection), per_connection  # 16 frames, in turn over 3
        assert_same_bits(received, tensors)
        client._confirm_claim("large", "r", header.claim, 10)
    assert_holds_nothing(lane_broker)


def test_a_push_may_send_its_frames_on_any_of_its_connections(lane_broker):
    tensors = seeded_tensors(LARGE, seed=6)
    frames = lane_frames(tensors)
    with HandoffClient(lane_broker.address) as client:
        capability = new_capability()
        call = push_call(client, "r", capability, lane_connections=2)
        lanes = open_lanes("127.0.0.1", lane_port(lane_broker), connection_capabilities(capability, 2), timeout=10)
        for number, (index, offset, data) in enumerate(frames):
            send_frame(lanes[1 if number < 3 else number % 2], index, offset, data, crc32c(data))
        for lane in lanes:
            send_end(lane)
            lane.close()
        assert result(call).bytes == LARGE.nbytes
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert_holds_nothing(lane_broker)


def test_a_striped_push_one_of_whose_connections_never_comes_is_lane_broken_and_holds_nothing(lane_broker):
    with HandoffClient(lane_broker.address) as client:
        capability = new_capability()
        call = push_call(client, "r", capability, lane_connections=3)
        port = lane_port(lane_broker)
        two = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for lane, each in zip(two, connection_capabilities(capability, 3)):
            lane.sendall(MAGIC + each)  # the first two present theirs; the third never comes
        error = raises_handoff_error(result, call)  # after --idle-timeout (2 s)
        assert isinstance(error, LaneBroken) and "2 of the lane's 3 connections came within 2 s" in error.message
        assert [lane.recv(1) for lane in two] == [b"", b""]  # never READY: closed
        for lane in two:
            lane.close()
    assert_holds_nothing(lane_broker)


def test_a_striped_push_one_of_whose_connections_breaks_keeps_nothing_visible_and_a_resumable_one_resumes(
    lane_broker,
):
    tensors = seeded_tensors(LARGE, seed=7)
    frames = lane_frames(tensors)
    with HandoffClient(lane_broker.address) as client:
        capability = new_capability()
        call = push_call(client, "r", capability, resumable=True, lane_connections=2)
        lanes = open_lanes("127.0.0.1", lane_port(lane_broker), connection_capabilities(capability, 2), timeout=10)
        for number, (index, offset, data) in enumerate(frames[:8]):
            send_frame(lanes[number % 2], index, offset, data, crc32c(data))
        send_end(lanes[0])  # one connection ends properly, the other is cut before its end marker
        for lane in lanes:
            lane.close()
        assert isinstance(raises_handoff_error(result, call), LaneBroken)
        assert lane_broker.store.stats().ready == 0  # nothing visible
        assert client.push("large", "r", 1, tensors, resumable=True).bytes == LARGE.nbytes  # the rest, resumed
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert_holds_nothing(lane_broker)


def test_more_connections_than_the_broker_allows_are_refused_naming_its_limit(start_broker):
    broker = start_broker(contracts={"large": LARGE}, lane_max_connections=2, **TCP_ONLY)
    with HandoffClient(broker.address) as client:
        assert client.lane().max_connections == 2
        error = raises_handoff_error(result, push_call(client, "r", new_capability(), lane_connections=3))
        assert isinstance(error, MalformedRequest) and "at most 2 connections" in error.message, error
        error = raises_handoff_error(lambda: list(pull_call(broker.address, "r", new_capability(),
                                                            lane_connections=3)))  # fmt: skip
        assert isinstance(error, MalformedRequest) and "at most 2 connections" in error.message, error
    with HandoffClient(broker.address, lane_connections=4) as client:  # asks for 4: takes the 2 offered
        tensors = seeded_tensors(LARGE, seed=8)
        client.push("large", "r", 1, tensors)
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert_holds_nothing(broker)


def test_a_connection_capability_is_single_use_and_opens_nothing_without_its_call(lane_broker):
    tensors = seeded_tensors(LARGE, seed=9)
    with HandoffClient(lane_broker.address) as client:
        port = lane_port(lane_broker)
        with pytest.raises(LaneClosed):  # derived from a capability no call registered
            open_lane("127.0.0.1", port, connection_capabilities(new_capability(), 2)[1], timeout=10)
        capability, stream, header = claimed_on_a_lane(client, lane_broker, tensors, lane_connections=2)
        lanes = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        for lane, each in zip(lanes, reversed(connection_capabilities(capability, 2))):  # in any order
            lane.sendall(MAGIC + each)
        assert [lane.recv(1) for lane in lanes] == [READY, READY]  # both came: the lane is ready
        with pytest.raises(LaneClosed):  # a connection's capability presented again
            open_lane("127.0.0.1", port, connection_capabilities(capability, 2)[1], timeout=10)
        total = 0
        for lane in lanes:
            while not (frame := read_header(lane)).end:
                total += len(recv_exact(lane, frame.length))
            lane.close()
        assert total == LARGE.nbytes and isinstance(next(stream), pb.PullEnd)
        client._confirm_claim("large", "r", header.claim, 10)
    assert_holds_nothing(lane_broker)


def test_a_capability_of_the_wrong_length_is_refused_naming_its_length_and_changes_nothing(lane_broker):
    with HandoffClient(lane_broker.address) as client:
        for connections in (1, 3):
            error = raises_handoff_error(result, push_call(client, "r", b"short", lane_connections=connections))
            assert isinstance(error, MalformedRequest) and "32 bytes, not 5" in error.message, error
        tensors = seeded_tensors(LARGE, seed=10)
        client.push("large", "r", 1, tensors)  # the broker still serves, its lane too
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert_holds_nothing(lane_broker)
