"""The lanes' wire: a hand-off's bytes on a connection beside the gRPC call that controls them.

docs/lanes.md is the specification (for an implementer in another language); this is ours, used by the client and
the broker alike. The TCP lane, in short (all integers little-endian):

    opening   the client connects, sends MAGIC (8 bytes) and the call's capability (32 bytes); the broker answers
              one byte, READY, once the call is ready for the bytes (on a sealed lane followed by its salt for the
              keys, seal.py), or closes the connection (the call's status says why)
    frames    one way only (pusher → broker, broker → puller): a 20-byte header, then `length` bytes of tensor data
                  u32 index    the tensor's index in the contract's carried list (of the call's view: the filled
                               contract at the position, cut to the shard for a sharded call)
                  u64 offset   byte offset within the tensor's filled bytes
                  u32 length   bytes that follow (1 .. MAX_LANE_CHUNK)
                  u32 crc32c   CRC32C (Castagnoli) of those bytes
    end       a header whose index is END (0xFFFFFFFF), the other fields 0; the sender then closes its side
    striped   a call may ask for its lane over n connections: connection k > 0 presents a capability derived from the
              call's (`connection_capabilities`), READY comes on each once all have come, each frame goes whole on
              any one, and each connection ends with its own end marker (`StripedFrames`)

Every frame is checked as on the gRPC path (bounds, overlap, CRC32C), and the digest covers the same
(index, offset, length, crc32c) entries; the commit, the digest, confirm and every error travel on the gRPC call.
The shared-memory lane (ring.py) sends the same headers on a Unix socket and the bytes through shared memory; both
are `Frames`, which is all the client's and the broker's calls see of a lane.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

MAGIC = b"HOLANE1\n"
CAPABILITY_BYTES = 32
READY = b"\x00"
FRAME = struct.Struct("<IQII")
END = 0xFFFFFFFF
MAX_LANE_CHUNK = 64 << 20
SOCKET_BUFFER = 4 << 20
READY_POLL = 0.05  # seconds between looks at the call while waiting for READY
OPENING_TIMEOUT = 5.0
"""Seconds either side gives a lane to open (docs/lanes.md): the client to connect (and, on a pull, to hear READY);
the broker to read a new connection's opening, and, once a call needs its lane, for its connections to come. Past
it both give the lane up and the call's bytes go on its stream: a lane that cannot open costs a call this at most,
never the broker's --idle-timeout, and an idle connection to the lane port holds nothing for longer."""
INFO = "handoff lane v1 "  # what every key and value derived from a capability is derived for begins so
MAX_CONNECTIONS = 16  # the most connections one call's TCP lane may be striped over
DEFAULT_MAX_CONNECTIONS = 8  # what a broker allows unless told otherwise (--lane-max-connections)
# The smallest hand-off a broker moves on each lane unless told otherwise (--lane-min-bytes,
# --shared-memory-lane-min-bytes), as benchmarks/lane_crossover.py measured: below 1 MiB opening a connection costs
# more than the TCP lane saves; below 16 MiB a client on the broker's host is better off on the TCP lane than on
# the shared-memory one, whose ring and descriptor cost more a call (about even at 16 MiB, faster from there).
DEFAULT_LANE_MIN_BYTES = 1 << 20
DEFAULT_SHM_LANE_MIN_BYTES = 16 << 20

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


def connection_capabilities(capability: bytes, connections: int) -> list[bytes]:
    """What each connection of a lane striped over `connections` presents in place of the call's capability: the
    capability itself on the first, and on connection k (from 1) HKDF-SHA256 of it with info
    `handoff lane v1 connection k` (k in decimal). Each is a capability of its own: single-use, unguessable without
    the call's, and (on a sealed lane) the key of that connection's frames."""
    return [capability] + [hkdf_sha256(capability, f"{INFO}connection {k}".encode()) for k in range(1, connections)]


def hkdf_sha256(secret: bytes, info: bytes, salt: bytes = bytes(32)) -> bytes:
    """HKDF-SHA256 (RFC 5869) of `secret`, 32 bytes: one block, so Extract then one HMAC of Expand. The default salt,
    32 zero bytes, is RFC 5869's "no salt"."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def open_lane(
    host: str, port: int, capability: bytes, timeout: float, call_ended: Callable[[], bool] = lambda: False
) -> socket.socket:
    """Connect, present the capability (or a sealed lane's opening value), and wait for READY, as `open_lanes`."""
    return open_lanes(host, port, [capability], timeout, call_ended)[0]


def open_lanes(
    host: str, port: int, openings: Sequence[bytes], timeout: float, call_ended: Callable[[], bool] = lambda: False
) -> list[socket.socket]:
    """Connect once per opening (one, or one per connection of a striped lane), present each, then wait for READY on
    every one (LaneClosed if the broker closes one instead, or the call the lane serves ends first: its status then
    says why). `timeout` bounds every later send and receive too."""
    socks: list[socket.socket] = []
    try:
        for opening in openings:
            try:
                sock = socket.create_connection((host, port), timeout=min(timeout, OPENING_TIMEOUT))
            except OSError as e:
                raise LaneUnreachable(f"cannot connect to {host}:{port}: {e}") from None
            socks.append(sock)
            tune(sock)
            sock.sendall(MAGIC + opening)
        deadline = time.monotonic() + timeout
        for sock in socks:
            if await_answer(sock, deadline, timeout, call_ended, partial(sock.recv, len(READY))) != READY:
                raise LaneClosed("the broker refused the lane")
        return socks
    except BaseException:
        for sock in socks:
            sock.close()
        raise


def present(
    sock: socket.socket, capability: bytes, timeout: float, call_ended: Callable[[], bool], answer: Callable[[], T]
) -> T:
    """Send the opening, then wait for the broker's `answer` (READY, on any lane), as `await_answer`."""
    sock.sendall(MAGIC + capability)
    return await_answer(sock, time.monotonic() + timeout, timeout, call_ended, answer)


def await_answer(
    sock: socket.socket, deadline: float, timeout: float, call_ended: Callable[[], bool], answer: Callable[[], T]
) -> T:
    """Wait for the broker's `answer` to an opening until `deadline`, looking every READY_POLL s whether the call
    the lane serves has ended: a push's READY may wait for room, and meanwhile its call may be refused. Leaves
    `timeout` on the socket for every later send and receive."""
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


class StripedFrames:
    """A TCP lane striped over several connections, as one `Frames`. Each frame goes whole on one connection (the
    next, in turn, with room in its send buffer), and every connection ends with its own end marker; the receiver
    reads each frame from whichever connection has one ready, and the lane's end is the last connection's end
    marker. Frames come in any order on any lane, so nothing else changes: the checks, and the digest, are the same.
    One thread drives every connection; the kernel keeps each sending while the thread is on another."""

    def __init__(self, parts: Sequence[Frames]) -> None:
        self._parts = list(parts)
        self.socks = [part.sock for part in self._parts]
        self.sock = self.socks[0]  # (its timeout is the lane's: a wait for any connection to be ready)
        self._unended = list(self._parts)  # receiving: the connections whose end marker has not come
        self._turn = 0
        self._reading: Frames | None = None  # receiving: the connection whose frame header was read last

    def send(self, index: int, offset: int, data: memoryview | bytes, crc: int) -> None:
        self._next_ready(self._parts, writing=True).send(index, offset, data, crc)

    def end(self) -> None:
        for part in self._parts:
            part.end()

    def read_header(self) -> FrameHeader:
        while self._unended:
            part = self._next_ready(self._unended, writing=False)
            header = part.read_header()
            if not header.end:
                self._reading = part
                return header
            self._unended.remove(part)
        return FrameHeader(END, 0, 0, 0)

    def read_into(self, header: FrameHeader, view: memoryview) -> None:
        assert self._reading is not None, "read_into follows the read_header of its frame"
        self._reading.read_into(header, view)

    def close(self) -> None:
        for part in self._parts:
            part.close()

    def _next_ready(self, parts: list[Frames], writing: bool) -> Frames:
        """The next of `parts`, in turn, ready to be written to (or read from) without waiting; waits for one up to
        the lane's timeout (TimeoutError), LaneClosed if the lane was closed under the wait."""
        # poll(), not select(): select() cannot watch a descriptor numbered 1024 or more, which a process with many
        # files or connections open (a broker under load, a decoder with a model's files) gives its sockets.
        try:
            poller = select.poll()
            for part in parts:
                poller.register(part.sock, select.POLLOUT if writing else select.POLLIN)
            timeout = self.sock.gettimeout()
            events = poller.poll(None if timeout is None else timeout * 1000)
        except (ValueError, OSError) as e:  # a socket closed by another thread (the call revoked, say)
            raise LaneClosed(f"the lane was closed: {e}") from None
        ready = {fd for fd, _ in events}  # (an error or a hang-up counts: the send or read then says what it was)
        if not ready:
            raise TimeoutError("no connection of the striped lane was ready in time")
        for step in range(len(parts)):
            part = parts[(self._turn + step) % len(parts)]
            if part.sock.fileno() in ready:
                self._turn = (self._turn + step + 1) % len(parts)
                return part
        raise LaneClosed("the lane was closed while it was being waited on")


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
