"""A pull's stream as its handler and its interrupt share it, the header that opens the stream, and an audit read's
stream (PullRequest.audit: the store's audits.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from handoff_client.protocol.errors import BrokerBusy, WaitTimedOut
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.shards import Shard

from .admission import Budget, HeldWhileRunning
from .lane_calls import LaneCall
from .store import Claim, Store

logger = logging.getLogger(__name__)


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


def audit_stream(
    store: Store, request: pb.PullRequest, shard: Shard, wait: float, context: Any, waiting: Budget
) -> Iterator[bytes]:
    """An audit read's stream: the committed hand-off's header (claim 0), its chunks and its end, on this stream,
    claiming nothing (the store's audits.py says what it takes and when it ends). A read waiting for its push holds a
    slot of the `waiting` budget while it waits, as a pull does; past the budget it is refused at once."""
    slot = waiting.try_take()
    try:
        read = store.audit_read(
            request.model, request.handoff_id, wait if slot is not None else 0.0, context.is_active, shard
        )
    except WaitTimedOut as e:
        if slot is None:
            raise BrokerBusy(waiting.what, waiting.limit, request.model) from e
        raise
    finally:
        if slot is not None:
            slot.give_back()
    yield pull_header(read, request.shard, None)
    sent = 0
    while True:
        chunks, digest = store.audit_feed(read, sent)
        for chunk in chunks:
            yield chunk.frame if isinstance(chunk.frame, bytes) else bytes(chunk.frame)
        sent += len(chunks)
        if digest is not None:
            break
    yield pb.PullResponse(end=pb.PullEnd(digest=digest)).SerializeToString()
    logger.info("audit read of %s/%s: %d bytes, nothing claimed", read.model, read.handoff_id, read.nbytes)
