"""What a lane can make the broker hold is bounded by what its call may hold (docs/lanes.md, "What a lane holds"):
measured from outside, on a broker in its own process, as its monitor and the OOM killer see it."""

from __future__ import annotations

import mmap
import os
import socket
import time

import grpc
import pytest
from broker_process import BrokerProcess
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from handoff_client import HandoffClient
from handoff_client.protocol.contract import Carried, Contract
from handoff_client.protocol.errors import from_rpc_error
from handoff_client.protocol.lane import FRAME, LaneClosed, new_capability, open_lane
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.ring import MAX_RING_BYTES, RING_BYTES, map_ring, new_ring, ring_bytes
from handoff_client.protocol.seal import lane_key, receive_salt, sealed_opening
from handoff_client.protocol.wire import identity, method_path

MiB = 1 << 20
TINY = Contract("tiny", 17, 64, (Carried("t0", 0, 16, 1024, "float32"),))  # 64 KiB
BIG = Contract("big", 2, 64, (Carried("b0", 0, 4096, 4096, "float32"),))  # 64 MiB
LIES = 6  # lying pushes of each contract


def push_call(client: HandoffClient, contract: Contract, handoff_id: str, capability: bytes):
    """A push at position 1 whose header offers a lane, sending nothing on the stream; its future."""
    header = pb.PushHeader(model=contract.model, handoff_id=handoff_id, position=1, fingerprint=contract.fingerprint,
                           lane_capability=capability)  # fmt: skip
    push = client._channel.stream_unary(method_path("PushHandoff"), request_serializer=identity,
                                        response_deserializer=pb.PushResponse.FromString)  # fmt: skip
    return push.future(iter([pb.PushRequest(header=header).SerializeToString()]), timeout=60)


def refusal(call) -> object:
    try:
        call.result()
    except grpc.RpcError as e:
        return from_rpc_error(e)
    raise AssertionError("the push was not refused")


def test_sealed_frame_headers_that_lie_about_their_length_make_the_broker_hold_only_what_was_sent(tmp_path):
    """A pusher (it holds the call's capability, so its sealed headers authenticate) announces 64 MiB frames and
    sends 100 bytes of each: past its tensor (64 KiB), the frame is refused before anything is allocated for it;
    within its tensor (64 MiB), the broker's memory grows only as the bytes arrive. Once, each header cost the
    broker its whole length, allocated and zeroed up front: 64 MiB a push."""
    args = ("--max-bytes", "1GiB", "--idle-timeout", "30", "--no-shared-memory-lane", "--lane-min-bytes", "1")
    with (
        BrokerProcess(tmp_path, [TINY, BIG], *args, tls=True) as broker,
        HandoffClient(broker.address, **broker.client_options) as client,
    ):
        port = client.lane().port
        before = broker.rss()
        lanes: list[socket.socket] = []
        calls = {TINY.model: [], BIG.model: []}
        for n in range(LIES):
            for contract in (TINY, BIG):
                capability = new_capability()
                calls[contract.model].append(push_call(client, contract, f"lie-{n}", capability))
                lane = open_lane("127.0.0.1", port, sealed_opening(capability), timeout=30)
                key = lane_key(capability, "push", receive_salt(lane))  # (the broker's salt follows READY)
                header = AESGCM(key).encrypt(bytes(12), FRAME.pack(0, 0, 64 * MiB, 0), None)
                lane.sendall(header + b"x" * 100)  # (message 0's nonce is 12 zero bytes)
                lanes.append(lane)
        for call in calls[TINY.model]:  # refused at once, naming the tensor and its size
            error = refusal(call)
            assert error.reason == "BAD_CHUNK" and "65536 bytes" in error.message and "t0" in error.message, error
        time.sleep(1.0)
        grown = broker.rss() - before
        for lane in lanes:
            lane.close()
        for call in calls[BIG.model]:
            assert refusal(call).reason == "LANE_BROKEN"
        status = client.status()
        assert (status.receiving, status.resident_bytes) == (0, 0)
    assert grown < 32 * MiB, f"the broker grew {grown / MiB:.0f} MiB for {2 * LIES} frames of 100 bytes"


def test_no_side_maps_a_ring_past_64_mib_whatever_ready_announces():
    """READY's ring size is a u32: a broker (or anything on its socket) could announce 4 GiB, which the client
    mapped and populated up front. The broker's own rings are at most RING_BYTES (2 MiB)."""
    assert ring_bytes(1 << 40) == RING_BYTES <= MAX_RING_BYTES
    size = MAX_RING_BYTES + mmap.PAGESIZE
    fd = new_ring(size)
    try:
        with pytest.raises(LaneClosed, match="past the"):
            map_ring(fd, size)
    finally:
        os.close(fd)
