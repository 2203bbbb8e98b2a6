"""A push's or a pull's bytes on its lane (server/lanes.py), as the service's handlers use it: the lane is opened
within the call's wait, interrupted with the call, and closed when the call ends; every frame is read straight into
the buffer it will be stored in (from the socket, or copied out of the shared-memory ring), or sent from the stored
chunk, and checked there exactly as a chunk on the stream is.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from handoff_client.protocol.contract import Contract
from handoff_client.protocol.errors import LaneBroken, MalformedRequest, MessageTooLarge
from handoff_client.protocol.frames import ChunkFrame, chunk_prefix
from handoff_client.protocol.lane import (
    CAPABILITY_BYTES,
    MAX_LANE_CHUNK,
    READY,
    Frames,
    LaneClosed,
    StripedFrames,
    TcpFrames,
    connection_capabilities,
)
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.ring import RingFrames, host_id, map_ring, new_ring, offer_ring, ring_bytes
from handoff_client.protocol.seal import SealedFrames, new_salt

from .lanes import Expected, LaneListener
from .store.entries import StoredChunk


class LaneCall:
    """One call's lane, from the capabilities' registration to the call's end: one connection, or on a TCP lane
    striped over several, one per connection capability (handoff_client.protocol.lane.connection_capabilities)."""

    def __init__(self, lanes: LaneListener, capability: bytes, model: str, connections: int = 1) -> None:
        self.model = model
        self._lanes = lanes
        connections = check_lane_request(lanes, capability, connections, model)
        self.frames: Frames | None = None
        self._expected: list[Expected] = []
        try:
            for each in connection_capabilities(capability, connections):
                self._expected.append(lanes.expect(each))
        except ValueError as e:
            self.close()  # (the connections' capabilities registered before the one refused)
            raise MalformedRequest(f"lane_capability: {e}", model) from None

    @property
    def kind(self) -> str:
        """ "shm" or "tcp": the lane its connection came on, once open."""
        return "shm" if self.frames is not None and self.frames.sock.family == socket.AF_UNIX else "tcp"

    def open(self, timeout: float, nbytes: int, direction: str) -> Frames:
        """The connections that presented the call's capabilities, each told READY (and given a ring for `nbytes`,
        on the shared-memory lane; its frames sealed, on a sealed TCP lane: they go `direction`, "push" or "pull");
        LaneBroken if they did not all come within `timeout` s. On the shared-memory lane only the first
        capability counts (the lane is not striped), and a striped lane's connections are all TCP."""
        deadline = time.monotonic() + timeout
        first = self._expected[0].wait(timeout)
        if first is None:
            if self._expected[0].closed:  # the call ended (cancelled, past its deadline, its client gone) meanwhile
                raise LaneBroken(self.model, "the call ended before its lane opened")
            raise LaneBroken(self.model, f"no lane connection presented the call's capability within {timeout:.0f} s")
        if first.family == socket.AF_UNIX:
            for rest in self._expected[1:]:
                self._lanes.forget(rest)
            return self._opened(self._ring(first, nbytes))
        socks = [first]
        for waiting in self._expected[1:]:
            sock = waiting.wait(max(0.0, deadline - time.monotonic()))
            if sock is None and waiting.closed:
                raise LaneBroken(self.model, "the call ended before its lane opened")
            if sock is None:
                raise LaneBroken(self.model, f"{len(socks)} of the lane's {len(self._expected)} connections came "
                                 f"within {timeout:.0f} s")  # fmt: skip
            socks.append(sock)
            if sock.family == socket.AF_UNIX:
                raise LaneBroken(self.model, f"connection {len(socks) - 1} of the lane's {len(self._expected)} came "
                                 "on the shared-memory lane: a striped lane's connections are all TCP")  # fmt: skip
        # A sealed connection's keys take a salt drawn afresh here, sent after READY: no two connections share a key,
        # even two whose client presented one capability twice (handoff_client/protocol/seal.py).
        salts = [new_salt() if self._lanes.sealed else b"" for _ in socks]
        try:
            for sock, salt in zip(socks, salts):
                sock.sendall(READY + salt)
        except OSError as e:
            raise LaneBroken(self.model, f"the lane closed before it was ready: {e}") from None
        if self._lanes.sealed:
            parts: list[Frames] = [
                SealedFrames(s, w.capability, direction, salt) for s, w, salt in zip(socks, self._expected, salts)
            ]
        else:
            parts = [TcpFrames(s) for s in socks]
        return self._opened(parts[0] if len(parts) == 1 else StripedFrames(parts))

    def _ring(self, sock: socket.socket, nbytes: int) -> Frames:
        try:
            size = ring_bytes(nbytes)
            fd = new_ring(size)
            try:
                frames = RingFrames(sock, map_ring(fd, size))
                offer_ring(sock, fd, size)
            finally:
                os.close(fd)  # (the mapping, and the peer's copy of the descriptor, keep the ring)
        except OSError as e:
            raise LaneBroken(self.model, f"the lane closed before it was ready: {e}") from None
        return frames

    def _opened(self, frames: Frames) -> Frames:
        self.frames = frames
        return frames

    def interrupt(self) -> None:
        """End the lane now (the call is cancelled, revoked or replaced): a read or write blocked on it fails. From
        any thread: the ring stays mapped until the call's own thread closes the lane."""
        for waiting in self._expected:
            self._lanes.forget(waiting)

    def close(self) -> None:
        """From the call's own thread, once it is done with the lane."""
        self.interrupt()
        if self.frames is not None:
            self.frames.close()


def check_lane_request(lanes: LaneListener, capability: bytes, connections: int, model: str) -> int:
    """How many connections a call's lane is striped over (0 means 1); MalformedRequest past the broker's limit, or
    for a capability of the wrong length."""
    if len(capability) != CAPABILITY_BYTES:
        raise MalformedRequest(f"lane_capability: a lane capability is {CAPABILITY_BYTES} bytes, not {len(capability)}",
                               model)  # fmt: skip
    if connections > lanes.max_connections:
        raise MalformedRequest(
            f"lane_connections {connections}: this broker's TCP lane is striped over at most "
            f"{lanes.max_connections} connections (Lane.max_connections)",
            model,
        )
    return connections or 1


def lane_offers(lanes: LaneListener, tcp_min_bytes: int, shm_min_bytes: int, max_message_bytes: int) -> list[pb.Lane]:
    """The lanes as GetLanes describes them to clients, each with the smallest hand-off it moves and the longest
    frame it takes (what `received_chunks` refuses past: the broker's largest message, and the wire's limit)."""
    offers = []
    max_frame_bytes = min(max_message_bytes, MAX_LANE_CHUNK)
    if lanes.port is not None:
        sealing = pb.LANE_SEALING_AES_256_GCM if lanes.sealed else pb.LANE_SEALING_NONE
        offers.append(pb.Lane(kind=pb.LANE_KIND_TCP, host=lanes.advertise_host, port=lanes.port,
                              min_bytes=tcp_min_bytes, sealing=sealing, max_connections=lanes.max_connections,
                              max_frame_bytes=max_frame_bytes, salted_keys=lanes.sealed))  # fmt: skip
    if lanes.socket_path is not None:
        offers.append(pb.Lane(kind=pb.LANE_KIND_SHM, path=lanes.socket_path, host_id=host_id(),
                              min_bytes=shm_min_bytes, max_frame_bytes=max_frame_bytes))  # fmt: skip
    return offers


def lane_for_pull(offers: list[pb.Lane], kind: pb.LaneKind.ValueType, nbytes: int) -> pb.Lane | None:
    """The lane a PullHeader names for a hand-off of `nbytes`: the kind the pull asked for (UNSPECIFIED: TCP, as
    clients before the shared-memory lane mean) if the hand-off is at least its min_bytes, else the TCP lane if it
    is at least that one's; None: the chunks come on the stream."""
    by_kind = {offer.kind: offer for offer in offers}
    for candidate in (kind or pb.LANE_KIND_TCP, pb.LANE_KIND_TCP):
        offer = by_kind.get(candidate)
        if offer is not None and nbytes >= offer.min_bytes:
            return offer
    return None


def received_chunks(
    frames: Frames,
    contract: Contract,
    model: str,
    idle_timeout: float,
    max_bytes: int,
    check: Callable[[int, int, int], None],
) -> Iterator[ChunkFrame]:
    """A push's chunks as they come on its lane, to its end marker. Each is read into a buffer that already holds its
    stream frame's prefix, so the chunk is stored as the very frame a puller on the stream is sent (and its CRC32C is
    checked there, on the broker's own copy). A lane silent for `idle_timeout` s, or closed before its end marker, is
    LaneBroken.

    A frame's buffer is allocated only once its header has passed every bound: the lane's longest frame
    (`max_bytes`), and `check(index, offset, length)` (the push's: within its tensor, over nothing received, so
    within what the call reserved). It is not zeroed, and its pages are touched only as the bytes arrive: a header
    that claims more than its sender sends holds no more memory than was sent (docs/lanes.md, "What a lane holds")."""
    try:
        for sock in frames.socks if isinstance(frames, StripedFrames) else [frames.sock]:
            sock.settimeout(idle_timeout)  # (a lane its call's end closed meanwhile is broken here already)
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
            check(header.index, header.offset, header.length)
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
