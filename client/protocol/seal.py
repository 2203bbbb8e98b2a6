"""Sealed frames: the TCP lane of a broker that serves TLS, encrypted and authenticated as the call itself is.

docs/lanes.md is the specification. The construction is the standard one, as TLS 1.3 protects its records (AEAD,
a per-connection key, the record counter as nonce); nothing of it is new:

    opening  the client presents not the capability, which must stay secret, but HKDF-SHA256 (RFC 5869) of it with
             no salt and info "handoff lane v1 opening" (32 bytes): it names the call and reveals nothing of the keys
    salt     32 bytes the broker draws from its CSPRNG afresh for each connection it opens, and sends right after
             READY (`Lane.salted_keys`)
    key      HKDF-SHA256 of the connection's 32-byte capability, which only the client and the broker know (it
             travelled on the TLS call), with the broker's salt as HKDF's salt and info "handoff lane v1 push" or
             "handoff lane v1 pull" (the way the frames go), 32 bytes. An AES-256-GCM key for this one connection,
             used one way.
    nonce    12 bytes: the message's number on this lane, u64 little-endian from 0, then 4 zero bytes. Each side
             counts for itself, so a message replayed, reordered, dropped or moved from another lane fails.
    frame    two messages: the 20-byte header sealed (36 bytes on the wire), then its `length` bytes sealed
             (`length` + 16). Nothing travels in the clear but the sizes, as under TLS.
    end      the end marker's header, sealed: a forged or cut end fails.

A message that fails its tag ends the lane as a broken connection does (LaneClosed); the call says the rest.

Invariant: no (key, nonce) pair is ever used twice, by construction. Within a connection the nonce is a counter that
never repeats; across connections the key differs because the broker's salt is fresh for each, whatever the client
presents. A capability is single-use, but the broker can remember only so many used ones (VOIDED_REMEMBERED in
server/lanes.py): a client that reused one later, or a replayed opening, gets a lane keyed anew, never a key used
before. Remembering capabilities for ever instead would cost the broker unbounded memory, and the salt costs 32 bytes
a connection; the client's own randomness is not enough, since the broker (which seals a pull) cannot trust it.
Needs the `cryptography` package (the broker's `server` extra has it; a client without it stays on the streams of
a TLS broker).
"""

from __future__ import annotations

import secrets
import socket
import struct

from .lane import FRAME, INFO, FrameHeader, LaneClosed, hkdf_sha256, parse_header, recv_exact

TAG_BYTES = 16
SALT_BYTES = 32  # the broker's salt, sent after READY on each connection of a sealed lane
SEALED_HEADER_BYTES = FRAME.size + TAG_BYTES
PIECE_BYTES = 1 << 20  # the most of a sealed frame's bytes received before they are opened into their destination
_NONCE = struct.Struct("<QI")


def sealing_available() -> bool:
    """Whether this process can seal frames (the `cryptography` package is installed)."""
    try:
        import cryptography.hazmat.primitives.ciphers.aead  # noqa: F401
    except ImportError:
        return False
    return True


def new_salt() -> bytes:
    """The broker's salt for one connection of a sealed lane: 256 bits from the operating system's CSPRNG."""
    return secrets.token_bytes(SALT_BYTES)


def lane_key(capability: bytes, direction: str, salt: bytes) -> bytes:
    """The connection's AES-256-GCM key: HKDF-SHA256 of the capability with the broker's `salt`, for frames going
    `direction` ("push", "pull")."""
    if len(salt) != SALT_BYTES:
        raise ValueError(f"a sealed lane's salt is {SALT_BYTES} bytes, not {len(salt)}")
    return hkdf_sha256(capability, f"{INFO}{direction}".encode(), salt)


def sealed_opening(capability: bytes) -> bytes:
    """What a client presents to open a sealed lane: HKDF-SHA256 of the capability for "opening", independent of
    the keys, so an eavesdropper who reads it learns nothing that opens the frames."""
    return hkdf_sha256(capability, f"{INFO}opening".encode())


def receive_salt(sock: socket.socket) -> bytes:
    """The broker's salt for this connection, which follows its READY (LaneClosed if the connection ends first)."""
    return recv_exact(sock, SALT_BYTES)


class SealedFrames:
    """Frames on a TCP lane, each header and each frame's bytes sealed (AES-256-GCM), one way."""

    def __init__(self, sock: socket.socket, capability: bytes, direction: str, salt: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.sock = sock
        self._key = lane_key(capability, direction, salt)
        self._aead = AESGCM(self._key)
        self._messages = 0
        self._scratch: memoryview | None = None  # a received frame's sealed bytes as they come, PIECE_BYTES at most

    def _nonce(self) -> bytes:
        nonce = _NONCE.pack(self._messages, 0)
        self._messages += 1
        return nonce

    def close(self) -> None:
        self.sock.close()

    def send(self, index: int, offset: int, data: memoryview | bytes, crc: int) -> None:
        self.sock.sendall(self._aead.encrypt(self._nonce(), FRAME.pack(index, offset, len(data), crc), None))
        sealed = bytearray(len(data) + TAG_BYTES)
        self._aead.encrypt_into(self._nonce(), data, None, sealed)
        self.sock.sendall(sealed)

    def end(self) -> None:
        self.sock.sendall(self._aead.encrypt(self._nonce(), FRAME.pack(0xFFFFFFFF, 0, 0, 0), None))

    def read_header(self) -> FrameHeader:
        return parse_header(self._open(recv_exact(self.sock, SEALED_HEADER_BYTES)))

    def read_into(self, header: FrameHeader, view: memoryview) -> None:
        """Receive the frame's sealed bytes a piece at a time (PIECE_BYTES at most) and open each into `view` as it
        comes, then check the frame's tag: what this holds grows only as bytes arrive, whatever length the header
        claims. The bytes opened into `view` count only once the tag is checked; if it fails, the lane ends
        (LaneClosed) and the caller discards `view`, as it does a frame cut short."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        opening = Cipher(algorithms.AES(self._key), modes.GCM(self._nonce())).decryptor()
        if self._scratch is None or len(self._scratch) < min(header.length, PIECE_BYTES):
            self._scratch = memoryview(bytearray(min(header.length, PIECE_BYTES)))
        got = 0
        while got < header.length:
            n = self.sock.recv_into(self._scratch[: header.length - got])
            if n == 0:
                raise LaneClosed(f"the lane closed after {got} of the frame's {header.length} bytes")
            opening.update_into(self._scratch[:n], view[got : got + n])
            got += n
        try:
            opening.finalize_with_tag(recv_exact(self.sock, TAG_BYTES))
        except InvalidTag:
            raise LaneClosed("a sealed frame failed its authentication (altered, replayed or out of order)") from None

    def _open(self, sealed: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(self._nonce(), sealed, None)
        except InvalidTag:
            raise LaneClosed("a sealed frame header failed its authentication") from None
