"""A pull's stream as its handler and its interrupt share it, and the header that opens the stream."""

from __future__ import annotations

from handoff_client.protocol.messages import handoff_pb2 as pb

from .admission import HeldWhileRunning
from .lane_calls import LaneCall
from .store import Claim


class PullProgress:
    """A pull's stream as its handler and its interrupt see it."""

    __slots__ = ("ending", "held", "lane", "sent_all")

    def __init__(self) -> None:
        self.ending = False  # the stream's end is being sent
        self.sent_all = False  # ... and was
        self.lane: LaneCall | None = None  # its lane, once the header offers one (a large enough hand-off)
        self.held: HeldWhileRunning[bytes] | None = None  # its stream slot, held while a thread runs the call


def pull_header(claim: Claim, shard: pb.Shard, lane: pb.Lane | None) -> bytes:
    header = pb.PullHeader(
        shard=shard,
        model=claim.model,
        handoff_id=claim.handoff_id,
        position=claim.position,
        fingerprint=claim.fingerprint,
        claim=claim.generation,
        bytes=claim.nbytes,
        chunks=claim.chunks,
        lane=lane,
    )
    return pb.PullResponse(header=header).SerializeToString()
