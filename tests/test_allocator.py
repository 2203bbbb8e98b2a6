"""tune_allocator(): what it promises a worker that opts in, measured in real processes pulling from a real broker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import seeded_tensors
from handoff_broker import Broker
from handoff_client import HandoffClient

WORKERS = Path(__file__).parent / "workers.py"


def pull_faults(broker: Broker, handoff_id: str, allocator: str) -> int:
    """Page faults a decode process takes on its second pull of 64 MiB into arrays it allocated and touched before."""
    worker = subprocess.run(
        [sys.executable, str(WORKERS), "pull-faults", broker.address, "wide-attention", handoff_id, allocator],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    out = worker.stdout.strip()
    if out == "untunable":
        pytest.skip("not glibc: tune_allocator() is a no-op here")
    return int(out)


def test_a_tuned_decoder_reuses_the_pages_of_received_chunks_instead_of_faulting_in_new_ones(
    broker: Broker, client: HandoffClient
) -> None:
    tensors = seeded_tensors(client.get_contract("wide-attention"))
    for handoff_id in ("plain-1", "plain-2", "tuned-1", "tuned-2"):
        client.push("wide-attention", handoff_id, 1, tensors)

    plain = pull_faults(broker, "plain", "plain")
    tuned = pull_faults(broker, "tuned", "tuned")

    # With glibc's defaults a decoder faults in (and zeroes) fresh pages for nearly every received byte, pull after
    # pull; tuned, the pages of the last pull's chunks serve this one's. Both got every byte: a pull verifies each
    # chunk's CRC32C and the digest.
    assert plain > 64 * 256 // 2, plain  # half of the 64 MiB's 4 KiB pages, at least
    assert tuned * 10 < plain, (tuned, plain)
    assert broker.store.stats().resident_bytes == 0
