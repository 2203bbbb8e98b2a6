"""The shared-memory lane (docs/lanes.md): a client on the broker's host moves a hand-off's bytes through a ring of
shared memory beside its gRPC call, with every guarantee of the stream and the TCP lane.

Each test runs a real broker on loopback; its faults come from a real process killed mid-push and from speaking the
lane's wire by hand. (Every test of test_roundtrip, test_claims and test_tensor_parallel also runs on this lane.)
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from certs import Authority
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_broker.auth import TokenTable, hash_token
from handoff_client import HandoffClient
from handoff_client._lane_choice import choose
from handoff_client.protocol.contract import Carried, Contract
from handoff_client.protocol.errors import BadChunk, CallCancelled, LaneBroken, from_rpc_error
from handoff_client.protocol.frames import crc32c
from handoff_client.protocol.lane import FRAME, new_capability
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.ring import PIECE, RingFrames, map_ring, new_ring, open_ring_lane
from handoff_client.protocol.wire import method_path
from lane_wire import pull_call, push_call, result
from support import open_channel, raises_handoff_error

ROWS, COLS = 1024, 1024  # 4 MiB a tensor in float32: well past the lanes' 1 MiB floor
LARGE = Contract("large", ROWS + 1, 64, tuple(Carried(f"k{i}", i, ROWS, COLS, "float32") for i in range(4)))
WIDE = Contract("wide", 2, 64, tuple(Carried(f"k{i}", i, 4096, 4096, "float32") for i in range(4)))  # 256 MiB
WORKERS = Path(__file__).parent / "workers.py"


@pytest.fixture
def shm_broker(start_broker):
    return start_broker(contracts={"large": LARGE}, idle_timeout=2.0, max_bytes=256 << 20)


def lane_bytes(broker, model: str, kind: str, lane: str) -> float:
    """What the broker's handoff_lane_bytes_total says moved on that lane."""
    labels = {"model": model, "kind": kind, "lane": lane}
    return broker.registry.get_sample_value("handoff_lane_bytes_total", labels) or 0


def rings_mapped() -> int:
    """Lane rings this process (the broker's, in these tests) still maps."""
    return Path("/proc/self/maps").read_text().count("handoff-lane-ring")


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_a_client_on_the_brokers_host_takes_the_shared_memory_lane_both_ways_and_every_ring_is_unmapped(shm_broker):
    tensors = seeded_tensors(LARGE)
    with HandoffClient(shm_broker.address) as client:
        assert {lane.kind for lane in client.lane_offers.offers or [client.lane()]} >= {pb.LANE_KIND_SHM}
        assert {lane.kind for lane in client.lane_offers.offers} == {pb.LANE_KIND_TCP, pb.LANE_KIND_SHM}
        assert client.lane(LARGE.nbytes).kind == pb.LANE_KIND_SHM
        client.push("large", "r", 1, tensors)
        into = {c.name: np.full((ROWS, COLS), 7, np.float32) for c in LARGE.carried}
        assert_same_bits(client.pull("large", "r", into=into).state, tensors)
        assert_same_bits(into, tensors)
    assert (
        lane_bytes(shm_broker, "large", "push", "shm") == lane_bytes(shm_broker, "large", "pull", "shm") == LARGE.nbytes
    )
    assert lane_bytes(shm_broker, "large", "push", "tcp") == lane_bytes(shm_broker, "large", "pull", "tcp") == 0
    wait_until(lambda: rings_mapped() == 0)  # the broker's and the client's: each call's ring is gone with it
    assert_holds_nothing(shm_broker)


def test_under_the_shared_memory_lanes_floor_a_client_on_the_brokers_host_takes_the_tcp_lane_both_ways(start_broker):
    """The shared-memory lane costs more a call than the TCP lane (its ring, its descriptor): below its min_bytes
    (16 MiB by default) a client here pushes on the TCP lane, and its pull, which asks for shared memory before it
    knows the size, is named the TCP lane instead."""
    small = Contract("small", ROWS + 1, 64, (Carried("k", 0, ROWS, COLS, "float32"),))  # 4 MiB
    broker = start_broker(contracts={"large": LARGE, "small": small})
    with HandoffClient(broker.address) as client:
        assert client.lane().kind == pb.LANE_KIND_SHM  # what a pull asks for
        assert client.lane(small.nbytes).kind == pb.LANE_KIND_TCP and client.lane(LARGE.nbytes).kind == pb.LANE_KIND_SHM
        for contract in (small, LARGE):
            tensors = seeded_tensors(contract)
            client.push(contract.model, "r", 1, tensors)
            assert_same_bits(client.pull(contract.model, "r").state, tensors)
    assert lane_bytes(broker, "small", "push", "tcp") == lane_bytes(broker, "small", "pull", "tcp") == small.nbytes
    assert lane_bytes(broker, "large", "push", "shm") == lane_bytes(broker, "large", "pull", "shm") == LARGE.nbytes
    assert_holds_nothing(broker)


def test_a_client_told_not_to_or_on_another_host_takes_the_tcp_lane(shm_broker):
    tensors = seeded_tensors(LARGE)
    with HandoffClient(shm_broker.address, shared_memory=False) as client:
        assert client.lane().kind == pb.LANE_KIND_TCP
        client.push("large", "r", 1, tensors)
        assert_same_bits(client.pull("large", "r").state, tensors)
        elsewhere = [lane if lane.kind == pb.LANE_KIND_TCP else pb.Lane(kind=lane.kind, path=lane.path,
                     host_id="another-hosts-boot-id", min_bytes=lane.min_bytes) for lane in client.lane_offers.offers]  # fmt: skip
        assert choose(elsewhere, LARGE.nbytes).kind == pb.LANE_KIND_TCP
        assert choose(client.lane_offers.offers, 1024) is None  # under the floor: the stream
    assert (
        lane_bytes(shm_broker, "large", "push", "tcp") == lane_bytes(shm_broker, "large", "pull", "tcp") == LARGE.nbytes
    )
    assert lane_bytes(shm_broker, "large", "push", "shm") == 0


def test_a_broker_serving_tls_still_offers_the_shared_memory_lane_unsealed_and_the_tcp_lane_sealed(start_broker):
    """Bytes that never leave the host's memory need no encryption; the TCP lane's do (test_lanes.py)."""
    ca = Authority("handoff test CA")
    server = ca.issue("localhost", server=True)
    broker = start_broker(contracts={"large": LARGE}, tls_cert=server.cert, tls_key=server.key)
    tensors = seeded_tensors(LARGE)
    with HandoffClient(broker.address, tls_root_certificates=ca.pem, tls_server_name="localhost") as client:
        assert client.lane().kind == pb.LANE_KIND_SHM
        offers = {lane.kind: lane.sealing for lane in client.lane_offers.offers}
        assert offers == {pb.LANE_KIND_TCP: pb.LANE_SEALING_AES_256_GCM, pb.LANE_KIND_SHM: pb.LANE_SEALING_NONE}
        client.push("large", "r", 1, tensors)
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert lane_bytes(broker, "large", "push", "shm") == lane_bytes(broker, "large", "pull", "shm") == LARGE.nbytes


def test_the_lanes_socket_admits_only_the_brokers_user(shm_broker):
    with HandoffClient(shm_broker.address) as client:
        path = client.lane().path
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        return  # (only root can start a process of another user to try, with a Python that user may run)
    probe = "import socket, sys\ntry:\n socket.socket(socket.AF_UNIX).connect(sys.argv[1])\nexcept OSError as e:\n print(type(e).__name__)"
    other = subprocess.run(["/usr/bin/python3", "-c", probe, path], user=65534, capture_output=True, text=True,
                           timeout=30, cwd="/", check=False)  # fmt: skip
    assert other.stdout.strip() == "PermissionError", other


def test_only_the_workers_that_push_and_pull_are_shown_the_lanes_socket_path_and_boot_id(start_broker, tmp_path):
    """GetLanes names the socket's path and the host's boot id: a token of the admin role (status), which takes no
    lane, is refused it; once, any token holder saw them."""
    tokens = [{"name": name, "sha256": hash_token(name), "roles": [name]} for name in ("prefill", "decode", "admin")]
    (tmp_path / "tokens.json").write_text(json.dumps({"tokens": tokens}))
    broker = start_broker(contracts={"large": LARGE}, tokens=TokenTable.load(tmp_path / "tokens.json"))
    with open_channel(broker.address) as channel:
        lanes = channel.unary_unary(method_path("GetLanes"), request_serializer=pb.LanesRequest.SerializeToString,
                                    response_deserializer=pb.LanesResponse.FromString)  # fmt: skip
        for role in ("prefill", "decode"):
            offered = lanes(pb.LanesRequest(), metadata=[("authorization", f"Bearer {role}")], timeout=10).lanes
            assert any(lane.path and lane.host_id for lane in offered), role
        with pytest.raises(grpc.RpcError) as refused:
            lanes(pb.LanesRequest(), metadata=[("authorization", "Bearer admin")], timeout=10)
    assert from_rpc_error(refused.value).reason == "PERMISSION_DENIED"


def test_a_shared_memory_lane_out_of_reach_sends_the_client_to_the_tcp_lane(start_broker, tmp_path, caplog):
    """As from another container on the same host: the socket's path is not there."""
    broker = start_broker(contracts={"large": LARGE}, lane_socket=str(tmp_path / "lane.sock"))
    tensors = seeded_tensors(LARGE)
    (tmp_path / "lane.sock").unlink()
    with HandoffClient(broker.address) as client:
        client.push("large", "first", 1, tensors)  # its lane unreachable: retried on the stream, and said so
        [warning] = [r for r in caplog.records if getattr(r, "lane_fallback", False)]
        assert warning.levelname == "WARNING" and "lane.sock" in warning.getMessage()
        assert client.lane().kind == pb.LANE_KIND_TCP  # and no later call tries it again
        client.push("large", "second", 1, tensors)
        assert_same_bits(client.pull("large", "first").state, tensors)
    assert lane_bytes(broker, "large", "push", "tcp") == LARGE.nbytes
    assert lane_bytes(broker, "large", "push", "shm") == 0


def test_a_pusher_killed_holding_the_ring_leaves_nothing_visible_or_mapped_and_its_push_resumes(shm_broker):
    worker = subprocess.Popen([sys.executable, str(WORKERS), "push-on-ring-and-stall", shm_broker.address, "large",
                               "r"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert worker.stdout.readline().strip() == "stalled"
        assert rings_mapped() == 1  # the broker's side of the worker's ring
    finally:
        worker.kill()
        worker.wait(timeout=10)
    wait_until(lambda: rings_mapped() == 0)
    assert shm_broker.store.stats().ready == 0  # nothing visible
    tensors = seeded_tensors(LARGE)
    with HandoffClient(shm_broker.address) as client:
        held = client.push_progress("large", "r")
        assert sum(r.length for t in held.tensors for r in t.received) == LARGE.nbytes // 2
        assert client.push("large", "r", 1, tensors, resumable=True).bytes == LARGE.nbytes
        assert_same_bits(client.pull("large", "r").state, tensors)
    assert_holds_nothing(shm_broker)


def test_a_ring_piece_that_does_not_fit_its_frame_is_refused_and_frees_everything(shm_broker):
    with HandoffClient(shm_broker.address) as client:
        capability = new_capability()
        call = push_call(client, "r", capability)
        frames = open_ring_lane(client.lane().path, capability, timeout=10)
        try:  # a frame of 1 KiB whose piece claims 2 KiB of the ring
            frames.sock.sendall(FRAME.pack(0, 0, 1024, crc32c(bytes(1024))) + PIECE.pack(2048))
            error = raises_handoff_error(result, call)
        finally:
            frames.close()
    assert error.reason == "MALFORMED_REQUEST" and "does not fit" in error.message, error
    assert_holds_nothing(shm_broker)


def test_a_frame_failing_its_crc32c_on_the_shared_memory_lane_is_refused_and_frees_everything(shm_broker):
    data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    with HandoffClient(shm_broker.address) as client:
        capability = new_capability()
        call = push_call(client, "r", capability)
        frames = open_ring_lane(client.lane().path, capability, timeout=10)
        try:
            try:
                frames.send(0, 0, memoryview(data), crc32c(data) ^ 1)
                frames.end()
            except OSError:
                pass  # the broker, refusing the frame, may close the lane first: the call says why
            error = raises_handoff_error(result, call)
        finally:
            frames.close()
    assert error.reason == "BAD_CHUNK" and "k0" in error.message and "CRC32C" in error.message, error
    assert_holds_nothing(shm_broker)


def test_a_chunk_damaged_in_the_brokers_memory_fails_its_crc32c_at_a_puller_on_the_shared_memory_lane(shm_broker):
    """The puller checks every frame on its own copy: one bit flipped in the broker's memory after the push's checks
    is caught."""
    tensors = seeded_tensors(LARGE)
    with HandoffClient(shm_broker.address) as client:
        client.push("large", "r", 1, tensors)
        (entry,) = shm_broker.store._h.entries.values()
        np.frombuffer(entry.ordered[0].data, np.uint8)[12345] ^= 1  # damaged as it sat in the broker
        with pytest.raises(BadChunk, match="fails its CRC32C on arrival"):
            client.pull("large", "r", timeout=10)
        assert lane_bytes(shm_broker, "large", "pull", "shm") == 0  # (no pull on that lane went through whole)


def test_a_sender_that_rewrites_the_ring_after_announcing_a_piece_only_fails_its_own_frame():
    """The receiver copies each piece out of the ring into its own memory and checks the CRC32C there: what the
    sender writes into the ring afterwards never reaches what was checked."""
    size = 64 << 10
    fd = new_ring(size)
    sender_sock, receiver_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sender, receiver = RingFrames(sender_sock, map_ring(fd, size)), RingFrames(receiver_sock, map_ring(fd, size))
        scribbler = map_ring(fd, size)  # the sender's hand on the ring, outside the lane's protocol
    finally:
        os.close(fd)
    try:
        data = np.random.default_rng(1).integers(0, 256, 48 << 10, dtype=np.uint8)
        landed = np.full(len(data), 7, np.uint8)
        sender.send(0, 0, memoryview(data), crc32c(data))
        receiver.read_into(receiver.read_header(), memoryview(landed))
        assert landed.tobytes() == data.tobytes()

        sender.send(0, 0, memoryview(data), crc32c(data))
        header = receiver.read_header()
        scribbler.write(bytes(size))  # the whole ring rewritten once the pieces were announced
        receiver.read_into(header, memoryview(landed))
        assert not landed.any() and crc32c(landed) != header.crc  # the receiver's check on its copy fails
    finally:
        sender.close()
        receiver.close()
        scribbler.close()


def test_a_puller_that_gives_no_room_back_is_revoked_after_the_lease_and_the_next_pull_gets_it_whole(start_broker):
    broker = start_broker(contracts={"wide": WIDE}, lease=1.0, max_bytes=512 << 20)
    tensors = {c.name: np.full(c.shape, i, np.float32) for i, c in enumerate(WIDE.carried)}
    with HandoffClient(broker.address) as client:
        client.push("wide", "r", 1, tensors)
        capability = new_capability()
        stream = pull_call(broker.address, "r", capability, model="wide", lane_kind=pb.LANE_KIND_SHM)
        header = next(stream)
        assert header.lane.kind == pb.LANE_KIND_SHM
        frames = open_ring_lane(header.lane.path, capability, timeout=30)
        try:
            started = time.monotonic()
            error = raises_handoff_error(lambda: list(stream))  # the ring fills; the broker waits for room
            assert time.monotonic() - started < 10
        finally:
            frames.close()
        assert isinstance(error, (CallCancelled, LaneBroken)), error  # revoked, as a stalled stream is
        got = client.pull("wide", "r", timeout=30).state
        assert all(np.array_equal(got[name], tensors[name]) for name in tensors)
    wait_until(lambda: rings_mapped() == 0)
