"""The prefill side's sending: a push's attempts — each on the broker's lane if it offers one for the hand-off's size,
else on the stream; after a lane breaks, on the stream; after a resumable push breaks, only what the broker did not
keep — and the chunks each attempt sends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np

from ._lane_choice import connections_for, describe, fell_back, frame_bytes, open_frames
from .protocol.contract import Contract, Handoff
from .protocol.errors import HandoffError, LaneBroken, UnknownHandoff, from_rpc_error
from .protocol.frames import crc32c, encode_chunk
from .protocol.lane import Frames, LaneClosed, LaneUnreachable, new_capability
from .protocol.messages import handoff_pb2 as pb
from .protocol.shards import Shard
from .protocol.wire import shard_to_proto

if TYPE_CHECKING:
    from ._client import BrokerClient


@dataclass(frozen=True)
class PushResult:
    """What the broker holds after a push."""

    handoff_id: str
    bytes: int
    chunks: int
    digest: str
    duplicate: bool
    ticket: str = ""
    """Names the broker that holds the hand-off: pass it to the decoder, whose pull goes straight there."""


class _Unmade(Exception):  # (never seen outside: `run` raises its cause, PushAttempts.unmade)
    """A chunk of the push could not be made: carries the sending out of the lane's OSError handling."""


Held = dict[str, list[tuple[int, int]]] | None
"""Byte ranges of each tensor the broker already holds of a push being resumed (None: a whole push)."""

BROKER_VERDICT_SECONDS = 0.25
"""How long a push whose lane could not be reached waits for its call to end before it blames the lane: a broker
that is gone (its connection refused) fails the call within milliseconds, and the push goes on, as UNAVAILABLE, to
the next broker, on that one's lane; a live broker waits for the lane, and only then is the lane left alone for
LANE_RETRY_AFTER seconds."""


def _ended(call: grpc.Future, within: float) -> grpc.RpcError | None:
    """The call's error, if it ends with one within `within` seconds."""
    try:
        error = call.exception(timeout=within)
    except grpc.FutureTimeoutError:
        return None
    except grpc.FutureCancelledError:
        return None
    return error if isinstance(error, grpc.RpcError) else None


class PushAttempts:
    """Successive attempts at one push of `handoff` (already checked against `contract`, the pushing rank's view)."""

    def __init__(
        self,
        client: BrokerClient,
        contract: Contract,
        handoff_id: str,
        handoff: Handoff,
        shard: Shard,
        *,
        ttl: float | None,
        wait_for_room: bool,
        resumable: bool,
    ) -> None:
        self.client = client
        self.contract = contract
        self.handoff_id = handoff_id
        self.handoff = handoff
        self.shard = shard
        self.ttl = ttl
        self.wait_for_room = wait_for_room
        self.resumable = resumable
        self.attempts = 0
        self.lanes = True  # until a lane breaks: the retries then go on the stream
        self.unmade: Exception | None = None  # why a tensor could not be sent (made or checked): the push's error

    def run(self, timeout: float) -> pb.PushResponse:
        self.attempts += 1
        held = self._held(timeout) if self.resumable and self.attempts > 1 else None
        lane = self.client.lane(self.contract.nbytes, self.contract.model) if self.lanes else None
        try:
            if lane is None:
                frames = self._stream_frames(self._header(held is not None), held)
                return self.client._call(self.client._push, frames, timeout)
            capability, connections = new_capability(), connections_for(lane, self.client.lane_connections)
            try:
                return self._on_lane(lane, capability, connections, held, timeout)
            except LaneBroken as e:
                self.lanes = False
                fell_back("push", e)
                raise
        except Exception:
            if self.unmade is None:
                raise
            if self.resumable:  # the broker keeps a broken resumable push for a retry that will not come
                with contextlib.suppress(HandoffError):
                    self.client.cancel(self.contract.model, self.handoff_id, timeout=min(max(timeout, 1.0), 5.0))
            raise self.unmade from None  # the push ended short because a tensor could not be made: say why

    def _header(self, resume: bool, lane_capability: bytes = b"", lane_connections: int = 0) -> bytes:
        message = pb.PushHeader(
            model=self.contract.model,
            handoff_id=self.handoff_id,
            position=self.handoff.position,
            fingerprint=self.contract.fingerprint,
            ttl_seconds=self.ttl or 0.0,
            no_wait=not self.wait_for_room,
            resumable=self.resumable,
            resume=resume,
            shard=shard_to_proto(self.shard),
            lane_capability=lane_capability,
            lane_connections=lane_connections,
        )
        return pb.PushRequest(header=message).SerializeToString()

    def _held(self, timeout: float) -> Held:
        """What the broker kept of our broken push, or None when there is nothing to resume (push it whole)."""
        try:
            progress = self.client.push_progress(self.contract.model, self.handoff_id, timeout=timeout,
                                                 shard=self.shard)  # fmt: skip
        except UnknownHandoff:
            return None
        if progress.complete:
            return None  # it committed after all: a whole repeat is recognised byte for byte and changes nothing
        return {t.tensor: [(r.offset, r.length) for r in t.received] for t in progress.tensors}

    def _stream_frames(self, header: bytes, held: Held) -> Iterator[bytes]:
        """The push's frames; a tensor that cannot be made ends them short (the broker then drops the push)."""
        yield header
        try:
            for _, name, offset, data in self._chunks(held, self.client.chunk_bytes):
                yield encode_chunk(name, offset, data)
        except Exception as e:  # noqa: BLE001 - raised by the caller's iterable or a check: `run` raises it
            self.unmade = e

    def _on_lane(
        self, lane: pb.Lane, capability: bytes, connections: int, held: Held, timeout: float
    ) -> pb.PushResponse:
        """The push's header on the stream and its chunks on the lane; the broker's answer on the stream."""
        client = self.client
        header = self._header(held is not None, capability, connections)
        call = client._push.future(iter((header,)), timeout=timeout, metadata=client._metadata)
        try:
            frames = open_frames(lane, client.target, capability, timeout, "push", call.done, connections)
        except LaneUnreachable as e:
            gone = _ended(call, BROKER_VERDICT_SECONDS)
            if gone is not None:  # the broker itself is gone (killed, restarting): not a lane that broke
                raise from_rpc_error(gone) from None
            call.cancel()
            client.lane_offers.unreachable(lane)
            raise LaneBroken(self.contract.model, f"{describe(lane, client.target)}: {e}") from None
        except (LaneClosed, OSError):
            frames = None  # the broker closed it: the call says why
        if frames is not None:
            try:
                size = self.client.chunk_bytes
                if not self.client.chunk_bytes_chosen:  # (a size the caller chose is kept on every path)
                    size = frame_bytes(lane, self.contract.nbytes, size)
                self._send(frames, self._chunks(held, size), call)
            except OSError:
                pass  # the broker ended the lane: the call says why
            finally:
                frames.close()
        try:
            return call.result()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def _send(self, frames: Frames, chunks: Iterator[tuple[int, str, int, memoryview]], call: grpc.Future) -> None:
        """Each chunk on the lane, then its end (OSError: the broker ended the lane). A chunk that cannot be made
        ends the push short with its error, whatever it is (an OSError included), the call cancelled."""
        while True:
            try:
                chunk = next(chunks, None)
            except Exception as e:
                self.unmade = e
                call.cancel()
                raise _Unmade from e
            if chunk is None:
                break
            index, _, offset, data = chunk
            frames.send(index, offset, data, crc32c(data))
        frames.end()

    def _chunks(self, held: Held, size: int) -> Iterator[tuple[int, str, int, memoryview]]:
        """(tensor index, name, offset, bytes) of each chunk to send: every `size` bytes of what `held` leaves out."""
        for index, carried in enumerate(self.contract.carried):
            array = np.ascontiguousarray(self.handoff.state[carried.name])
            payload = memoryview(array.reshape(-1).view(np.uint8))
            for start, end in missing(carried.nbytes, (held or {}).get(carried.name, [])):
                for offset in range(start, end, size):
                    yield index, carried.name, offset, payload[offset : min(offset + size, end)]


def missing(size: int, held: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The [start, end) ranges of [0, size) that the sorted, disjoint `held` (offset, length) ranges leave out."""
    at = 0
    for offset, length in held:
        if offset > at:
            yield at, offset
        at = max(at, offset + length)
    if at < size:
        yield at, size
