"""Which of the broker's lanes a call takes, and opening it: the shared-memory lane on the broker's own host, else
the TCP lane, and only for a hand-off of at least the lane's `min_bytes` (docs/lanes.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import cache

import grpc

from .protocol.lane import Frames, StripedFrames, TcpFrames, connection_capabilities, lane_host, open_lanes
from .protocol.messages import handoff_pb2 as pb
from .protocol.ring import host_id, open_ring_lane
from .protocol.seal import SealedFrames, receive_salt, sealed_opening, sealing_available

logger = logging.getLogger(__name__)


@cache
def _this_host() -> str:
    return host_id()


LANE_RETRY_AFTER = 60.0
"""Seconds a client leaves a TCP lane it could not connect to before it tries it again: each try costs a call its
attempt and a retry, and a broker that restarts on the same address is back within that."""


class LaneOffers:
    """The lanes one broker offers one client, asked once (`ask`: its GetLanes call), and which this client can
    reach: which a hand-off of a size takes, and which to leave alone after it could not be reached."""

    def __init__(self, ask: Callable[[str], pb.LanesResponse], *, lanes: bool, shared_memory: bool) -> None:
        self.ask = ask
        self.lanes = lanes  # False: every hand-off on the streams
        self.offers: list[pb.Lane] = []
        self.asked = False
        self.shared_memory = shared_memory  # (and until the shared-memory lane turns out unreachable from here)
        self.tcp_unreachable_until = 0.0  # (time.monotonic(): until then the TCP lane is not tried)

    def lane(self, nbytes: int | None = None, model: str = "") -> pb.Lane | None:
        """The lane a hand-off of `nbytes` (of `model`: a token scoped to models asks for lanes naming one) takes
        (None: whichever a large one would), or None for the streams: the
        shared-memory lane when this client shares the broker's host, else the TCP lane, if this client takes lanes
        and the hand-off is at least the lane's `min_bytes` (the offers are asked once; a broker that does not know
        GetLanes offers none)."""
        if not self.lanes:
            return None
        if not self.asked:
            try:
                response = self.ask(model)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return None  # not known now: this call goes on the stream, and the next one asks again
                response = pb.LanesResponse()
            self.offers = list(response.lanes)
            self.asked = True
        tcp = time.monotonic() >= self.tcp_unreachable_until
        return choose(self.offers, nbytes, shared_memory=self.shared_memory, tcp=tcp)

    def unreachable(self, lane: pb.Lane) -> None:
        """A lane this client could not connect to: a shared-memory lane it shares the host but not the filesystem
        or the user with (another container, say) is not tried again, the next calls taking the TCP lane; a TCP lane
        (a firewall, a NAT the broker's advertised address does not cross) not for LANE_RETRY_AFTER seconds, the
        calls meanwhile on the streams."""
        if lane.kind == pb.LANE_KIND_SHM:
            self.shared_memory = False
        else:
            self.tcp_unreachable_until = time.monotonic() + LANE_RETRY_AFTER


def choose(
    offers: Sequence[pb.Lane], nbytes: int | None, shared_memory: bool = True, tcp: bool = True
) -> pb.Lane | None:
    """The lane for a hand-off of `nbytes` (None: whichever a large one would take, as a pull asks before it knows
    the size): the shared-memory lane if `shared_memory` is allowed, it is offered on this host and the hand-off is
    at least its min_bytes, else the TCP lane if `tcp` is allowed and the hand-off is at least that one's; None for
    the streams, or when the TCP lane is sealed and this process cannot seal it (no `cryptography` here, or a
    sealing it does not know: a broker of 0.1, whose keys lacked its salt, `Lane.salted_keys`)."""
    by_kind = {offer.kind: offer for offer in offers}
    shm = by_kind.get(pb.LANE_KIND_SHM)
    on_this_host = shm is not None and shm.host_id != "" and shm.host_id == _this_host()
    tcp_lane = by_kind.get(pb.LANE_KIND_TCP) if tcp else None
    if (
        tcp_lane is not None
        and tcp_lane.sealing != pb.LANE_SEALING_NONE
        and not (tcp_lane.sealing == pb.LANE_SEALING_AES_256_GCM and tcp_lane.salted_keys and sealing_available())
    ):
        tcp_lane = None  # a TLS broker's sealed TCP lane that this process cannot seal as it asks: the streams
    for lane in (shm if shared_memory and on_this_host else None, tcp_lane):
        if lane is not None and (nbytes is None or nbytes >= lane.min_bytes):
            return lane
    return None


LANE_FRAME_BYTES = 4 << 20
"""The most bytes one frame of ours carries on the shared-memory lane, where no gRPC message bounds it. Measured
(benchmarks/bench.py's pusher, broker and puller, 2 vCPUs, pull made before the push): from 1 MiB to 2-6 MiB frames a
256 MiB hand-off moved 1.2-1.3x faster on that lane at two thirds of the broker's CPU. On the TCP lane larger frames
bought nothing (the kernel's copies are the same per byte) and cost the sealed lane a fifth of its rate
(benchmarks/tls_lanes.py), so it keeps the stream's chunk size. (8 MiB frames fell to a fifth while the broker's
mmap threshold was 8 MiB, each frame's pages faulted in afresh; it is 32 MiB now, handoff_broker.app.)"""

FRAMES_AT_LEAST = 16
"""A hand-off is cut into at least this many frames where it can be: a frame is forwarded to a pipelined pull only
once whole, so a 16 MiB hand-off in 4 MiB frames reached its puller ~20 % later than in 1 MiB ones."""


def frame_bytes(lane: pb.Lane, nbytes: int, stream_chunk_bytes: int) -> int:
    """The bytes each frame of a push of `nbytes` carries on `lane`: on the shared-memory lane a FRAMES_AT_LEAST-th
    of the hand-off, from the stream's chunk size up to LANE_FRAME_BYTES; on the TCP lane the stream's chunk size;
    never more than the lane takes (`max_frame_bytes`; a broker from before that field gets the stream's chunk size)."""
    wanted = stream_chunk_bytes
    if lane.kind == pb.LANE_KIND_SHM:
        wanted = min(LANE_FRAME_BYTES, max(stream_chunk_bytes, nbytes // FRAMES_AT_LEAST))
    return min(wanted, lane.max_frame_bytes or stream_chunk_bytes)


def open_frames(
    lane: pb.Lane,
    target: str,
    capability: bytes,
    timeout: float,
    direction: str,
    call_ended: Callable[[], bool] = lambda: False,
    connections: int = 1,
) -> Frames:
    """Open `lane` for the call whose capability this is, its frames going `direction` ("push": to the broker,
    "pull": from it), a TCP lane striped over `connections` (LaneUnreachable, LaneClosed as open_lanes)."""
    if lane.kind == pb.LANE_KIND_SHM:
        return open_ring_lane(lane.path, capability, timeout, call_ended)
    host = lane_host(lane.host, target)
    capabilities = connection_capabilities(capability, connections)
    sealed = lane.sealing != pb.LANE_SEALING_NONE  # (`choose` takes no sealing but AES_256_GCM with salted keys)
    # A sealed lane is opened with a value derived from each connection's capability, never the capability itself.
    openings = [sealed_opening(c) for c in capabilities] if sealed else capabilities
    socks = open_lanes(host, lane.port, openings, timeout, call_ended)
    try:  # (a sealed connection's READY is followed by the broker's salt for its keys)
        parts: list[Frames] = [
            SealedFrames(sock, c, direction, receive_salt(sock)) if sealed else TcpFrames(sock)
            for sock, c in zip(socks, capabilities)
        ]
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return parts[0] if len(parts) == 1 else StripedFrames(parts)


def connections_for(lane: pb.Lane | None, wanted: int) -> int:
    """How many connections a call asks its lane for: `wanted`, within what the lane offers (a broker from before
    striping offers one), and one on the shared-memory lane."""
    if lane is None or lane.kind != pb.LANE_KIND_TCP:
        return 1
    return max(1, min(wanted, lane.max_connections or 1))


def describe(lane: pb.Lane, target: str) -> str:
    """Where a lane is, for an error message."""
    if lane.kind == pb.LANE_KIND_SHM:
        return f"the shared-memory lane at {lane.path}"
    sealed = " (sealed)" if lane.sealing != pb.LANE_SEALING_NONE else ""
    return f"the TCP lane{sealed} at {lane_host(lane.host, target)}:{lane.port}"


def fell_back(direction: str, error: Exception) -> None:
    """Say that a call's lane broke and that its retries go on the gRPC stream: a WARNING, since a call on the stream
    still succeeds but moves its bytes at the streams' rate, and lanes that keep breaking (a firewall on the lane's
    port, a proxy in front of the broker) would otherwise cost throughput unseen. The record carries
    `lane_fallback=True` for a handler (or a test) to pick out."""
    logger.warning("the %s's lane broke (%s); its retries go on the gRPC stream", direction, error,
                   extra={"lane_fallback": True})  # fmt: skip
