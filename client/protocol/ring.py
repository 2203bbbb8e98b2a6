"""The shared-memory lane's wire: a hand-off's bytes through a ring of shared memory, for a client on the broker's
host. docs/lanes.md is the specification; in short (all integers little-endian):

    opening   the client connects to the broker's Unix socket (Lane.path) and sends MAGIC and its capability, as on
              the TCP lane; the broker checks the peer's credentials (its own user) and answers READY followed by
              u32 ring_bytes, in one message carrying the ring's file descriptor (SCM_RIGHTS): a memfd of
              ring_bytes, sealed against shrinking and growing, so neither side can pull the memory from under the
              other. The client checks the seals and the size before it maps the ring.
    frames    the TCP lane's 20-byte headers, on the socket. A frame's bytes go through the ring instead: the
              sender writes them at the ring's head, in pieces that never cross the ring's end, and announces each
              piece on the socket (u32 length), after the header for the first. The receiver copies each piece out
              of the ring into its own memory and gives its room back on the socket (u32 bytes freed), the other
              way. Both sides count the bytes written and freed; no position travels.
    end       the TCP lane's end marker, on the socket.

A receiver checks a frame's CRC32C on its own copy, so a sender that writes into the ring after announcing a piece
cannot change what was checked; it can only make its own frame fail.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import socket
import struct
from collections.abc import Callable
from functools import cache

import numpy as np

from .lane import (
    FRAME,
    OPENING_TIMEOUT,
    READY,
    FrameHeader,
    LaneClosed,
    LaneUnreachable,
    parse_header,
    present,
    recv_exact,
)

# The most a lane's ring holds (a smaller hand-off gets a smaller ring). Measured (2 vCPUs, pull made before the
# push, medians): 2 MiB moved 16 MiB hand-offs 1.7x and 64 MiB ones 1.4x faster than 8 MiB, and 256 MiB ones as
# fast, at less broker CPU; 1 MiB was no faster than 2. A small ring has a quarter of the pages to fault in, and they
# stay in cache between the writer and the reader.
RING_BYTES = 2 << 20
MIN_RING_BYTES = 64 << 10
MAX_RING_BYTES = 64 << 20  # the largest ring either side maps: a lane's longest frame (MAX_LANE_CHUNK)
PIECE_BYTES = 2 << 20  # the most one announced piece holds, so the receiver copies while the sender writes
MIN_PIECE_BYTES = 256 << 10  # the least a piece holds, unless it ends its frame or meets the ring's end
PIECE = struct.Struct("<I")  # a piece's length (sender) or room given back (receiver)
RING_READY = struct.Struct("<cI")  # READY, ring_bytes
RING_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


@cache
def host_id() -> str:
    """This host's identity as the shared-memory lane names it: the Linux boot id ("" where there is none), read
    once: it is the same until the host reboots."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def ring_bytes(nbytes: int) -> int:
    """The ring for a hand-off of `nbytes`: the whole of it, in pages, up to RING_BYTES (a ring is made, and its
    pages faulted in, for every lane: a small hand-off's should cost no more than the hand-off)."""
    return min(RING_BYTES, max(MIN_RING_BYTES, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE))


def new_ring(size: int) -> int:
    """A ring's memory, as the broker makes it: a memfd of `size` bytes, sealed against resizing."""
    fd = os.memfd_create("handoff-lane-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, RING_SEALS | fcntl.F_SEAL_SEAL)
        return fd
    except BaseException:
        os.close(fd)
        raise


def offer_ring(sock: socket.socket, fd: int, size: int) -> None:
    """The broker's READY on a shared-memory lane: the ring's size, and its descriptor beside it."""
    socket.send_fds(sock, [RING_READY.pack(READY, size)], [fd])


def map_ring(fd: int, size: int) -> mmap.mmap:
    """Map a ring both sides may write (the broker's own, or one it passed): checked to be what READY said, and no
    larger than MAX_RING_BYTES (READY's u32 could announce 4 GiB, which a client would map and populate at once)."""
    if size > MAX_RING_BYTES:
        raise LaneClosed(f"the lane's ring of {size} bytes is past the {MAX_RING_BYTES} a ring may be")
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & RING_SEALS != RING_SEALS or os.fstat(fd).st_size != size:
        raise LaneClosed("the lane's ring is not a sealed memfd of the size announced")
    # Its pages all mapped at once (MAP_POPULATE), not faulted in one by one as the first frames pass.
    return mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)


def open_ring_lane(
    path: str, capability: bytes, timeout: float, call_ended: Callable[[], bool] = lambda: False
) -> RingFrames:
    """Connect to the broker's Unix socket, present the capability, and map the ring READY passes (LaneUnreachable
    if the socket cannot be reached: another host, container or user; LaneClosed as open_lane)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(min(timeout, OPENING_TIMEOUT))  # (a broker whose socket's backlog is full: not for long)
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise LaneUnreachable(f"cannot connect to {path}: {e}") from None
    try:
        answer, fds, _, _ = present(
            sock, capability, timeout, call_ended, lambda: socket.recv_fds(sock, RING_READY.size, 1)
        )
        try:
            if len(answer) < RING_READY.size:  # (the rest of the answer may follow the descriptor)
                answer += recv_exact(sock, RING_READY.size - len(answer))
            if len(fds) != 1 or len(answer) != RING_READY.size or answer[:1] != READY:
                raise LaneClosed("the broker refused the lane")
            ring = map_ring(fds[0], RING_READY.unpack(answer)[1])
        finally:
            for fd in fds:
                os.close(fd)
        return RingFrames(sock, ring)
    except BaseException:
        sock.close()
        raise


class RingFrames:
    """Frames on a shared-memory lane: headers on the socket, bytes through the ring (one way per lane). Copies into
    and out of the ring are numpy's, which let go of the GIL: a broker's pushes and pulls copy side by side."""

    def __init__(self, sock: socket.socket, ring: mmap.mmap) -> None:
        self.sock = sock
        self._ring = ring
        self._memory = np.frombuffer(ring, np.uint8)
        self._size = len(ring)
        self._written = 0  # sender: bytes put in the ring; receiver: bytes taken out
        self._freed = 0  # sender: bytes the receiver gave back
        self._inbox = bytearray()  # bytes read from the socket and not yet parsed
        self._room_owed = 0  # receiver: bytes copied out and not yet given back
        self._poll = select.poll()  # whether the other side has sent anything
        self._poll.register(sock, select.POLLIN)

    def close(self) -> None:
        """Unmap the ring (once no frame's bytes are being copied) and close the socket."""
        del self._memory
        self._ring.close()
        self.sock.close()

    def _take(self, size: int) -> bytes:
        """The socket's next `size` bytes, reading as much as has come at once (headers and pieces come in runs).
        Room not yet given back is given before the receiver waits for more."""
        while len(self._inbox) < size:
            if self._room_owed and not self._poll.poll(0):
                self._give_room()
            got = self.sock.recv(65536)
            if not got:
                raise LaneClosed(f"the lane closed after {len(self._inbox)} of {size} bytes")
            self._inbox += got
        taken = bytes(self._inbox[:size])
        del self._inbox[:size]
        return taken

    # -- the sender ---------------------------------------------------------------------------------------------------

    def send(self, index: int, offset: int, data: memoryview | bytes, crc: int) -> None:
        source = np.frombuffer(data, np.uint8)
        header = FRAME.pack(index, offset, len(source), crc)
        sent = 0
        while sent < len(source):
            at = self._written % self._size
            want = min(len(source) - sent, self._size - at, PIECE_BYTES)
            self._collect_room(wait=False)
            while self._room() < min(want, MIN_PIECE_BYTES):  # no crumbs: a piece is whole or of a useful size
                self._collect_room(wait=True)
            n = min(want, self._room())
            np.copyto(self._memory[at : at + n], source[sent : sent + n])
            self.sock.sendall(header + PIECE.pack(n))
            header = b""
            self._written += n
            sent += n

    def end(self) -> None:
        self.sock.sendall(FRAME.pack(0xFFFFFFFF, 0, 0, 0))

    def _room(self) -> int:
        return self._size - (self._written - self._freed)

    def _collect_room(self, wait: bool) -> None:
        """Take in the room the receiver gave back: all that has come, and with `wait` at least some (LaneClosed if
        it closes instead). Taken before every piece: with the receiver giving room back in a few large answers (see
        `read_into`), neither side's socket fills with unread answers while the other blocks sending to it."""
        if not wait and not self._poll.poll(0):  # (a socket with a timeout waits before any receive)
            return
        got = self.sock.recv(65536)
        if not got:
            raise LaneClosed("the lane closed while its sender waited for room in the ring")
        self._inbox += got
        whole = len(self._inbox) - len(self._inbox) % PIECE.size
        for (freed,) in PIECE.iter_unpack(self._inbox[:whole]):
            if not 0 < freed <= self._written - self._freed:
                raise LaneClosed(f"the receiver gave back {freed} bytes of the ring, more than it was sent")
            self._freed += freed
        del self._inbox[:whole]

    # -- the receiver -------------------------------------------------------------------------------------------------

    def read_header(self) -> FrameHeader:
        return parse_header(self._take(FRAME.size))

    def read_into(self, header: FrameHeader, view: memoryview) -> None:
        """Copy the frame's bytes out of the ring into `view`, piece by piece. Room is given back a quarter of the
        ring at a time, and whatever is owed before the receiver waits for the sender: few answers, however small
        the frames, so the sender, which sends one message a piece, never finds its answers piling up unread while
        the receiver blocks giving more."""
        destination = np.frombuffer(view, np.uint8)
        got = 0
        while got < len(destination):
            (n,) = PIECE.unpack(self._take(PIECE.size))
            at = self._written % self._size
            if not 0 < n <= min(len(destination) - got, self._size - at):
                raise ValueError(f"a ring piece of {n} bytes at {at} does not fit the frame or the ring")
            np.copyto(destination[got : got + n], self._memory[at : at + n])
            self._written += n
            got += n
            self._room_owed += n
            if self._room_owed >= self._size // 4:
                self._give_room()

    def _give_room(self) -> None:
        """Give the room owed back; a sender that has sent its last frame and closed needs none."""
        owed, self._room_owed = self._room_owed, 0
        try:
            self.sock.sendall(PIECE.pack(owed))
        except (BrokenPipeError, ConnectionResetError):
            pass  # (were frames still to come, reading them fails next, as on any closed lane)
