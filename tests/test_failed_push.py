"""A puller of a hand-off whose push failed hears so at once (PUSH_ABORTED, with why), rather than waiting out its
deadline for bytes that will never come: the vLLM producer hands the router its ticket before its push commits, so
a decoder may ask for a hand-off whose push has already failed. A new push of the id is taken as ever."""

from __future__ import annotations

import threading
import time

from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import CapacityExhausted, HandoffClient, PushAborted
from support import chunk_frames, header_frame, raises_handoff_error, raw_push

DEMO = "demo-hybrid"  # 4,334,592 bytes a hand-off
PATIENT = 20.0  # the pull's deadline: a pull that waited it out took this long


def test_a_pull_after_its_push_failed_midway_hears_push_aborted_at_once_and_a_new_push_is_taken(broker, contracts):
    contract = contracts[DEMO]
    tensors = seeded_tensors(contract)
    frames = chunk_frames(contract, tensors, chunk_bytes=1 << 16)
    broken = frames[1][:-1] + bytes([frames[1][-1] ^ 1])  # a chunk failing its CRC32C: the push is refused and freed
    assert raises_handoff_error(raw_push, broker.address, [header_frame(contract, "r"), frames[0], broken])
    with HandoffClient(broker.address) as client:
        started = time.monotonic()
        error = raises_handoff_error(client.pull, DEMO, "r", timeout=PATIENT)
        assert isinstance(error, PushAborted) and "failed before it was committed" in error.message, error
        assert time.monotonic() - started < 5, "the pull waited for a push that had failed"
        client.push(DEMO, "r", 1, tensors)
        assert_same_bits(client.pull(DEMO, "r").state, tensors)
    assert_holds_nothing(broker)


def test_a_pull_waiting_for_a_push_refused_for_room_hears_why_at_once(start_broker, contracts):
    contract = contracts[DEMO]
    broker = start_broker(max_bytes=contract.nbytes // 2)  # the hand-off can never fit
    outcome: list[object] = []
    with HandoffClient(broker.address) as puller, HandoffClient(broker.address) as pusher:
        waiting = threading.Thread(target=lambda: outcome.append(raises_handoff_error(puller.pull, DEMO, "r",
                                                                                      timeout=PATIENT)))  # fmt: skip
        started = time.monotonic()
        waiting.start()
        time.sleep(0.5)  # the pull is waiting for its push
        assert isinstance(raises_handoff_error(pusher.push, DEMO, "r", 1, seeded_tensors(contract)), CapacityExhausted)
        waiting.join(PATIENT + 5)
    (error,) = outcome
    assert isinstance(error, PushAborted) and "CAPACITY_EXHAUSTED" in error.message, error
    assert time.monotonic() - started < 5, "the pull waited for a push that was refused"
    assert_holds_nothing(broker)


def test_a_pull_waiting_for_a_push_refused_at_its_header_hears_why_at_once(broker, contracts):
    """A push from a producer that holds another contract (FINGERPRINT_MISMATCH) is refused before anything is held:
    the decoder waiting for it is told at once, and why; the right push is then taken and pulled."""
    contract = contracts[DEMO]
    tensors = seeded_tensors(contract)
    outcome: list[object] = []
    with HandoffClient(broker.address) as puller:
        waiting = threading.Thread(target=lambda: outcome.append(raises_handoff_error(puller.pull, DEMO, "r",
                                                                                      timeout=PATIENT)))  # fmt: skip
        started = time.monotonic()
        waiting.start()
        time.sleep(0.5)
        refused = raises_handoff_error(raw_push, broker.address, [header_frame(contract, "r", fingerprint="f" * 64)])
        assert refused.reason == "FINGERPRINT_MISMATCH"
        waiting.join(PATIENT + 5)
        (error,) = outcome
        assert isinstance(error, PushAborted) and "FINGERPRINT_MISMATCH" in error.message, error
        assert time.monotonic() - started < 5, "the pull waited for a push that was refused"
        puller.push(DEMO, "r", 1, tensors)
        assert_same_bits(puller.pull(DEMO, "r").state, tensors)
    assert_holds_nothing(broker)
