"""A pushed hand-off is pulled bit for bit: every dtype, any chunking, any chunk order, interleaved tensors."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import HandoffClient, HandoffError
from support import chunk_frames, header_frame, raw_push

EVERY_PATH = True  # each test on the gRPC streams, the TCP lane and the shared-memory lane (conftest.PATHS)


def test_the_broker_publishes_its_contracts(client: HandoffClient, contracts):
    listed = client.list_contracts()
    assert [c.model for c in listed] == sorted(contracts)
    for contract in listed:
        assert contract == contracts[contract.model]
        assert contract.fingerprint == contracts[contract.model].fingerprint
    demo = client.get_contract("demo-hybrid")
    first = demo.carried[0]
    assert (demo.ctx, demo.hidden, first.name, first.layer, first.rows, first.cols, first.dtype) == (
        4096,
        256,
        "layers.0.linear_attn.conv_ring",
        0,
        3,
        768,
        "bfloat16",
    )


@pytest.mark.parametrize("model", ["every-dtype", "demo-hybrid"])
def test_a_push_is_pulled_bit_for_bit(client: HandoffClient, broker, model):
    contract = client.get_contract(model)
    tensors = seeded_tensors(contract, seed=7)
    result = client.push(model, "req-1", position=contract.ctx - 1, tensors=tensors)
    assert (result.bytes, result.duplicate) == (contract.nbytes, False)
    handoff = client.pull(model, "req-1", timeout=10)
    assert handoff.position == contract.ctx - 1
    assert_same_bits(handoff.state, tensors)
    assert_holds_nothing(broker)


def test_pulled_arrays_own_their_memory(client: HandoffClient):
    contract = client.get_contract("every-dtype")
    client.push("every-dtype", "req-own", 1, seeded_tensors(contract))
    for array in client.pull("every-dtype", "req-own").state.values():
        assert array.flags.owndata and array.flags.writeable and array.flags.c_contiguous


@pytest.mark.parametrize("chunk_bytes", [1, 3, 1000, 4096])
def test_chunks_may_end_at_any_byte(broker, chunk_bytes):
    with HandoffClient(broker.address, chunk_bytes=chunk_bytes) as client:
        contract = client.get_contract("every-dtype")
        tensors = seeded_tensors(contract, seed=chunk_bytes)
        assert client.push("every-dtype", "req", 3, tensors).chunks >= contract.nbytes // chunk_bytes
        assert_same_bits(client.pull("every-dtype", "req").state, tensors)


def test_chunks_out_of_order_and_interleaved_across_tensors_arrive_whole(broker, client, contracts):
    contract = contracts["demo-hybrid"]
    tensors = seeded_tensors(contract, seed=3)
    frames = chunk_frames(contract, tensors, chunk_bytes=12_345)
    random.Random(3).shuffle(frames)
    raw_push(broker.address, [header_frame(contract, "shuffled", position=9), *frames])
    handoff = client.pull("demo-hybrid", "shuffled")
    assert handoff.position == 9
    assert_same_bits(handoff.state, tensors)


def test_tensors_the_contract_does_not_carry_are_left_behind_when_the_caller_says_so(client: HandoffClient):
    """Unasked, they are refused by name (tests/test_client_names.py)."""
    contract = client.get_contract("every-dtype")
    tensors = seeded_tensors(contract)
    client.push("every-dtype", "req", 0, {**tensors, "logits": np.zeros(5)}, drop_extra=True)
    assert_same_bits(client.pull("every-dtype", "req").state, tensors)


def test_a_pull_that_comes_before_the_push_waits_for_it(broker, client: HandoffClient):
    contract = client.get_contract("demo-hybrid")
    tensors = seeded_tensors(contract, seed=11)
    pulled: dict = {}

    def decode() -> None:
        with HandoffClient(broker.address) as decoder:
            pulled["handoff"] = decoder.pull("demo-hybrid", "early", timeout=20)
            pulled["at"] = time.monotonic()

    thread = threading.Thread(target=decode)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive() and broker.store.stats().ready == 0  # waiting: nothing was pushed yet
    pushed_at = time.monotonic()
    client.push("demo-hybrid", "early", 5, tensors)
    thread.join(timeout=20)
    assert pulled["at"] >= pushed_at
    assert_same_bits(pulled["handoff"].state, tensors)
    assert_holds_nothing(broker)


def test_many_hand_offs_of_many_models_do_not_mix(broker, client: HandoffClient):
    sent = {}
    for i in range(12):
        model = ["every-dtype", "demo-hybrid"][i % 2]
        contract = client.get_contract(model)
        sent[(model, f"r{i}")] = seeded_tensors(contract, seed=i)
        client.push(model, f"r{i}", i, sent[(model, f"r{i}")])
    assert broker.store.stats().ready == 12
    for (model, handoff_id), tensors in reversed(sent.items()):
        assert_same_bits(client.pull(model, handoff_id).state, tensors)
    assert_holds_nothing(broker)


def test_a_pull_lands_in_the_decoders_own_arrays(client: HandoffClient, broker):
    contract = client.get_contract("demo-hybrid")
    tensors = seeded_tensors(contract, seed=11)
    client.push("demo-hybrid", "req", 5, tensors)
    cache = {c.name: np.zeros(c.shape, c.numpy_dtype) for c in contract.carried}
    handoff = client.pull("demo-hybrid", "req", into=cache)
    assert all(handoff.state[name] is cache[name] for name in cache)  # filled in place, nothing allocated
    assert_same_bits(cache, tensors)
    assert_holds_nothing(broker)


def test_arrays_a_pull_cannot_fill_in_place_are_refused_before_anything_is_claimed(client: HandoffClient, broker):
    contract = client.get_contract("demo-hybrid")
    client.push("demo-hybrid", "req", 5, seeded_tensors(contract))
    first = contract.carried[0]
    fine = {c.name: np.zeros(c.shape, c.numpy_dtype) for c in contract.carried}
    strided = np.zeros((first.rows, first.cols * 2), first.numpy_dtype)[:, ::2]
    for bad, reason in (
        ({**fine, first.name: np.zeros((first.cols, first.rows), first.numpy_dtype)}, "WRONG_LAYOUT"),
        ({**fine, first.name: np.zeros(first.shape, np.float32)}, "WRONG_LAYOUT"),
        ({**fine, first.name: strided}, "WRONG_LAYOUT"),
        ({k: v for k, v in fine.items() if k != first.name}, "MISSING_TENSOR"),
    ):
        with pytest.raises(HandoffError) as caught:
            client.pull("demo-hybrid", "req", into=bad)
        assert caught.value.reason == reason and caught.value.tensor == first.name
    assert broker.store.stats().ready == 1  # nothing was claimed
    assert_same_bits(client.pull("demo-hybrid", "req", into=fine).state, fine)
