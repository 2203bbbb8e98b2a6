"""The lanes' wire: a hand-off's bytes on a connection beside the gRPC call that controls them.

docs/lanes.md is the specification (for an implementer in another language); this is ours, used by the client and
the broker alike. The TCP lane, in short (all integers little-endian):

    opening   the client connects, sends MAGIC (8 bytes) and the call's capability (32 bytes); the broker answers
              one byte, READY, once the call is ready for the bytes, or closes the connection (the call's status
              says why)
    frames    one way only (pusher → broker, broker → puller): a 20-byte header, then `length` bytes of tensor data
                  u32 index    the tensor's index in the contract's carried list (of the call's view: the filled
                               contract at the position, cut to the shard for a sharded call)
                  u64 offset   byte offset within the tensor's filled bytes
                  u32 length   bytes that follow (1 .. MAX_LANE_CHUNK)
                  u32 crc32c   CRC32C (Castagnoli) of those bytes
    end       a header whose index is END (0xFFFFFFFF), the other fields 0; the sender then closes its side

Every frame is checked as on the gRPC path (bounds, overlap, CRC32C), and the digest covers the same
(index, offset, length, crc32c) entries; the commit, the digest, confirm and every error travel on the gRPC call.
The shared-memory lane (_ring.py) sends the same headers on a Unix socket and the bytes through shared memory; both
are `Frames`, which is all the client's and the broker's calls see of a lane.
"""

from __future__ import annotations

import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

MAGIC = b"HOLANE1\n"
CAPABILITY_BYTES = 32
READY = b"\x00"
FRAME = struct.Struct("<IQII")
END = 0xFFFFFFFF
MAX_LANE_CHUNK = 64 << 20
SOCKET_BUFFER = 4 << 20
READY_POLL = 0.05  # seconds between looks at the call while waiting for READY

T = TypeVar("T")


class LaneClosed(ConnectionError):
    """The lane's connection ended before the bytes it promised (or the broker closed it: the call says why)."""


class LaneUnreachable(ConnectionError):
    """No connection to the lane's address could be made."""


@dataclass(frozen=True)
class FrameHeader:
    index: int
    offset: int
    length: int
    crc: int

    @property
    def end(self) -> bool:
        return self.index == END


def new_capability() -> bytes:
    """A lane capability: 256 bits from the operating system's CSPRNG."""
    return secrets.token_bytes(CAPABILITY_BYTES)


def tune(sock: socket.socket) -> None:
    """Large buffers and no Nagle delay: frames are large, and the end marker must not wait."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)


def open_lane(
    host: str, port: int, capability: bytes, timeout: float, call_ended: Callable[[], bool] = lambda: False
) -> socket.socket:
    """Connect, present the capability, and wait for READY (LaneClosed if the broker closes instead, or the call
    the lane serves ends first: its status then says why). `timeout` bounds every later send and receive too."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise LaneUnreachable(f"cannot connect to {host}:{port}: {e}") from None
    try:
        tune(sock)
        if present(sock, capability, timeout, call_ended, lambda: sock.recv(len(READY))) != READY:
            raise LaneClosed("the broker refused the lane")
        return sock
    except BaseException:
        sock.close()
        raise


def present(
    sock: socket.socket, capability: bytes, timeout: float, call_ended: Callable[[], bool], answer: Callable[[], T]
) -> T:
    """Send the opening, then wait for the broker's `answer` (READY, on any lane), looking every READY_POLL s
    whether the call the lane serves has ended: a push's READY may wait for room, and meanwhile its call may be
    refused. Leaves `timeout` on the socket for every later send and receive."""
    sock.sendall(MAGIC + capability)
    deadline = time.monotonic() + timeout
    sock.settimeout(READY_POLL)
    while True:
        try:
            got = answer()
            break
        except TimeoutError:
            if call_ended() or time.monotonic() > deadline:
                raise LaneClosed("the lane was not made ready before its call ended") from None
    sock.settimeout(timeout)
    return got


class Frames(Protocol):
    """A lane's frames, one way: the sender's `send`s and `end`, the receiver's `read_header` then `read_into` (the
    frame's bytes, into the receiver's own memory, where it then checks their CRC32C)."""

    sock: socket.socket

    def send(self, index: int, offset: int, data: memoryview | bytes, crc: int) -> None: ...

    def end(self) -> None: ...

    def read_header(self) -> FrameHeader: ...

    def read_into(self, header: FrameHeader, view: memoryview) -> None: ...

    def close(self) -> None: ...


class TcpFrames:
    """Frames on a TCP lane: each header, then its bytes, on the connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, index: int, offset: int, data: memoryview | bytes, crc: int) -> None:
        send_frame(self.sock, index, offset, data, crc)

    def end(self) -> None:
        send_end(self.sock)

    def read_header(self) -> FrameHeader:
        return read_header(self.sock)

    def read_into(self, header: FrameHeader, view: memoryview) -> None:
        recv_into_exact(self.sock, view)

    def close(self) -> None:
        self.sock.close()


def lane_host(lane_host: str, target: str) -> str:
    """Where to open a lane: the host the broker names, or else the host part of the client's target (`host:port`,
    `[v6]:port`, with or without a `dns:///` or `ipv4:` scheme)."""
    if lane_host:
        return lane_host
    address = target.split("///", 1)[-1].removeprefix("ipv4:").removeprefix("ipv6:")
    host = address.rpartition(":")[0] or address
    return host.strip("[]")


def send_frame(sock: socket.socket, index: int, offset: int, data: memoryview | bytes, crc: int) -> None:
    sock.sendall(FRAME.pack(index, offset, len(data), crc))
    sock.sendall(data)


def send_end(sock: socket.socket) -> None:
    sock.sendall(FRAME.pack(END, 0, 0, 0))


def read_header(sock: socket.socket) -> FrameHeader:
    return parse_header(recv_exact(sock, FRAME.size))


def parse_header(raw: bytes) -> FrameHeader:
    """A frame header's fields, checked (ValueError: an end marker that carries something, a length out of range)."""
    header = FrameHeader(*FRAME.unpack(raw))
    if header.end and (header.offset or header.length or header.crc):
        raise ValueError("a lane's end marker carries nothing")
    if not header.end and not 0 < header.length <= MAX_LANE_CHUNK:
        raise ValueError(f"a lane frame of {header.length} bytes (1..{MAX_LANE_CHUNK} allowed)")
    return header


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    recv_into_exact(sock, memoryview(buffer))
    return bytes(buffer)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket, straight into its memory (the destination array on a pull)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise LaneClosed(f"the lane closed after {got} of {len(view)} bytes")
        got += n
