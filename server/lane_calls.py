"""A push's or a pull's bytes on its lane (server/lanes.py), as the service's handlers use it: the lane is opened
within the call's wait, interrupted with the call, and closed when the call ends; every frame is read straight into
the buffer it will be stored in (from the socket, or copied out of the shared-memory ring), or sent from the stored
chunk, and checked there exactly as a chunk on the stream is.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator

import numpy as np
from handoff_client._contract import Contract
from handoff_client._errors import LaneBroken, MalformedRequest, MessageTooLarge
from handoff_client._frames import ChunkFrame, chunk_prefix
from handoff_client._lane import READY, Frames, LaneClosed, TcpFrames
from handoff_client._proto import handoff_pb2 as pb
from handoff_client._ring import RingFrames, host_id, map_ring, new_ring, offer_ring, ring_bytes
from handoff_client._seal import SealedFrames

from .entries import StoredChunk
from .lanes import Expected, LaneListener


class LaneCall:
    """One call's lane, from the capability's registration to the call's end."""

    def __init__(self, lanes: LaneListener, capability: bytes, model: str) -> None:
        self.model = model
        self._lanes = lanes
        try:
            self._expected: Expected = lanes.expect(capability)
        except ValueError as e:
            raise MalformedRequest(f"lane_capability: {e}", model) from None
        self.frames: Frames | None = None

    @property
    def kind(self) -> str:
        """ "shm" or "tcp": the lane its connection came on, once open."""
        return "shm" if self.frames is not None and self.frames.sock.family == socket.AF_UNIX else "tcp"

    def open(self, timeout: float, nbytes: int, direction: str) -> Frames:
        """The connection that presented the capability, told READY (and given a ring for `nbytes`, on the
        shared-memory lane; its frames sealed, on a sealed TCP lane: they go `direction`, "push" or "pull");
        LaneBroken if none came within `timeout` s."""
        sock = self._expected.wait(timeout)
        if sock is None:
            raise LaneBroken(self.model, f"no lane connection presented the call's capability within {timeout:.0f} s")
        try:
            if sock.family == socket.AF_UNIX:
                size = ring_bytes(nbytes)
                fd = new_ring(size)
                try:
                    frames: Frames = RingFrames(sock, map_ring(fd, size))
                    offer_ring(sock, fd, size)
                finally:
                    os.close(fd)  # (the mapping, and the peer's copy of the descriptor, keep the ring)
            else:
                sock.sendall(READY)
                sealed = self._lanes.sealed
                frames = SealedFrames(sock, self._expected.capability, direction) if sealed else TcpFrames(sock)
        except OSError as e:
            raise LaneBroken(self.model, f"the lane closed before it was ready: {e}") from None
        self.frames = frames
        return frames

    def interrupt(self) -> None:
        """End the lane now (the call is cancelled, revoked or replaced): a read or write blocked on it fails. From
        any thread: the ring stays mapped until the call's own thread closes the lane."""
        self._lanes.forget(self._expected)

    def close(self) -> None:
        """From the call's own thread, once it is done with the lane."""
        self._lanes.forget(self._expected)
        if self.frames is not None:
            self.frames.close()


def lane_offers(lanes: LaneListener, min_bytes: int) -> list[pb.Lane]:
    """The lanes as GetLanes describes them to clients."""
    offers = []
    if lanes.port is not None:
        sealing = pb.LANE_SEALING_AES_256_GCM if lanes.sealed else pb.LANE_SEALING_NONE
        offers.append(pb.Lane(kind=pb.LANE_KIND_TCP, host=lanes.advertise_host, port=lanes.port, min_bytes=min_bytes,
                              sealing=sealing))  # fmt: skip
    if lanes.socket_path is not None:
        offers.append(pb.Lane(kind=pb.LANE_KIND_SHM, path=lanes.socket_path, host_id=host_id(), min_bytes=min_bytes))
    return offers


def lane_offer(lanes: LaneListener, min_bytes: int, kind: pb.LaneKind.ValueType) -> pb.Lane | None:
    """The lane of that kind, as a PullHeader names it (UNSPECIFIED: TCP, as clients before the shared-memory lane
    mean); None if the broker offers none of that kind."""
    kind = kind or pb.LANE_KIND_TCP
    return next((offer for offer in lane_offers(lanes, min_bytes) if offer.kind == kind), None)


def received_chunks(
    frames: Frames, contract: Contract, model: str, idle_timeout: float, max_bytes: int
) -> Iterator[ChunkFrame]:
    """A push's chunks as they come on its lane, to its end marker. Each is read into a buffer that already holds its
    stream frame's prefix, so the chunk is stored as the very frame a puller on the stream is sent (and its CRC32C is
    checked there, on the broker's own copy). A lane silent for `idle_timeout` s, or closed before its end marker, is
    LaneBroken."""
    frames.sock.settimeout(idle_timeout)
    try:
        while True:
            try:
                header = frames.read_header()
            except ValueError as e:
                raise MalformedRequest(f"lane frame: {e}", model) from None
            if header.end:
                return
            if header.index >= len(contract.carried):
                raise MalformedRequest(
                    f"lane frame for tensor index {header.index}: the contract carries {len(contract.carried)}", model
                )
            if header.length > max_bytes:
                raise MessageTooLarge(model, header.length, max_bytes)
            name = contract.carried[header.index].name
            prefix = chunk_prefix(name, header.offset, header.length, header.crc)
            frame = np.empty(len(prefix) + header.length, np.uint8)  # (not zeroed first, as a bytearray would be)
            frame[: len(prefix)] = np.frombuffer(prefix, np.uint8)
            data = memoryview(frame)[len(prefix) :]
            try:
                frames.read_into(header, data)
            except ValueError as e:
                raise MalformedRequest(f"lane frame: {e}", model) from None
            yield ChunkFrame(name, header.offset, header.crc, data, frame)  # type: ignore[arg-type]
    except (OSError, LaneClosed) as e:  # (socket.timeout is an OSError)
        raise LaneBroken(model, f"the push's lane broke: {e}") from None


def send_chunks(frames: Frames, chunks: Iterable[StoredChunk], model: str) -> Iterator[None]:
    """Send the chunks on a pull's lane, yielding after each (the caller notes the stream moving)."""
    try:
        for chunk in chunks:
            frames.send(chunk.index, chunk.offset, chunk.data, chunk.crc)
            yield
    except OSError as e:
        raise LaneBroken(model, f"the pull's lane broke: {e}") from None


def send_lane_end(frames: Frames, model: str) -> None:
    try:
        frames.end()
    except OSError as e:
        raise LaneBroken(model, f"the pull's lane broke at its end: {e}") from None
