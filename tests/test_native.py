"""The native copy (client/_native.c): every byte copied, and the CRC32C of the copy exactly the crc32c package's,
for any length, alignment and cut into pieces; the shared-memory lane's receivers take their check from it."""

from __future__ import annotations

import itertools
import os
import socket

import crc32c as crc32c_package
import numpy as np
import pytest
from handoff_client import _ring
from handoff_client._frames import crc32c
from handoff_client._ring import RingFrames, map_ring, new_ring
from hypothesis import given, settings
from hypothesis import strategies as st

native = pytest.importorskip(
    "handoff_client._native", reason="handoff_client._native was not built (no C compiler at install)"
)
if not native.available:
    pytest.skip("this CPU has no SSE4.2: the lanes copy, then check, in two passes", allow_module_level=True)

BLOCK = 256 << 10  # the C file's: copied, then CRC'd while in the core's cache
STREAMS = (3 * 8192, 3 * 256)  # its three-stream loops' strides
BOUNDARIES = (0, 1, 7, 8, 9, *STREAMS, STREAMS[0] - 1, STREAMS[0] + 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5)


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("length", BOUNDARIES)
@pytest.mark.parametrize("misalignment", [0, 1, 5])
def test_the_copy_is_exact_and_its_crc32c_is_the_packages_at_every_boundary(length: int, misalignment: int):
    source = random_bytes(length + 8)[misalignment : misalignment + length]
    destination = np.zeros(length + 8, np.uint8)[3 : 3 + length]
    assert native.copy_crc32c(destination, source) == crc32c(source.tobytes())
    assert destination.tobytes() == source.tobytes()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=70_000), st.lists(st.integers(0, 70_000), max_size=6), st.integers(0, 2**32 - 1))
def test_a_copy_in_pieces_continues_the_crc32c_as_the_package_does(data: bytes, cuts: list[int], start: int):
    destination = np.zeros(len(data), np.uint8)
    crc = start
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    for begin, end in itertools.pairwise(bounds):
        crc = native.copy_crc32c(destination[begin:end], memoryview(data)[begin:end], crc)
    assert crc == crc32c_package.crc32c(data, start)
    assert destination.tobytes() == data


def test_a_destination_shorter_than_its_source_or_read_only_is_refused_untouched():
    destination = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="destination of 10 bytes for a source of 11"):
        native.copy_crc32c(destination, bytes(range(11)))
    assert not destination.any()
    with pytest.raises(TypeError):
        native.copy_crc32c(b"read-only", b"x")


def test_the_shared_memory_lanes_receiver_checks_its_own_copy_not_the_ring():
    """The CRC32C read_into returns is that of the bytes as they landed in the receiver's memory, never the header's
    or the ring's: a sender that rewrites the ring once a piece is announced only makes its own frame fail."""
    assert _ring.COPY_WITH_CRC, "the lane takes its CRC32C on the way wherever the native copy is available"
    size = 64 << 10
    fd = new_ring(size)
    sender_sock, receiver_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sender, receiver = RingFrames(sender_sock, map_ring(fd, size)), RingFrames(receiver_sock, map_ring(fd, size))
    finally:
        os.close(fd)
    try:
        data = random_bytes(48 << 10, seed=1)
        sender.send(0, 0, memoryview(data), crc32c(data))
        header = receiver.read_header()
        landed = np.full(header.length, 7, np.uint8)
        assert receiver.read_into(header, memoryview(landed)) == crc32c(data) == header.crc
        assert landed.tobytes() == data.tobytes()

        sender.send(0, 0, memoryview(data), crc32c(data))
        header = receiver.read_header()
        np.frombuffer(sender._ring, np.uint8)[:] = 0  # the ring rewritten after the piece was announced
        assert receiver.read_into(header, memoryview(landed)) == crc32c(landed) != header.crc
        assert not landed.any()
    finally:
        sender.close()
        receiver.close()
