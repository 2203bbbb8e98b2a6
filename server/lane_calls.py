"""A push's or a pull's bytes on its lane (server/lanes.py), as the service's handlers use it: the lane is opened
within the call's wait, interrupted with the call, and closed when the call ends; every frame is read straight into
the buffer it will be stored in, or sent from the stored chunk, and checked exactly as a chunk on the stream is.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator

from handoff_client._contract import Contract
from handoff_client._errors import LaneBroken, MalformedRequest, MessageTooLarge
from handoff_client._frames import ChunkFrame, chunk_prefix
from handoff_client._lane import READY, LaneClosed, read_header, recv_into_exact, send_end, send_frame
from handoff_client._proto import handoff_pb2 as pb

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
        self.sock: socket.socket | None = None

    def offer(self, min_bytes: int) -> pb.Lane:
        return lane_offer(self._lanes, min_bytes)

    def open(self, timeout: float) -> socket.socket:
        """The connection that presented the capability, told READY; LaneBroken if none came within `timeout` s."""
        sock = self._expected.wait(timeout)
        if sock is None:
            raise LaneBroken(self.model, f"no lane connection presented the call's capability within {timeout:.0f} s")
        try:
            sock.sendall(READY)
        except OSError as e:
            raise LaneBroken(self.model, f"the lane closed before it was ready: {e}") from None
        self.sock = sock
        return sock

    def interrupt(self) -> None:
        """End the lane now (the call is cancelled, revoked or replaced): a read or write blocked on it fails."""
        self._lanes.forget(self._expected)

    def close(self) -> None:
        self._lanes.forget(self._expected)


def lane_offer(lanes: LaneListener, min_bytes: int) -> pb.Lane:
    """The lane as GetLanes and a PullHeader describe it to clients."""
    return pb.Lane(kind=pb.LANE_KIND_TCP, host=lanes.advertise_host, port=lanes.port, min_bytes=min_bytes)


def received_chunks(
    sock: socket.socket, contract: Contract, model: str, idle_timeout: float, max_bytes: int
) -> Iterator[ChunkFrame]:
    """A push's chunks as they come on its lane, to its end marker. Each is read into a buffer that already holds its
    stream frame's prefix, so the chunk is stored as the very frame a puller on the stream is sent. A lane silent for
    `idle_timeout` s, or closed before its end marker, is LaneBroken."""
    sock.settimeout(idle_timeout)
    try:
        while True:
            try:
                header = read_header(sock)
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
            frame = bytearray(len(prefix) + header.length)
            frame[: len(prefix)] = prefix
            data = memoryview(frame)[len(prefix) :]
            recv_into_exact(sock, data)
            yield ChunkFrame(name, header.offset, header.crc, data, frame)  # type: ignore[arg-type]
    except (OSError, LaneClosed) as e:  # (socket.timeout is an OSError)
        raise LaneBroken(model, f"the push's lane broke: {e}") from None


def send_chunks(sock: socket.socket, chunks: Iterable[StoredChunk], model: str) -> Iterator[None]:
    """Send the chunks on a pull's lane, yielding after each (the caller notes the stream moving)."""
    try:
        for chunk in chunks:
            send_frame(sock, chunk.index, chunk.offset, chunk.data, chunk.crc)
            yield
    except OSError as e:
        raise LaneBroken(model, f"the pull's lane broke: {e}") from None


def send_lane_end(sock: socket.socket, model: str) -> None:
    try:
        send_end(sock)
    except OSError as e:
        raise LaneBroken(model, f"the pull's lane broke at its end: {e}") from None
