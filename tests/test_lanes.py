"""The TCP lane (docs/lanes.md): a hand-off's bytes beside its gRPC call, with every guarantee of the stream.

Each test runs a real broker on loopback, serving no shared-memory lane (test_shm_lane.py has that one), so that
these clients, on the broker's host, take the TCP lane; the lane's faults are made by speaking its wire by hand.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from certs import Authority
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import DEFAULT_CHUNK_BYTES, HandoffClient
from handoff_client._lane_choice import frame_bytes
from handoff_client.protocol.contract import Carried, Contract
from handoff_client.protocol.errors import CallCancelled, LaneBroken
from handoff_client.protocol.frames import crc32c
from handoff_client.protocol.lane import (
    CAPABILITY_BYTES,
    MAGIC,
    LaneClosed,
    TcpFrames,
    new_capability,
    open_lane,
    read_header,
    recv_exact,
    send_end,
    send_frame,
)
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.seal import SealedFrames, receive_salt, sealed_opening
from lane_wire import (
    LARGE,
    TCP_ONLY,
    claimed_on_a_lane,
    lane_frames,
    lane_port,
    pull_call,
    push_call,
    read_frames,
    result,
)
from proxy import Proxy
from support import raises_handoff_error

MARK = b"KV-CACHE-IN-THE-CLEAR:"


@pytest.fixture
def lane_broker(start_broker):
    return start_broker(contracts={"large": LARGE}, idle_timeout=2.0, max_bytes=256 << 20, **TCP_ONLY)


def lane_bytes(broker, model: str, kind: str) -> float:
    """What the broker's handoff_lane_bytes_total says moved on the TCP lane."""
    labels = {"model": model, "kind": kind, "lane": "tcp"}
    return broker.registry.get_sample_value("handoff_lane_bytes_total", labels) or 0


def test_a_large_hand_off_goes_on_the_lane_both_ways_and_arrives_bit_for_bit(lane_broker):
    tensors = seeded_tensors(LARGE)
    with HandoffClient(lane_broker.address) as client:
        assert client.lane() is not None and client.lane(LARGE.nbytes) is not None
        client.push("large", "r", 1, tensors)
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert lane_bytes(lane_broker, "large", "push") == lane_bytes(lane_broker, "large", "pull") == LARGE.nbytes
    assert_holds_nothing(lane_broker)


WIDE = Contract("wide", 2049, 64, tuple(Carried(f"w{i}", i, 2048, 4096, "float32") for i in range(2)))  # 2 x 32 MiB


@pytest.mark.parametrize(
    "lane, max_message_bytes, chunk_bytes, frame",
    [
        ("shm", 64 << 20, None, 4 << 20),  # a sixteenth of the hand-off, at most 4 MiB
        ("shm", 2 << 20, None, 2 << 20),  # ... and no more than the lane takes
        ("shm", 64 << 20, 1 << 20, 1 << 20),  # a size the caller chose is kept
        ("tcp", 64 << 20, None, DEFAULT_CHUNK_BYTES),  # the TCP lane: the stream's chunk size
    ],
)
def test_a_lane_push_is_cut_into_frames_up_to_4_mib_on_shared_memory_and_the_streams_chunk_on_tcp(
    start_broker, lane, max_message_bytes, chunk_bytes, frame
):
    lanes = TCP_ONLY if lane == "tcp" else {"shared_memory_lane_min_bytes": 1}
    broker = start_broker(contracts={"wide": WIDE}, max_message_bytes=max_message_bytes, **lanes)
    tensors = seeded_tensors(WIDE)
    with HandoffClient(broker.address, chunk_bytes=chunk_bytes) as client:
        assert client.lane(WIDE.nbytes).max_frame_bytes == max_message_bytes
        frames_a_tensor = -(-WIDE.carried[0].nbytes // frame)
        assert client.push("wide", "r", 1, tensors).chunks == len(WIDE.carried) * frames_a_tensor
        assert_same_bits(client.pull("wide", "r").state, tensors)
    labels = {"model": "wide", "kind": "push", "lane": lane}
    assert broker.registry.get_sample_value("handoff_lane_bytes_total", labels) == WIDE.nbytes


def test_a_shared_memory_lane_frame_is_a_sixteenth_of_the_hand_off_from_the_streams_chunk_up_to_4_mib():
    chunk, MiB = DEFAULT_CHUNK_BYTES, 1 << 20
    shm = pb.Lane(kind=pb.LANE_KIND_SHM, max_frame_bytes=64 * MiB)
    assert [frame_bytes(shm, n, chunk) for n in (2 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 1 << 30)] == [
        chunk, MiB, 2 * MiB, 4 * MiB, 4 * MiB,
    ]  # fmt: skip
    assert frame_bytes(pb.Lane(kind=pb.LANE_KIND_SHM, max_frame_bytes=3 * MiB), 1 << 30, chunk) == 3 * MiB
    assert frame_bytes(pb.Lane(kind=pb.LANE_KIND_SHM), 1 << 30, chunk) == chunk  # a broker from before the field
    assert frame_bytes(pb.Lane(kind=pb.LANE_KIND_TCP, max_frame_bytes=64 * MiB), 1 << 30, chunk) == chunk
    assert frame_bytes(pb.Lane(kind=pb.LANE_KIND_TCP, max_frame_bytes=MiB // 2), 1 << 30, chunk) == MiB // 2


def test_a_hand_off_under_the_lanes_floor_and_a_client_without_lanes_use_the_stream(start_broker, contracts):
    broker = start_broker(contracts={**contracts, "large": LARGE}, **TCP_ONLY)
    small = seeded_tensors(contracts["every-dtype"])
    large = seeded_tensors(LARGE)
    with HandoffClient(broker.address) as client, HandoffClient(broker.address, lanes=False) as streams_only:
        client.push("every-dtype", "small", 1, small)
        assert_same_bits(client.pull("every-dtype", "small").state, small)
        streams_only.push("large", "large", 1, large)
        assert_same_bits(streams_only.pull("large", "large").state, large)
    for model, kind in [("every-dtype", "push"), ("every-dtype", "pull"), ("large", "push"), ("large", "pull")]:
        assert lane_bytes(broker, model, kind) == 0


def test_a_tcp_lane_the_client_cannot_reach_costs_one_fast_fallback_and_is_left_alone_for_a_while(start_broker, caplog):
    """As behind a firewall or a NAT the advertised address does not cross: the connection is refused. The pull does
    not wait out the broker's --idle-timeout for a lane that will never come, and later calls go on the streams."""
    broker = start_broker(contracts={"large": LARGE}, lane_advertise_host="127.0.0.2", idle_timeout=20.0, **TCP_ONLY)
    tensors = seeded_tensors(LARGE)
    with HandoffClient(broker.address) as pusher, HandoffClient(broker.address) as puller:
        pusher.push("large", "first", 1, tensors)  # its lane refused: retried on the stream
        assert pusher.lane() is None  # ... and not tried again for LANE_RETRY_AFTER
        pusher.push("large", "second", 1, tensors)
        started = time.monotonic()
        assert_same_bits(puller.pull("large", "first").state, tensors)  # a fresh client: it tries the lane once
        assert time.monotonic() - started < 5, "the pull waited for a lane it could not reach"
        assert_same_bits(puller.pull("large", "second").state, tensors)
    fallbacks = [r.getMessage() for r in caplog.records if getattr(r, "lane_fallback", False)]
    assert len(fallbacks) == 2 and all("127.0.0.2" in f for f in fallbacks), fallbacks
    assert lane_bytes(broker, "large", "push") == lane_bytes(broker, "large", "pull") == 0
    assert_holds_nothing(broker)


def test_no_lanes_offers_none_and_a_push_that_asks_anyway_is_told_to_use_the_stream(start_broker):
    broker = start_broker(contracts={"large": LARGE}, lanes=False)
    with HandoffClient(broker.address) as client:
        assert client.lane() is None
        tensors = seeded_tensors(LARGE)
        client.push("large", "r", 1, tensors)  # on the stream
        assert_same_bits(client.pull("large", "r").state, tensors)
        call = push_call(client, "asks", new_capability())
        error = raises_handoff_error(result, call)
        assert isinstance(error, LaneBroken) and "offers no lane" in error.message


def test_under_tls_the_tcp_lane_is_sealed_and_no_byte_of_the_hand_off_crosses_it_in_the_clear(start_broker):
    """A tap between pusher and broker (a recording relay on the lane's connection) sees the tensors' bytes on a
    plain broker's lane, and nothing of them on a TLS broker's, whose frames are sealed (AES-256-GCM); the pull
    comes back sealed the same way, bit for bit."""
    marked = {c.name: np.frombuffer((MARK * (c.nbytes // len(MARK) + 1))[: c.nbytes], np.float32).reshape(c.shape)
              for c in LARGE.carried}  # fmt: skip
    ca = Authority("handoff test CA")
    server = ca.issue("localhost", server=True)
    tls = {"tls_root_certificates": ca.pem, "tls_server_name": "localhost"}
    for broker, options in ((start_broker(contracts={"large": LARGE}, **TCP_ONLY), {}),
                            (start_broker(contracts={"large": LARGE}, tls_cert=server.cert, tls_key=server.key,
                                          **TCP_ONLY), tls)):  # fmt: skip
        with HandoffClient(broker.address, **options) as client:
            lane = client.lane()
            assert lane.sealing == (pb.LANE_SEALING_AES_256_GCM if options else pb.LANE_SEALING_NONE)
            assert lane.salted_keys == bool(options)  # each sealed connection keyed anew by the broker's salt
            tap = Proxy(lane.port, record=True)
            try:
                client.lane_offers.offers = [pb.Lane(kind=lane.kind, host="127.0.0.1", port=tap.port,
                                               min_bytes=lane.min_bytes, sealing=lane.sealing,
                                               salted_keys=lane.salted_keys)]  # fmt: skip
                client.push("large", "r", 1, marked)
                assert_same_bits(client.pull("large", "r").state, marked)
            finally:
                tap.close()
        wire = bytes(tap.recorded)
        assert len(wire) >= LARGE.nbytes  # the push's bytes crossed the tap (the pull opens the lane its header names)
        assert (MARK in wire) == (not options)  # in the clear without TLS; sealed with it
        assert lane_bytes(broker, "large", "push") == lane_bytes(broker, "large", "pull") == LARGE.nbytes


def test_a_sealed_lane_refuses_its_raw_capability_and_frames_in_the_clear_and_holds_nothing(start_broker):
    ca = Authority("handoff test CA")
    server = ca.issue("localhost", server=True)
    broker = start_broker(contracts={"large": LARGE}, tls_cert=server.cert, tls_key=server.key, **TCP_ONLY)
    index, offset, data = lane_frames(seeded_tensors(LARGE))[0]
    with HandoffClient(broker.address, tls_root_certificates=ca.pem, tls_server_name="localhost") as client:
        capability = new_capability()
        call = push_call(client, "r", capability)
        with pytest.raises(LaneClosed):  # the capability itself keys the frames: it opens nothing on the network
            open_lane("127.0.0.1", client.lane().port, capability, timeout=10)
        with open_lane("127.0.0.1", client.lane().port, sealed_opening(capability), timeout=10) as lane:
            try:
                send_frame(lane, index, offset, data, crc32c(data))
                send_end(lane)
            except OSError:
                pass  # the broker closed the lane at the first header that failed its tag
            error = raises_handoff_error(result, call)
    assert isinstance(error, LaneBroken) and "authentication" in error.message, error
    assert_holds_nothing(broker)


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_a_lane_opened_before_its_call_registered_the_capability_waits_for_it(start_broker, sealed):
    """A pusher opens its lane as it sends the header, and the broker may read the opening first: it is held (up to
    5 s) for the call that registers it, on a sealed lane as on a plain one. (A sealed opening was once closed at
    once, and the push fell back to the stream after --idle-timeout.)"""
    ca = Authority("handoff test CA")
    server = ca.issue("localhost", server=True)
    tls = {"tls_cert": server.cert, "tls_key": server.key} if sealed else {}
    broker = start_broker(contracts={"large": LARGE}, max_bytes=256 << 20, **TCP_ONLY, **tls)
    tensors = seeded_tensors(LARGE)
    options = {"tls_root_certificates": ca.pem, "tls_server_name": "localhost"} if sealed else {}
    with HandoffClient(broker.address, **options) as client, ThreadPoolExecutor(1) as pool:
        capability = new_capability()
        opening = sealed_opening(capability) if sealed else capability
        lane = pool.submit(open_lane, "127.0.0.1", client.lane().port, opening, timeout=10)
        time.sleep(0.5)  # the opening is in before the header is sent
        call = push_call(client, "r", capability)
        sock = lane.result()
        frames = SealedFrames(sock, capability, "push", receive_salt(sock)) if sealed else TcpFrames(sock)
        for index, offset, data in lane_frames(tensors):
            frames.send(index, offset, data, crc32c(data))
        frames.end()
        assert result(call).bytes == LARGE.nbytes
        frames.close()
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert lane_bytes(broker, "large", "push") == LARGE.nbytes
    assert_holds_nothing(broker)


def test_a_connection_without_a_valid_capability_is_closed_unanswered_and_changes_nothing(lane_broker):
    port = lane_port(lane_broker)

    def answer(opening: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(opening)
            if not opening:
                sock.shutdown(socket.SHUT_WR)
            return sock.recv(1)

    def a_capability_nobody_registered() -> None:
        with pytest.raises(LaneClosed):
            open_lane("127.0.0.1", port, new_capability(), timeout=10)

    openings = (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 21, MAGIC + bytes(CAPABILITY_BYTES), b"")
    with ThreadPoolExecutor(4) as pool:  # (the unregistered ones are each held the opening's 5 s: at once, not in turn)
        unregistered = pool.submit(a_capability_nobody_registered)
        assert list(pool.map(answer, openings)) == [b"", b"", b""]  # closed, no READY
        unregistered.result()
    assert_holds_nothing(lane_broker)


def test_a_capability_is_single_use_and_void_once_its_call_ended(lane_broker):
    tensors = seeded_tensors(LARGE)
    with HandoffClient(lane_broker.address) as client:
        capability, stream, header = claimed_on_a_lane(client, lane_broker, tensors)
        assert header.HasField("lane")
        with open_lane("127.0.0.1", header.lane.port, capability, timeout=10) as lane:
            with pytest.raises(LaneClosed):  # the same capability again, while the first lane is open
                open_lane("127.0.0.1", header.lane.port, capability, timeout=10)
            received = read_frames(lane)
        assert isinstance(next(stream), pb.PullEnd)
        assert received == LARGE.nbytes
        client._confirm_claim("large", "r", header.claim, 10)
        with pytest.raises(LaneClosed):  # and after its call ended
            open_lane("127.0.0.1", header.lane.port, capability, timeout=10)
    assert_holds_nothing(lane_broker)


def test_a_pull_whose_lane_is_cut_midway_returns_the_claim_and_the_next_pull_gets_it_whole(lane_broker):
    tensors = seeded_tensors(LARGE)
    with HandoffClient(lane_broker.address) as client:
        capability, stream, header = claimed_on_a_lane(client, lane_broker, tensors)
        with open_lane("127.0.0.1", header.lane.port, capability, timeout=10) as lane:
            frame = read_header(lane)
            recv_exact(lane, frame.length // 2)  # half a chunk, then the decoder dies
        error = raises_handoff_error(lambda: list(stream))
        assert isinstance(error, LaneBroken), error
        assert_same_bits(client.pull("large", "r", timeout=20).state, tensors)
    assert_holds_nothing(lane_broker)


def test_a_pull_that_never_opens_its_lane_returns_the_claim_after_the_idle_timeout(lane_broker):
    tensors = seeded_tensors(LARGE)
    with HandoffClient(lane_broker.address) as client:
        client.push("large", "r", 1, tensors)
        stream = pull_call(lane_broker.address, "r", new_capability())
        assert next(stream).HasField("lane")
        error = raises_handoff_error(lambda: list(stream))  # after --idle-timeout (2 s here)
        assert isinstance(error, LaneBroken) and "within 2 s" in error.message
        assert_same_bits(client.pull("large", "r", timeout=20).state, tensors)


def test_a_cancel_ends_a_pull_on_its_lane_and_frees_everything(start_broker):
    wide = Contract("wide", 2, 64, tuple(Carried(f"k{i}", i, 4096, 4096, "float32") for i in range(4)))  # 256 MiB
    broker = start_broker(contracts={"wide": wide}, max_bytes=512 << 20, **TCP_ONLY)
    with HandoffClient(broker.address) as client:
        client.push("wide", "r", 1, {c.name: np.zeros(c.shape, np.float32) for c in wide.carried})
        capability = new_capability()
        stream = pull_call(broker.address, "r", capability, model="wide")
        header = next(stream)
        with open_lane("127.0.0.1", header.lane.port, capability, timeout=30) as lane:
            read_header(lane)  # the broker is sending; the reader reads no further
            assert client.cancel("wide", "r")
            error = raises_handoff_error(lambda: list(stream))
        assert error.reason == "HANDOFF_CANCELLED" or isinstance(error, CallCancelled), error
    assert_holds_nothing(broker)


def test_a_reader_that_stops_reading_its_lane_is_revoked_after_the_lease(start_broker):
    wide = Contract("wide", 2, 64, tuple(Carried(f"k{i}", i, 4096, 4096, "float32") for i in range(4)))  # 256 MiB
    broker = start_broker(contracts={"wide": wide}, lease=1.0, max_bytes=512 << 20, **TCP_ONLY)
    tensors = {c.name: np.full(c.shape, i, np.float32) for i, c in enumerate(wide.carried)}
    with HandoffClient(broker.address) as client:
        client.push("wide", "r", 1, tensors)
        capability = new_capability()
        stream = pull_call(broker.address, "r", capability, model="wide")
        header = next(stream)
        with open_lane("127.0.0.1", header.lane.port, capability, timeout=30):
            started = time.monotonic()
            error = raises_handoff_error(lambda: list(stream))  # nothing read: the broker's sends stall
            assert time.monotonic() - started < 10
        assert isinstance(error, CallCancelled), error  # revoked, as a stalled stream is
        got = client.pull("wide", "r", timeout=30).state
        assert all(np.array_equal(got[name], tensors[name]) for name in tensors)


def test_a_push_whose_lane_is_cut_midway_keeps_nothing_visible_and_a_resumable_one_resumes(lane_broker):
    tensors = seeded_tensors(LARGE)
    frames = lane_frames(tensors)
    with HandoffClient(lane_broker.address) as client:
        capability = new_capability()
        call = push_call(client, "r", capability, resumable=True)
        with open_lane("127.0.0.1", lane_port(lane_broker), capability, timeout=10) as lane:
            for index, offset, data in frames[: len(frames) // 2]:
                send_frame(lane, index, offset, data, crc32c(data))
        assert isinstance(raises_handoff_error(result, call), LaneBroken)
        assert lane_broker.store.stats().ready == 0  # nothing visible
        held = client.push_progress("large", "r")
        assert sum(r.length for t in held.tensors for r in t.received) == LARGE.nbytes // 2
        capability = new_capability()
        call = push_call(client, "r", capability, resumable=True, resume=True)
        with open_lane("127.0.0.1", lane_port(lane_broker), capability, timeout=10) as lane:
            for index, offset, data in frames[len(frames) // 2 :]:
                send_frame(lane, index, offset, data, crc32c(data))
            send_end(lane)
        assert result(call).bytes == LARGE.nbytes
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert_holds_nothing(lane_broker)


def test_a_bad_frame_on_a_push_lane_is_refused_as_on_the_stream_and_frees_everything(lane_broker):
    tensors = seeded_tensors(LARGE)
    index, offset, data = lane_frames(tensors)[0]
    with HandoffClient(lane_broker.address) as client:
        capability = new_capability()
        call = push_call(client, "r", capability)
        with open_lane("127.0.0.1", lane_port(lane_broker), capability, timeout=10) as lane:
            send_frame(lane, index, offset, data, crc32c(data) ^ 1)
            send_end(lane)
        error = raises_handoff_error(result, call)
        assert error.reason == "BAD_CHUNK" and "k0" in error.message
    assert_holds_nothing(lane_broker)


def test_a_silent_push_lane_is_dropped_after_the_idle_timeout(lane_broker):
    """The lane's read times out (LANE_BROKEN) as the store's timer for a push gone silent ends the call
    (CANCELLED, as for a silent stream): both at --idle-timeout, so either may say it first."""
    with HandoffClient(lane_broker.address) as client:
        capability = new_capability()
        call = push_call(client, "r", capability)
        with open_lane("127.0.0.1", lane_port(lane_broker), capability, timeout=10):
            started = time.monotonic()
            error = raises_handoff_error(result, call)  # after --idle-timeout (2 s)
            assert isinstance(error, (LaneBroken, CallCancelled)), error
            assert time.monotonic() - started < 8
    assert_holds_nothing(lane_broker)
