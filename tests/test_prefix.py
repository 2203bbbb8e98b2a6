"""Only what the prompt filled crosses the wire: a hand-off after `position` tokens carries, of each tensor whose rows
are cache positions, the min(position, rows) rows those tokens filled, and every fixed-size tensor whole.

The broker reserves, receives, holds, checks and sends only those bytes; `pull` returns arrays of the filled shape
and `pull(into=)` writes the first rows of the decoder's own full-size caches. Every test runs a real broker on
loopback; contracts come from real Hugging Face configs (tests/configs), cut to a few layers where the whole model
would only make the test slower without testing more (each layer's tensors keep the model's shapes).
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent import futures
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import (
    CapacityExhausted,
    Contract,
    HandoffClient,
    MissingTensor,
    PositionOutOfRange,
    UnknownTensor,
    WrongLength,
)
from handoff_client._architectures import contract_from_config
from handoff_client.protocol.contract import Carried, cut_to_filled
from handoff_client.protocol.errors import BadChunk
from handoff_client.protocol.frames import crc32c
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.shards import Shard, join_shards, shard_arrays
from handoff_client.protocol.wire import contract_from_proto, contract_to_proto
from proxy import Proxy
from support import broker_holds, chunk_frames, header_frame, raises_handoff_error, raw_push

CONFIGS = Path(__file__).parent / "configs"


def derive(config_file: str, *, ctx: int, layers: int | None = None, model: str | None = None) -> Contract:
    config = json.loads((CONFIGS / f"{config_file}.json").read_text())
    if layers is not None:
        config = {**config, "num_hidden_layers": layers}
    return contract_from_config(config, ctx=ctx, model=model or config_file)


LLAMA = derive("llama-3-8b", ctx=4096, layers=2)  # Llama-3-8B's layers: (4096, 8 heads x 128) bf16 caches, 32 MiB
GEMMA = derive("gemma-3-1b", ctx=1024, layers=6)  # five sliding layers (window 512: a ring of 511 rows), one global
MISTRAL = derive("mistral-7b-v0.1", ctx=8192, layers=1)  # every layer slides (window 4096): a ring of 4095 rows
QWEN3_NEXT = derive("qwen3-next-80b-a3b", ctx=4096, layers=4)  # three gated-delta layers, then attention
MODELS = {c.model: c for c in (LLAMA, GEMMA, MISTRAL, QWEN3_NEXT)}
EVERY_PATH = True  # each test on the gRPC streams, the TCP lane and the shared-memory lane (conftest.PATHS)


@pytest.fixture
def prefix_broker(start_broker):
    return start_broker(contracts=MODELS)


def received_bytes(broker, model: str) -> float:
    return broker.registry.get_sample_value("handoff_received_bytes_total", {"model": model}) or 0.0


def filled_bytes(contract: Contract, position: int) -> int:
    """The filled size worked out from the rule itself, not from `Contract.at`: the thing under test."""
    total = 0
    for c in contract.carried:
        rows = min(position, c.rows) if c.rows_are_positions else c.rows
        total += rows * c.cols * c.numpy_dtype.itemsize
    return total


# -- the contract says which tensors grow with the position ---------------------------------------------------------


def test_every_derived_cache_is_marked_positional_and_every_fixed_size_state_is_not():
    assert all(c.rows_are_positions for c in LLAMA.carried)
    assert all(c.rows_are_positions for c in GEMMA.carried)
    kinds = {c.name.rsplit(".", 1)[-1]: c.rows_are_positions for c in QWEN3_NEXT.carried}
    assert kinds == {
        "conv_q": False,
        "conv_k": False,
        "conv_v": False,
        "memory": False,
        "k_cache": True,
        "v_cache": True,
    }
    latent = derive("deepseek-v3", ctx=64, layers=1).carried
    assert [c.rows_are_positions for c in latent] == [True]  # the MLA latent
    fp8 = contract_from_config(json.loads((CONFIGS / "llama-3-8b.json").read_text()), ctx=64, dtype="float8_e4m3fn")
    scales = [c for c in fp8.carried if c.name.endswith(".scale")]
    assert scales and not any(c.rows_are_positions for c in scales)  # a per-tensor scale: one value, fixed
    int8 = contract_from_config(json.loads((CONFIGS / "llama-3-8b.json").read_text()), ctx=64, dtype="int8")
    assert all(c.rows_are_positions for c in int8.carried)  # a per-row scale grows with the rows it scales


def test_a_manifest_without_the_marker_keeps_its_fingerprint_and_the_marker_is_part_of_it_where_present():
    entry = {"name": "layers.0.k", "layer": 0, "rows": 8, "cols": 4, "dtype": "float32"}
    plain = Contract.from_json({"model": "m", "ctx": 8, "hidden": 4, "carried": [entry]})
    canonical = '{"carried":[{"cols":4,"dtype":"float32","layer":0,"name":"layers.0.k","rows":8}],"ctx":8,' \
                '"hidden":4,"model":"m"}'  # fmt: skip
    assert plain.fingerprint == hashlib.sha256(canonical.encode()).hexdigest()  # as before the marker existed
    unmarked = Contract.from_json(
        {"model": "m", "ctx": 8, "hidden": 4, "carried": [{**entry, "rows_are_positions": False}]}
    )
    assert unmarked.fingerprint == plain.fingerprint
    marked = Contract.from_json(
        {"model": "m", "ctx": 8, "hidden": 4, "carried": [{**entry, "rows_are_positions": True}]}
    )
    assert marked.fingerprint != plain.fingerprint
    assert marked.at(3).fingerprint == marked.fingerprint  # a hand-off's filled view names its declared contract


def test_the_marker_travels_in_get_contract_and_back(prefix_broker):
    assert contract_from_proto(contract_to_proto(QWEN3_NEXT)) == QWEN3_NEXT
    with HandoffClient(prefix_broker.address) as client:
        served = client.get_contract(QWEN3_NEXT.model)
    assert served == QWEN3_NEXT and served.fingerprint == QWEN3_NEXT.fingerprint


# -- a hand-off after `position` tokens carries exactly the rows they filled ----------------------------------------


@pytest.mark.parametrize("position", [1, 100, 4095])
def test_a_llama_hand_off_moves_and_holds_only_the_rows_its_prompt_filled(prefix_broker, position):
    filled = LLAMA.at(position)
    tensors = seeded_tensors(filled, seed=position)
    with HandoffClient(prefix_broker.address) as client:
        result = client.push(LLAMA.model, "req", position, tensors)
        assert result.bytes == filled_bytes(LLAMA, position) == position * 4 * 1024 * 2
        assert prefix_broker.store.stats().resident_bytes == result.bytes  # reserved: the filled size, no more
        assert received_bytes(prefix_broker, LLAMA.model) == result.bytes
        handoff = client.pull(LLAMA.model, "req")
    assert handoff.position == position
    assert {a.shape for a in handoff.state.values()} == {(position, 1024)}
    assert_same_bits(handoff.state, tensors)
    assert prefix_broker.registry.get_sample_value("handoff_sent_bytes_total", {"model": LLAMA.model}) == result.bytes
    assert_holds_nothing(prefix_broker)


def test_whole_cache_arrays_may_be_pushed_and_only_their_filled_rows_are_sent(prefix_broker):
    caches = seeded_tensors(LLAMA, seed=3)  # the prefill engine's whole (4096, 1024) caches
    with HandoffClient(prefix_broker.address) as client:
        result = client.push(LLAMA.model, "req", 100, caches)
        assert result.bytes == received_bytes(prefix_broker, LLAMA.model) == filled_bytes(LLAMA, 100)
        handoff = client.pull(LLAMA.model, "req")
    assert_same_bits(handoff.state, {name: array[:100] for name, array in caches.items()})


def test_pulling_into_the_decoders_full_caches_fills_their_first_rows_and_leaves_the_rest(prefix_broker):
    tensors = seeded_tensors(LLAMA.at(100), seed=4)
    caches = {c.name: np.full(c.shape, 7, c.numpy_dtype) for c in LLAMA.carried}  # sentinels everywhere
    with HandoffClient(prefix_broker.address) as client:
        client.push(LLAMA.model, "req", 100, tensors)
        handoff = client.pull(LLAMA.model, "req", into=caches)
    for name, cache in caches.items():
        assert cache.shape == (4096, 1024)
        assert cache[:100].tobytes() == tensors[name].tobytes()
        assert (cache[100:] == 7).all()  # untouched past the filled rows
        assert np.shares_memory(handoff.state[name], cache) and handoff.state[name].shape == (100, 1024)


def test_a_pipelined_pull_yields_each_tensor_at_its_filled_shape_as_it_arrives(prefix_broker):
    tensors = seeded_tensors(QWEN3_NEXT.at(100), seed=5)
    with HandoffClient(prefix_broker.address) as client:
        pull = client.pull_tensors(QWEN3_NEXT.model, "req", timeout=20)  # claimed before the push begins
        pusher = threading.Thread(target=client.push, args=(QWEN3_NEXT.model, "req", 100, tensors))
        pusher.start()
        yielded = {carried.name: array.copy() for carried, array in pull}
        pusher.join()
    assert_same_bits(yielded, tensors)
    assert_same_bits(pull.handoff.state, tensors)


def test_a_hybrid_carries_its_gated_delta_state_whole_and_its_attention_caches_filled(prefix_broker):
    tensors = seeded_tensors(QWEN3_NEXT.at(100), seed=6)
    with HandoffClient(prefix_broker.address) as client:
        result = client.push(QWEN3_NEXT.model, "req", 100, tensors)
        handoff = client.pull(QWEN3_NEXT.model, "req")
    for carried in QWEN3_NEXT.carried:
        want_rows = 100 if carried.name.endswith(("k_cache", "v_cache")) else carried.rows
        assert handoff.state[carried.name].shape == (want_rows, carried.cols), carried.name
    assert result.bytes == filled_bytes(QWEN3_NEXT, 100) == received_bytes(prefix_broker, QWEN3_NEXT.model)
    assert_same_bits(handoff.state, tensors)


@pytest.mark.parametrize(
    ("contract", "position", "ring_rows", "full_rows"),
    [
        (GEMMA, 300, 300, 300),  # before the 511-row ring wraps: rows [0, 300) of both
        (GEMMA, 900, 511, 900),  # after: the ring is full (position p at row p mod 511), the global layer grows
        (MISTRAL, 4000, 4000, None),
        (MISTRAL, 6000, 4095, None),
    ],
)
def test_a_sliding_window_ring_carries_its_filled_rows_before_it_wraps_and_all_after(
    prefix_broker, contract, position, ring_rows, full_rows
):
    tensors = seeded_tensors(contract.at(position), seed=position)
    with HandoffClient(prefix_broker.address) as client:
        result = client.push(contract.model, "req", position, tensors)
        handoff = client.pull(contract.model, "req")
    for carried in contract.carried:
        want = ring_rows if carried.rows < contract.ctx else full_rows
        assert handoff.state[carried.name].shape == (want, carried.cols), carried.name
    assert result.bytes == filled_bytes(contract, position) == received_bytes(prefix_broker, contract.model)
    assert_same_bits(handoff.state, tensors)


def test_position_zero_carries_no_cache_rows_and_still_moves_its_fixed_state(prefix_broker):
    tensors = seeded_tensors(QWEN3_NEXT.at(0), seed=7)
    with HandoffClient(prefix_broker.address) as client:
        result = client.push(QWEN3_NEXT.model, "req", 0, tensors)
        handoff = client.pull(QWEN3_NEXT.model, "req")
    assert result.bytes == filled_bytes(QWEN3_NEXT, 0) > 0
    assert_same_bits(handoff.state, tensors)


# -- the seed's rules, with "size" the filled size ------------------------------------------------------------------


def test_a_tensor_of_the_wrong_filled_size_is_wrong_length_naming_the_filled_rows(prefix_broker):
    tensors = seeded_tensors(LLAMA.at(100), seed=8)
    name = LLAMA.carried[0].name
    with HandoffClient(prefix_broker.address) as client:
        short = {**tensors, name: tensors[name][:50]}
        error = raises_handoff_error(client.push, LLAMA.model, "req", 100, short)
    assert isinstance(error, WrongLength)
    assert error.message == (
        f"{LLAMA.model}: `{name}` is 102400 values in the contract (the 100 rows 100 tokens filled of its 4096) "
        "and 51200 in the hand-off (204800 and 102400 bytes of bfloat16)"
    )
    # The broker finds it too, from the wire, with the same words: a push that stops at 50 rows.
    frames = chunk_frames(LLAMA.at(100), short, 1 << 20)
    error = raises_handoff_error(raw_push, prefix_broker.address, [header_frame(LLAMA, "raw", 100), *frames])
    assert isinstance(error, WrongLength) and "(the 100 rows 100 tokens filled of its 4096)" in error.message
    assert error.fields["want"] == error.fields["want_values"] == "102400" and error.fields["tensor"] == name
    assert (error.fields["want_bytes"], error.fields["got_bytes"]) == ("204800", "102400")  # the units in the names
    assert_holds_nothing(prefix_broker)


def test_on_the_wire_only_the_filled_rows_are_taken_a_chunk_past_them_is_a_bad_chunk(prefix_broker):
    """The wire carries exactly the filled rows (our client cuts whole caches before sending); a pusher that sends
    the whole cache is refused at the first byte past them, and nothing is held."""
    frames = chunk_frames(LLAMA, seeded_tensors(LLAMA, seed=9), 1 << 20)  # whole caches, as declared
    error = raises_handoff_error(raw_push, prefix_broker.address, [header_frame(LLAMA, "raw", 100), *frames])
    assert isinstance(error, BadChunk)
    assert "runs past the tensor's 204800 bytes ((100, 1024) bfloat16, the filled rows of its (4096, 1024))" in (
        error.message
    )
    assert_holds_nothing(prefix_broker)


def test_unknown_missing_and_position_rules_hold_on_prefix_hand_offs(prefix_broker):
    tensors = seeded_tensors(LLAMA.at(100), seed=10)
    with HandoffClient(prefix_broker.address) as client:
        first = LLAMA.carried[0].name
        missing = raises_handoff_error(
            client.push, LLAMA.model, "a", 100, {k: v for k, v in tensors.items() if k != first}
        )
        assert isinstance(missing, MissingTensor) and missing.tensor == first
        past = raises_handoff_error(client.push, LLAMA.model, "b", 4096, seeded_tensors(LLAMA, seed=10))
        assert isinstance(past, PositionOutOfRange)
    unknown = chunk_frames(LLAMA.at(100), tensors, 1 << 20)[:1] + [
        pb.PushRequest(chunk=pb.Chunk(tensor="nope", offset=0, crc32c=crc32c(b"x"), data=b"x")).SerializeToString()
    ]
    error = raises_handoff_error(raw_push, prefix_broker.address, [header_frame(LLAMA, "c", 100), *unknown])
    assert isinstance(error, UnknownTensor) and error.tensor == "nope"
    error = raises_handoff_error(raw_push, prefix_broker.address, [header_frame(LLAMA, "d", 4096)])
    assert isinstance(error, PositionOutOfRange)
    assert_holds_nothing(prefix_broker)


def test_a_push_built_by_protoc_generated_code_for_a_prefix_is_accepted(prefix_broker):
    """A client written from the .proto alone: generated messages, not our hand-made frames."""
    tensors = seeded_tensors(QWEN3_NEXT.at(33), seed=11)
    frames = [header_frame(QWEN3_NEXT, "req", 33)]
    for carried in QWEN3_NEXT.at(33).carried:
        data = tensors[carried.name].tobytes()
        for offset in range(0, len(data), 40_000):
            piece = data[offset : offset + 40_000]
            chunk = pb.Chunk(tensor=carried.name, offset=offset, crc32c=crc32c(piece), data=piece)
            frames.append(pb.PushRequest(chunk=chunk).SerializeToString())
    result = raw_push(prefix_broker.address, frames)
    assert result.bytes == filled_bytes(QWEN3_NEXT, 33)
    with HandoffClient(prefix_broker.address) as client:
        assert_same_bits(client.pull(QWEN3_NEXT.model, "req").state, tensors)


# -- the broker reserves only the filled bytes ----------------------------------------------------------------------


def test_room_for_one_full_context_hand_off_admits_many_short_ones_at_once(start_broker):
    broker = start_broker(contracts={LLAMA.model: LLAMA}, max_bytes=LLAMA.nbytes)
    short = seeded_tensors(LLAMA.at(100), seed=12)  # 800 KiB each: 40 fit where one full context does
    with HandoffClient(broker.address, timeout=20) as client:
        with futures.ThreadPoolExecutor(20) as pool:
            pushed = list(pool.map(lambda i: client.push(LLAMA.model, f"short-{i}", 100, short), range(20)))
        assert all(not r.duplicate for r in pushed)
        stats = broker.store.stats()
        assert (stats.ready, stats.resident_bytes) == (20, 20 * filled_bytes(LLAMA, 100))
        long = seeded_tensors(LLAMA.at(4095), seed=13)
        full = raises_handoff_error(client.push, LLAMA.model, "long", 4095, long, wait_for_room=False)
        assert isinstance(full, CapacityExhausted)
        waited = raises_handoff_error(client.push, LLAMA.model, "long", 4095, long, timeout=1.0)
        assert isinstance(waited, CapacityExhausted)  # waited for room, then said why
        assert f"{filled_bytes(LLAMA, 4095)}" in waited.message
        for i in range(20):
            client.pull(LLAMA.model, f"short-{i}")
        client.push(LLAMA.model, "long", 4095, long)  # room now
        assert_same_bits(client.pull(LLAMA.model, "long").state, long)
    assert_holds_nothing(broker)


def test_a_resumable_prefix_push_whose_connection_breaks_sends_only_the_rest(prefix_broker):
    tensors = seeded_tensors(LLAMA, seed=14)  # whole caches; 1000 rows filled: 8 MB on the wire
    proxy = Proxy(prefix_broker.port)
    try:
        proxy.cut_after(3_000_000, once=broker_holds(prefix_broker.address, LLAMA.model, "req", 2_500_000))
        with HandoffClient(proxy.address, chunk_bytes=256 << 10, lanes=False) as client:  # (lanes: test_lanes.py)
            result = client.push(LLAMA.model, "req", 1000, tensors, resumable=True)
        assert proxy.connections == 2 and result.bytes == filled_bytes(LLAMA, 1000)
        assert proxy.carried[1] < filled_bytes(LLAMA, 1000) - 2_000_000  # the retry sent only the rest
        with HandoffClient(prefix_broker.address) as client:
            assert client.push_progress(LLAMA.model, "req").position == 1000
            assert_same_bits(client.pull(LLAMA.model, "req").state, {k: v[:1000] for k, v in tensors.items()})
    finally:
        proxy.close()


def test_a_repeat_push_of_a_prefix_is_recognised_and_another_position_refused(prefix_broker):
    tensors = seeded_tensors(LLAMA.at(100), seed=15)
    with HandoffClient(prefix_broker.address) as client:
        first = client.push(LLAMA.model, "req", 100, tensors)
        again = client.push(LLAMA.model, "req", 100, seeded_tensors(LLAMA, seed=0) | tensors)
        assert again.duplicate and again.digest == first.digest
        other = raises_handoff_error(client.push, LLAMA.model, "req", 101, seeded_tensors(LLAMA.at(101)))
        assert "was pushed at position 100, not 101" in other.message
        client.pull(LLAMA.model, "req")


# -- tensor-parallel pushes and pulls of prefixes -------------------------------------------------------------------


TP_LLAMA = derive("llama-3-8b", ctx=64, layers=2, model="tp-llama")


@pytest.mark.parametrize("push_tp", [1, 2, 4])
@pytest.mark.parametrize("pull_tp", [1, 2, 4])
def test_every_pair_of_tp_sizes_moves_a_prefix_and_a_reshard_copies_only_its_filled_rows(
    start_broker, push_tp, pull_tp
):
    broker = start_broker(contracts={TP_LLAMA.model: TP_LLAMA})
    filled = TP_LLAMA.at(10)
    whole = seeded_tensors(filled, seed=push_tp * 10 + pull_tp)
    client = HandoffClient(broker.address, timeout=20, chunk_bytes=3001)
    with client, futures.ThreadPoolExecutor(push_tp + pull_tp) as pool:
        pulls = [pool.submit(client.pull, TP_LLAMA.model, "req", shard=(rank, pull_tp)) for rank in range(pull_tp)]
        for rank in range(push_tp):
            mine = shard_arrays(filled, whole, Shard(rank, push_tp), pushing=True)
            pool.submit(client.push, TP_LLAMA.model, "req", 10, mine, shard=(rank, push_tp))
        pulled = [p.result(timeout=30) for p in pulls]
    for rank, handoff in enumerate(pulled):
        assert_same_bits(handoff.state, shard_arrays(filled, whole, Shard(rank, pull_tp), pushing=False))
    assert_same_bits(join_shards(filled, pulled, pull_tp).state, whole)
    assert received_bytes(broker, TP_LLAMA.model) == filled_bytes(TP_LLAMA, 10)
    copied = broker.registry.get_sample_value("handoff_resharded_bytes_total", {"model": TP_LLAMA.model}) or 0
    if push_tp > pull_tp:  # each decode rank's heads are assembled from several pushed parts: filled rows only
        assert copied == filled_bytes(TP_LLAMA, 10)
    assert copied <= filled_bytes(TP_LLAMA, 10) < TP_LLAMA.nbytes
    assert_holds_nothing(broker)


def test_a_filled_view_of_a_contract_is_cut_from_the_declared_rows():
    ring = Carried("k", 0, 512, 8, "bfloat16", rows_are_positions=True)
    assert ring.filled(100).shape == (100, 8) and ring.filled(100).cache_rows == 512
    assert ring.filled(512) is ring and ring.filled(9000) is ring  # wrapped: every row is filled
    fixed = Carried("memory", 0, 64, 8, "float32")
    assert fixed.filled(1) is fixed
    contract = Contract("m", 1024, 8, (ring, fixed))
    assert contract.at(1000) is contract  # nothing cut: the contract itself
    filled = contract.at(100)
    arrays = cut_to_filled(filled, {"k": np.zeros((512, 8), np.float32), "memory": np.zeros((64, 8))})
    assert arrays["k"].shape == (100, 8) and arrays["memory"].shape == (64, 8)
