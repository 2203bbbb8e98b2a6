"""Sealed frames: the TCP lane of a broker that serves TLS, encrypted and authenticated as the call itself is.

docs/lanes.md is the specification. The construction is the standard one, as TLS 1.3 protects its records (AEAD,
a per-connection key, the record counter as nonce); nothing of it is new:

    opening  the client presents not the capability, which must stay secret, but HKDF-SHA256 (RFC 5869) of it with
             no salt and info "handoff lane v1 opening" (32 bytes): it names the call and reveals nothing of the keys
    key      HKDF-SHA256 of the call's 32-byte capability, which only the client and the broker know (it travelled
             on the TLS call): no salt, info "handoff lane v1 push" or "handoff lane v1 pull" (the way the frames
             go), 32 bytes. An AES-256-GCM key for this one lane, used one way: the capability is single-use.
    nonce    12 bytes: the message's number on this lane, u64 little-endian from 0, then 4 zero bytes. Each side
             counts for itself, so a message replayed, reordered, dropped or moved from another lane fails.
    frame    two messages: the 20-byte header sealed (36 bytes on the wire), then its `length` bytes sealed
             (`length` + 16). Nothing travels in the clear but the sizes, as under TLS.
    end      the end marker's header, sealed: a forged or cut end fails.

A message that fails its tag ends the lane as a broken connection does (LaneClosed); the call says the rest.
Needs the `cryptography` package (the broker's `server` extra has it; a client without it stays on the streams of
a TLS broker).
"""

from __future__ import annotations

import socket
import struct

from ._lane import FRAME, INFO, FrameHeader, LaneClosed, hkdf_sha256, parse_header, recv_exact

TAG_BYTES = 16
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


def lane_key(capability: bytes, direction: str) -> bytes:
    """The lane's AES-256-GCM key: HKDF-SHA256 of the capability, for frames going `direction` ("push", "pull")."""
    return _derive(capability, direction)


def sealed_opening(capability: bytes) -> bytes:
    """What a client presents to open a sealed lane: HKDF-SHA256 of the capability for "opening", independent of
    the keys, so an eavesdropper who reads it learns nothing that opens the frames."""
    return _derive(capability, "opening")


def _derive(capability: bytes, purpose: str) -> bytes:
    return hkdf_sha256(capability, f"{INFO}{purpose}".encode())


class SealedFrames:
    """Frames on a TCP lane, each header and each frame's bytes sealed (AES-256-GCM), one way."""

    def __init__(self, sock: socket.socket, capability: bytes, direction: str) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.sock = sock
        self._key = lane_key(capability, direction)
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
