"""Prefill and decode at different tensor-parallel sizes: the broker reshards by heads.

Contracts here come from real config.json files (Llama-3-8B: 8 KV heads; Qwen2-7B: 4, so TP 8 replicates each head
on two ranks; Qwen3-Next: 2 KV heads beside gated-delta conv rings and memories split by their 16 key and 32 value
heads; DeepSeek-V3's MLA latent, not split), over a short cache so every pair of TP sizes runs in moments.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import (
    AlreadyClaimed,
    CallCancelled,
    Contract,
    HandoffCancelled,
    HandoffClient,
    HandoffGone,
    ManifestError,
    MissingTensor,
    NotInShard,
    PushAborted,
    Shard,
    ShardLayout,
    ShardMismatch,
    StaleClaim,
    WaitTimedOut,
    WrongLength,
    join_shards,
    shard_arrays,
)
from handoff_client._architectures import contract_from_config
from handoff_client.protocol.contract import Carried
from handoff_client.protocol.frames import decode_chunk
from handoff_client.protocol.shards import ShardContract, held_heads, pushes
from proxy import Proxy
from support import broker_holds, chunk_frames, header_frame, open_channel, raises_handoff_error, raw_pull, raw_push
from test_claims import wait_until

EVERY_PATH = True  # each test on the gRPC streams, the TCP lane and the shared-memory lane (conftest.PATHS)

CONFIGS = Path(__file__).parent / "configs"
WORKERS = Path(__file__).parent / "workers.py"
TP_SIZES = (1, 2, 4, 8)
ODD_CHUNK = 3001  # chunk edges fall mid-row and mid-head, so the broker's cut handles partial rows


def model(name: str, config_file: str, layers: int | None = None, ctx: int = 4) -> Contract:
    """The config's contract with every tensor carried whole (its caches not marked `rows_are_positions`): these
    tests move whole tensors; tests/test_prefix.py moves the filled rows of a prefix across every TP pairing."""
    config = json.loads((CONFIGS / f"{config_file}.json").read_text())
    if layers is not None:
        config = {**config, "num_hidden_layers": layers}
    derived = contract_from_config(config, ctx=ctx, model=name, state_dtype="bfloat16")
    whole = tuple(replace(c, rows_are_positions=False) for c in derived.carried)
    return Contract(derived.model, derived.ctx, derived.hidden, whole)


MODELS = {
    "llama-3-8b": model("llama-3-8b", "llama-3-8b"),
    "qwen2-7b": model("qwen2-7b", "qwen2-7b"),
    "qwen3-next": model("qwen3-next", "qwen3-next-80b-a3b", layers=4),
}
LATENT = model("deepseek-v3", "deepseek-v3", layers=2)  # one MLA latent a layer: not split, every rank holds it
LLAMA_1K = model("llama-3-8b-1k", "llama-3-8b", ctx=1024)  # 128 MiB: a shard is more than the connection buffers
SIX_HEADS = Contract("six-heads", 8, 64, (Carried("layers.0.k", 0, 8, 6 * 4, "float32", 6, 4),))


@pytest.fixture
def tp_broker(start_broker):
    extra = {c.model: c for c in (SIX_HEADS, LLAMA_1K, LATENT)}
    return start_broker(contracts={**MODELS, **extra}, lease=60.0)


def heads_move(contract: Contract, push_tp: int, pull_tp: int) -> bool:
    """Whether some decode rank holds heads that no single prefill rank pushed as they are."""
    for carried in contract.carried:
        if carried.heads:
            sent = {held_heads(contract.model, carried, Shard(r, push_tp)) for r in range(push_tp)}
            if any(held_heads(contract.model, carried, Shard(r, pull_tp)) not in sent for r in range(pull_tp)):
                return True
    return False


def push_rank(client: HandoffClient, contract: Contract, handoff_id: str, full: dict, rank: int, tp: int) -> None:
    """Rank `rank` of a prefill engine at TP size `tp` pushes its own part of `full` (after 3 tokens)."""
    mine = shard_arrays(contract, full, Shard(rank, tp), pushing=True)
    client.push(contract.model, handoff_id, 3, mine, shard=(rank, tp))


def push_all_ranks(client: HandoffClient, contract: Contract, handoff_id: str, full: dict, tp: int) -> None:
    """Every rank of a prefill engine at TP size `tp` pushes its own part, each in its own stream, concurrently."""
    with futures.ThreadPoolExecutor(tp) as pool:
        list(pool.map(lambda rank: push_rank(client, contract, handoff_id, full, rank, tp), range(tp)))


def pull_all_ranks(client: HandoffClient, contract: Contract, handoff_id: str, tp: int) -> list:
    with futures.ThreadPoolExecutor(tp) as pool:
        return list(pool.map(lambda r: client.pull(contract.model, handoff_id, shard=(r, tp), timeout=20), range(tp)))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("push_tp,pull_tp", list(itertools.product(TP_SIZES, TP_SIZES)))
def test_every_pair_of_tp_sizes_gives_each_decode_rank_its_heads_and_the_whole_back(tp_broker, name, push_tp, pull_tp):
    contract = MODELS[name]
    full = seeded_tensors(contract, seed=push_tp * 10 + pull_tp)
    with HandoffClient(tp_broker.address, timeout=20, chunk_bytes=ODD_CHUNK) as client:
        push_all_ranks(client, contract, "req", full, push_tp)
        pulled = pull_all_ranks(client, contract, "req", pull_tp)
    for rank, handoff in enumerate(pulled):
        assert handoff.position == 3
        want = shard_arrays(contract, full, Shard(rank, pull_tp), pushing=False)
        assert_same_bits(handoff.state, want)  # exactly its heads, contiguous, at (rows, heads/tp x head_dim)
        assert all(a.flags.c_contiguous for a in handoff.state.values())
    assert_same_bits(join_shards(contract, pulled, pull_tp).state, full)
    assert_holds_nothing(tp_broker)
    copied = tp_broker.registry.get_sample_value("handoff_resharded_bytes_total", {"model": name}) or 0
    assert (copied > 0) == heads_move(contract, push_tp, pull_tp)  # else every frame is forwarded as it came
    assert tp_broker.registry.get_sample_value("handoff_confirms_total", {"model": name}) == 1


def test_a_rank_holds_its_heads_or_a_replica_of_one_as_vllm_does():
    qwen2 = MODELS["qwen2-7b"]  # 4 KV heads of 128
    k = qwen2.tensor("layers.0.self_attn.k_cache")
    assert (k.heads, k.head_dim) == (4, 128)
    assert ShardContract.of(qwen2, Shard(1, 2), pushing=False).tensor(k.name).shape == (4, 256)
    eight = [ShardContract.of(qwen2, Shard(r, 8), pushing=False).heads[0] for r in range(8)]
    assert eight == [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)]
    assert [pushes(qwen2.model, k, Shard(r, 8)) for r in range(8)] == [True, False] * 4  # once, by its first holder
    latent = LATENT.tensor("layers.0.self_attn.kv_latent")  # not split: rank 0 pushes it, every rank pulls it whole
    assert [pushes(LATENT.model, latent, Shard(r, 4)) for r in range(4)] == [True, False, False, False]
    assert ShardContract.of(LATENT, Shard(3, 4), pushing=False).tensor(latent.name).shape == latent.shape
    next_ = MODELS["qwen3-next"]  # a gated-delta layer's conv ring and memory split by head, as vLLM shards them
    conv_v, memory = next_.tensor("layers.0.linear_attn.conv_v"), next_.tensor("layers.0.linear_attn.memory")
    assert [pushes(next_.model, conv_v, Shard(r, 4)) for r in range(4)] == [True] * 4
    rank3 = ShardContract.of(next_, Shard(3, 4), pushing=False)
    assert (rank3.tensor(conv_v.name).shape, rank3.tensor(memory.name).shape) == ((3, 8 * 128), (128, 8 * 128))


def test_the_hand_off_is_invisible_until_every_rank_has_pushed(tp_broker):
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract)
    with HandoffClient(tp_broker.address, timeout=20) as client:
        push_rank(client, contract, "req", full, 0, 2)
        with pytest.raises(WaitTimedOut):
            client.pull(contract.model, "req", timeout=0.5)
        with pytest.raises(WaitTimedOut):
            client.pull(contract.model, "req", shard=(0, 4), timeout=0.5)
        push_rank(client, contract, "req", full, 1, 2)
        assert_same_bits(client.pull(contract.model, "req").state, full)  # a TP=1 decoder gets it whole
    assert_holds_nothing(tp_broker)


def test_a_pull_waiting_before_the_push_gets_its_shard_once_every_rank_has_pushed(tp_broker):
    contract = MODELS["qwen3-next"]
    full = seeded_tensors(contract)
    with HandoffClient(tp_broker.address, timeout=20) as client, futures.ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(client.pull, contract.model, "req", shard=(r, 2)) for r in range(2)]
        push_all_ranks(client, contract, "req", full, 4)
        pulled = [w.result(timeout=20) for w in waiting]
    assert_same_bits(join_shards(contract, pulled, 2).state, full)
    assert_holds_nothing(tp_broker)


def test_one_rank_pushing_what_is_not_its_own_frees_every_rank(tp_broker):
    contract = LATENT
    full = seeded_tensors(contract)
    with HandoffClient(tp_broker.address, timeout=20) as client:
        push_rank(client, contract, "req", full, 0, 2)
        rank0 = shard_arrays(contract, full, Shard(0, 2), pushing=True)  # rank 1 sends rank 0's latent too
        frames = [header_frame(contract, "req", position=3, shard=(1, 2)), *chunk_frames(contract, rank0, 1 << 16)]
        error = raises_handoff_error(raw_push, tp_broker.address, frames)
        assert isinstance(error, NotInShard)
        assert error.tensor == "layers.0.self_attn.kv_latent"
        assert "not rank 1 of 2's to push: it is not split, and rank 0 pushes it" in error.message
        assert_holds_nothing(tp_broker)  # rank 0's committed part went with it
        push_all_ranks(client, contract, "req", full, 2)  # the whole push again, every rank
        assert_same_bits(client.pull(contract.model, "req").state, full)


def test_a_rank_still_pushing_when_another_fails_hears_that_the_hand_off_was_abandoned(tp_broker):
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract)
    rank0 = shard_arrays(contract, full, Shard(0, 2), pushing=True)
    frames = chunk_frames(contract, rank0, 1 << 16)
    started, fail_now = threading.Event(), threading.Event()

    def slow_rank0():
        yield header_frame(contract, "req", position=3, shard=(0, 2))
        yield frames[0]
        started.set()
        fail_now.wait(10)
        yield from frames[1:]

    with futures.ThreadPoolExecutor(1) as pool:
        pushing = pool.submit(raises_handoff_error, raw_push, tp_broker.address, slow_rank0())
        started.wait(10)
        wait_until(lambda: tp_broker.store.stats().resident_bytes > 0)  # the broker has begun rank 0's push
        short = [header_frame(contract, "req", position=3, shard=(1, 2)), frames[0]]  # rank 1 stops after a chunk
        assert isinstance(raises_handoff_error(raw_push, tp_broker.address, short), MissingTensor)
        fail_now.set()
        error = pushing.result(timeout=20)
    assert isinstance(error, PushAborted)
    assert "abandoned: another rank's push of it failed" in error.message
    assert_holds_nothing(tp_broker)


def test_each_shard_is_claimed_once_and_the_hand_off_is_freed_when_every_rank_has_confirmed(tp_broker):
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract)
    with HandoffClient(tp_broker.address, timeout=20) as client:
        client.push(contract.model, "req", 3, full)
        stream = client.pull_tensors(contract.model, "req", shard=(0, 2))
        arriving = iter(stream)
        next(arriving)  # rank 0's shard is claimed and streaming
        with pytest.raises(AlreadyClaimed, match=r"`req` \(rank 0 of 2\) is claimed"):
            client.pull(contract.model, "req", shard=(0, 2), timeout=2)
        one = client.pull(contract.model, "req", shard=(1, 2))
        assert tp_broker.store.stats().resident_bytes > 0  # rank 0 has not confirmed: nothing is freed yet
        with pytest.raises(HandoffGone, match=r"already delivered to rank 1 of 2 and confirmed"):
            client.pull(contract.model, "req", shard=(1, 2), timeout=2)  # not "claimed by another decode worker"
        list(arriving)
        zero = stream.handoff
        assert_same_bits(join_shards(contract, [zero, one], 2).state, full)
        assert_holds_nothing(tp_broker)
        with pytest.raises(HandoffGone):
            client.pull(contract.model, "req", shard=(1, 2), timeout=2)


def test_a_killed_decode_ranks_shard_can_be_pulled_again(tp_broker):
    contract = LLAMA_1K
    full = seeded_tensors(contract)
    with HandoffClient(tp_broker.address, timeout=20) as client:
        push_all_ranks(client, contract, "req", full, 4)
        worker = subprocess.Popen(
            [sys.executable, str(WORKERS), "pull-and-stall", tp_broker.address, contract.model, "req", "1", "2"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert worker.stdout.readline().strip() == "stalled"
        assert tp_broker.store.stats().claimed == 1
        worker.kill()
        worker.wait(timeout=10)
        wait_until(lambda: tp_broker.store.stats().claimed == 0)  # its stream broke (not a lease): the claim is back
        pulled = pull_all_ranks(client, contract, "req", 2)
    assert_same_bits(join_shards(contract, pulled, 2).state, full)
    assert_holds_nothing(tp_broker)


def test_every_rank_of_a_push_and_of_a_pull_uses_one_tp_size(tp_broker):
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract)
    with HandoffClient(tp_broker.address, timeout=20) as client:
        push_rank(client, contract, "req", full, 0, 2)
        error = raises_handoff_error(
            client.push, contract.model, "req", 3, shard_arrays(contract, full, Shard(1, 4), pushing=True), shard=(1, 4)
        )
        assert isinstance(error, ShardMismatch)
        assert error.message == (
            "llama-3-8b: hand-off `req` is pushed at TP size 2, not 4; every rank of one hand-off's push uses the "
            "same TP size"
        )
        push_rank(client, contract, "req", full, 1, 2)
        first = client.pull(contract.model, "req", shard=(0, 4))
        with pytest.raises(ShardMismatch, match="is pulled at TP size 4, not 2"):
            client.pull(contract.model, "req", shard=(1, 2), timeout=2)
        rest = [client.pull(contract.model, "req", shard=(r, 4)) for r in (1, 2, 3)]
    assert_same_bits(join_shards(contract, [first, *rest], 4).state, full)
    assert_holds_nothing(tp_broker)


def test_a_repeated_rank_push_changes_nothing_before_and_after_the_cut(tp_broker):
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract)
    rank1 = shard_arrays(contract, full, Shard(1, 2), pushing=True)
    with HandoffClient(tp_broker.address, timeout=20) as client:
        push_all_ranks(client, contract, "req", full, 2)
        assert client.push(contract.model, "req", 3, rank1, shard=(1, 2)).duplicate
        first = client.pull(contract.model, "req", shard=(0, 2))
        assert client.push(contract.model, "req", 3, rank1, shard=(1, 2)).duplicate  # recognised by its digest
        second = client.pull(contract.model, "req", shard=(1, 2))
    assert_same_bits(join_shards(contract, [first, second], 2).state, full)
    assert_holds_nothing(tp_broker)


def test_cancel_frees_every_rank_of_a_sharded_hand_off(tp_broker):
    contract = MODELS["qwen2-7b"]
    full = seeded_tensors(contract)
    with HandoffClient(tp_broker.address, timeout=20) as client:
        push_all_ranks(client, contract, "req", full, 2)
        client.pull(contract.model, "req", shard=(0, 8))
        assert client.cancel(contract.model, "req")
        assert_holds_nothing(tp_broker)
        with pytest.raises(HandoffCancelled):
            client.pull(contract.model, "req", shard=(1, 8), timeout=2)


def test_heads_that_the_tp_size_cannot_share_are_refused_by_name_on_both_sides(tp_broker):
    with HandoffClient(tp_broker.address, timeout=20) as client:
        arrays = {"layers.0.k": np.zeros((8, 6), np.float32)}
        error = raises_handoff_error(client.push, SIX_HEADS.model, "req", 3, arrays, shard=(0, 4))
        assert isinstance(error, ShardLayout)
        assert error.message == (
            "six-heads: `layers.0.k` has 6 heads, which a TP size of 4 cannot share: the TP size must divide the "
            "heads, or the heads the TP size"
        )
        frames = [header_frame(SIX_HEADS, "req", position=3, shard=(0, 4))]
        assert raises_handoff_error(raw_push, tp_broker.address, frames).message == error.message  # the broker's own
        error = raises_handoff_error(client.pull, SIX_HEADS.model, "req", shard=(1, 4), timeout=2)
        assert isinstance(error, ShardLayout) and error.tensor == "layers.0.k"
        error = raises_handoff_error(raw_push, tp_broker.address, [header_frame(SIX_HEADS, "r", 3, shard=(2, 2))])
        assert isinstance(error, ShardLayout) and "rank 2 of TP size 2" in error.message
        client.push(SIX_HEADS.model, "req", 3, {"layers.0.k": np.ones((8, 12), np.float32)}, shard=(0, 2))
    assert tp_broker.store.stats().receiving == 1  # the refusals changed nothing; the good rank 0 of 2 waits


def test_a_rank_pushing_the_whole_array_instead_of_its_heads_is_told_its_own_shape(tp_broker):
    contract = MODELS["llama-3-8b"]
    view = ShardContract.of(contract, Shard(1, 4), pushing=True)
    k = view.tensor("layers.0.self_attn.k_cache")
    assert (k.shape, k.heads) == ((4, 256), 2)
    assert view.fingerprint == contract.fingerprint  # a rank pushes under the whole contract's fingerprint
    with HandoffClient(tp_broker.address, timeout=20) as client:
        error = raises_handoff_error(client.push, contract.model, "req", 3, seeded_tensors(contract), shard=(1, 4))
    assert isinstance(error, WrongLength) and error.tensor == k.name
    assert error.message == (
        "llama-3-8b: `layers.0.self_attn.k_cache` is 1024 values in the contract and 4096 in the hand-off "
        "(2048 and 8192 bytes of bfloat16)"
    )
    assert_holds_nothing(tp_broker)


def test_a_rank_that_never_pushes_lets_the_others_expire_unclaimed(start_broker):
    broker = start_broker(contracts=MODELS, ttl=0.5)
    contract = MODELS["llama-3-8b"]
    with HandoffClient(broker.address, timeout=20) as client:
        rank0 = shard_arrays(contract, seeded_tensors(contract), Shard(0, 2), pushing=True)
        client.push(contract.model, "req", 3, rank0, shard=(0, 2))
        wait_until(lambda: broker.store.stats().resident_bytes == 0)
        assert_holds_nothing(broker)
        with pytest.raises(HandoffGone, match="expired"):
            client.pull(contract.model, "req", shard=(0, 2), timeout=2)


def test_a_manifest_states_heads_that_make_its_columns_and_they_cross_the_wire(tp_broker):
    entry = {"name": "k", "layer": 0, "rows": 4, "cols": 8, "dtype": "float32"}
    plain = Contract.from_json({"model": "m", "ctx": 4, "hidden": 8, "carried": [entry]})
    assert "heads" not in plain.to_json()["carried"][0]  # a contract without heads keeps its fingerprint
    split = Contract.from_json({"model": "m", "ctx": 4, "hidden": 8, "carried": [{**entry, "heads": 2, "head_dim": 4}]})
    assert (split.carried[0].heads, split.carried[0].head_dim) == (2, 4)
    assert split.fingerprint != plain.fingerprint
    with pytest.raises(ManifestError, match=r"carried\[0\]\.heads: 3 heads x head_dim 4 must make its 8 columns"):
        Contract.from_json({"model": "m", "ctx": 4, "hidden": 8, "carried": [{**entry, "heads": 3, "head_dim": 4}]})
    with HandoffClient(tp_broker.address, timeout=20) as client:
        served = client.get_contract("qwen2-7b")
    assert served == MODELS["qwen2-7b"] and served.tensor("layers.0.self_attn.v_cache").heads == 4


def test_many_sharded_hand_offs_at_once_with_cancels_lose_and_double_nothing(tp_broker):
    """Twelve hand-offs at once, each at its own pair of TP sizes, every rank a thread with its own connection; a
    third are cancelled while in flight. Every other one reaches each decode rank exactly once, bit for bit."""
    contract = MODELS["qwen3-next"]
    sizes = list(itertools.product(TP_SIZES, TP_SIZES))
    plan = {f"req-{i}": (sizes[(i * 5) % len(sizes)], i % 3 == 2) for i in range(12)}
    full = {handoff_id: seeded_tensors(contract, seed=i) for i, handoff_id in enumerate(plan)}
    delivered: dict[str, list] = {handoff_id: [] for handoff_id in plan}
    lock = threading.Lock()

    def push(handoff_id: str, rank: int, tp: int) -> None:
        # Chunk edges still fall mid-row, but ten times fewer chunks than ODD_CHUNK's: 45 ranks' streams share 2 cores
        with HandoffClient(tp_broker.address, timeout=20, chunk_bytes=10 * ODD_CHUNK + 7) as client:
            mine = shard_arrays(contract, full[handoff_id], Shard(rank, tp), pushing=True)
            try:
                client.push(contract.model, handoff_id, 3, mine, shard=(rank, tp))
            except (CallCancelled, HandoffGone, PushAborted):  # CallCancelled: the cancel cut its stream
                assert plan[handoff_id][1], handoff_id  # only a cancelled hand-off's push may fail

    def pull(handoff_id: str, rank: int, tp: int) -> None:
        with HandoffClient(tp_broker.address, timeout=20) as client:
            try:
                got = client.pull(contract.model, handoff_id, shard=(rank, tp), timeout=15)
            except (CallCancelled, HandoffGone, PushAborted):  # CallCancelled: the cancel cut its stream
                assert plan[handoff_id][1], handoff_id
                return
        with lock:
            delivered[handoff_id].append((rank, got))

    def cancel(handoff_id: str) -> None:
        with HandoffClient(tp_broker.address, timeout=20) as client:
            client.cancel(contract.model, handoff_id)

    tasks = sum(push_tp + pull_tp + cancelled for (push_tp, pull_tp), cancelled in plan.values())
    with futures.ThreadPoolExecutor(tasks) as pool:  # every rank its own thread: no pull queued before its push
        work = []
        for handoff_id, ((push_tp, pull_tp), cancelled) in plan.items():
            work += [pool.submit(pull, handoff_id, rank, pull_tp) for rank in range(pull_tp)]
            work += [pool.submit(push, handoff_id, rank, push_tp) for rank in range(push_tp)]
            if cancelled:
                work.append(pool.submit(cancel, handoff_id))
        for done in work:
            done.result(timeout=60)
    for handoff_id, ((_, pull_tp), cancelled) in plan.items():
        ranks = sorted(rank for rank, _ in delivered[handoff_id])
        if not cancelled:
            assert ranks == list(range(pull_tp)), handoff_id  # each decode rank exactly once
        if ranks == list(range(pull_tp)):  # a cancel that came too late changes nothing delivered
            parts = [got for _, got in sorted(delivered[handoff_id], key=lambda x: x[0])]
            assert_same_bits(join_shards(contract, parts, pull_tp).state, full[handoff_id])
        else:
            assert cancelled and len(set(ranks)) == len(ranks), handoff_id  # a cancelled one: never twice
    assert_holds_nothing(tp_broker)


@pytest.mark.parametrize("pulled_meanwhile", [False, True])  # True: the part is being cut as it arrives
def test_a_rank_whose_connection_breaks_resumes_its_own_part_and_sends_only_the_rest(tp_broker, pulled_meanwhile):
    contract = MODELS["qwen3-next"]
    full = seeded_tensors(contract)
    rank0 = shard_arrays(contract, full, Shard(0, 2), pushing=True)
    part_bytes = sum(a.nbytes for a in rank0.values())
    proxy = Proxy(tp_broker.port)
    with HandoffClient(tp_broker.address, timeout=20) as client:
        decoder = Decoder(client, contract, "req", 0, 1) if pulled_meanwhile else None
        client.push(contract.model, "req", 3, shard_arrays(contract, full, Shard(1, 2), pushing=True), shard=(1, 2))
        try:
            holds = broker_holds(tp_broker.address, contract.model, "req", part_bytes // 2 - (256 << 10), (0, 2))
            proxy.cut_after(part_bytes // 2, once=holds)  # rank 0's connection dies halfway through its part
            with HandoffClient(proxy.address, chunk_bytes=64 << 10, lanes=False) as through_proxy:
                result = through_proxy.push(contract.model, "req", 3, rank0, shard=(0, 2), resumable=True)
            assert proxy.connections == 2 and not result.duplicate
            assert proxy.carried[1] < part_bytes * 0.75  # the retry sent only what the broker did not hold
        finally:
            proxy.close()
        if decoder is not None:  # the decoder never noticed: its stream went on through the break and the resume
            assert decoder.done.wait(20)
            assert_same_bits(decoder.result.state, full)
        else:
            assert_same_bits(client.pull(contract.model, "req").state, full)
    assert_holds_nothing(tp_broker)


def test_a_hand_off_whose_last_rank_pushes_past_the_ttl_lives_its_ttl_from_the_last_commit(start_broker):
    """Defect 7 (issue "Nothing a client sends can wedge the broker"): each rank's TTL ran from its own commit, so
    the sweeper expired a hand-off while its last rank was still pushing, and that rank was told ALREADY_EXISTS.
    While every rank has begun, the committed ranks wait; the TTL runs from the last commit. (A rank that never
    begins still lets the others expire: test_a_rank_that_never_pushes_lets_the_others_expire_unclaimed.)"""
    broker = start_broker(contracts=MODELS, ttl=1.0)
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract)
    rank0 = shard_arrays(contract, full, Shard(0, 2), pushing=True)
    frames = chunk_frames(ShardContract.of(contract, Shard(0, 2), pushing=True), rank0, 4096)

    def slow_rank0():  # begins at once, commits 2 s later: past the ttl
        yield header_frame(contract, "req", 3, shard=(0, 2))
        for i, frame in enumerate(frames):
            if i % max(1, len(frames) // 8) == 0:
                time.sleep(0.25)
            yield frame

    with HandoffClient(broker.address, timeout=20) as client:
        client.push(contract.model, "req", 3, shard_arrays(contract, full, Shard(1, 2), pushing=True), shard=(1, 2))
        raw_push(broker.address, slow_rank0())
        assert_same_bits(client.pull(contract.model, "req").state, full)
    assert_holds_nothing(broker)


def test_a_hand_off_cut_for_another_tp_size_is_charged_once(start_broker):
    """Defect 15: a reshard was charged twice against --max-bytes until the last rank confirmed (TP 4 -> 2: 4 MiB
    resident for a 2 MiB hand-off): the pushed frames the cut had copied and freed stayed reserved."""
    broker = start_broker(contracts=MODELS)
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract)
    with HandoffClient(broker.address, timeout=20) as client:
        for rank in range(4):
            client.push(contract.model, "req", 3, shard_arrays(contract, full, Shard(rank, 4), pushing=True),
                        shard=(rank, 4))  # fmt: skip
        assert broker.store.stats().resident_bytes == contract.at(3).nbytes
        with open_channel(broker.address) as channel:
            next(iter(raw_pull(channel, contract.model, "req", shard=(0, 2))))  # the claim cuts it for 2 ranks
            assert broker.store.stats().resident_bytes == contract.at(3).nbytes  # not the pushed copy as well
        wait_until(lambda: broker.store.stats().claimed == 0)  # the broken stream's claim came back
        for rank in range(2):
            client.pull(contract.model, "req", shard=(rank, 2))
    assert_holds_nothing(broker)


def test_a_draining_broker_lets_the_other_ranks_of_a_push_under_way_finish_and_hands_it_over(start_broker):
    broker = start_broker(contracts=MODELS)
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract)
    with HandoffClient(broker.address, timeout=20) as client:
        push_rank(client, contract, "req", full, 0, 2)
        result: dict = {}
        stopping = threading.Thread(target=lambda: result.update(stats=broker.stop(grace=10)))
        stopping.start()
        wait_until(lambda: broker.store.stats().draining)
        error = raises_handoff_error(client.push, contract.model, "new", 3, full)
        assert error.reason == "DRAINING"  # new work goes elsewhere ...
        rank1 = shard_arrays(contract, full, Shard(1, 2), pushing=True)
        client.push(contract.model, "req", 3, rank1, shard=(1, 2))  # ... but a rank of a push under way is let in
        pulled = pull_all_ranks(client, contract, "req", 4)
        stopping.join(15)
    assert not stopping.is_alive()
    assert_same_bits(join_shards(contract, pulled, 4).state, full)
    stats = result["stats"]
    assert (stats.receiving, stats.ready, stats.claimed, stats.resident_bytes) == (0, 0, 0, 0)


class Decoder:
    """One decode rank pulling its part pipelined (`pull_tensors`) on a thread: what it got, and when."""

    def __init__(self, client: HandoffClient, contract: Contract, handoff_id: str, rank: int, tp: int) -> None:
        self.names: list[str] = []
        self.result: object = None
        self.claim = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(client, contract, handoff_id, rank, tp), daemon=True)
        self.thread.start()

    def _run(self, client: HandoffClient, contract: Contract, handoff_id: str, rank: int, tp: int) -> None:
        try:
            pulled = client.pull_tensors(contract.model, handoff_id, shard=(rank, tp), timeout=20)
            for carried, _ in pulled:
                self.names.append(carried.name)
            self.result, self.claim = pulled.handoff, pulled.claim
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.result = e
        finally:
            self.done.set()


def stalled_rank_push(target: str, contract: Contract, full: dict, rank: int, tp: int, go: threading.Event,
                      corrupt: bool = False, chunk_bytes: int = ODD_CHUNK) -> threading.Thread:  # fmt: skip
    """Rank `rank` pushes half its chunks, waits for `go`, then the rest (the first of them corrupted if asked)."""
    shard = Shard(rank, tp)
    view = ShardContract.of(contract, shard, pushing=True)
    frames = chunk_frames(view, shard_arrays(contract, full, shard, pushing=True), chunk_bytes=chunk_bytes)
    half = len(frames) // 2

    def stream():
        yield header_frame(contract, "req", position=3, shard=(rank, tp))
        yield from frames[:half]
        go.wait(20)
        rest = frames[half:]
        if corrupt:
            rest[0] = rest[0][:-1] + bytes([rest[0][-1] ^ 0xFF])  # the payload's last byte: the CRC no longer holds
        yield from rest

    def run():
        with contextlib.suppress(Exception):  # a corrupted push is meant to fail; the decoders say how
            raw_push(target, stream(), timeout=20)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def being_cut(
    client: HandoffClient, contract: Contract, full: dict, go: threading.Event, push_tp: int = 4, corrupt: bool = False
) -> tuple[list, threading.Thread]:
    """A TP `push_tp` -> 2 hand-off under way: every prefill rank but the last pushed, the last stalled half-way
    (until `go`; the rest corrupted if asked), and two decode ranks already holding what has streamed through or been
    cut so far. Its decoders and the last rank's stream."""
    decoders = [Decoder(client, contract, "req", rank, 2) for rank in range(2)]
    for rank in range(push_tp - 1):
        push_rank(client, contract, "req", full, rank, push_tp)
    stalled = stalled_rank_push(client.target, contract, full, push_tp - 1, push_tp, go, corrupt=corrupt)
    wait_until(lambda: all(d.names for d in decoders))
    return decoders, stalled


def test_at_equal_tp_sizes_each_decode_rank_streams_its_part_while_the_push_is_under_way(tp_broker):
    contract = MODELS["llama-3-8b"]  # 8 KV heads, every tensor split: at TP 2 each rank pulls what it pushes
    full = seeded_tensors(contract, seed=21)
    go = threading.Event()
    with HandoffClient(tp_broker.address, timeout=20, chunk_bytes=ODD_CHUNK) as client:
        decoders = [Decoder(client, contract, "req", rank, 2) for rank in range(2)]
        push_rank(client, contract, "req", full, 0, 2)
        pusher = stalled_rank_push(tp_broker.address, contract, full, 1, 2, go)

        # Rank 1's push is half done: both decoders already hold tensors, and neither stream has ended, because
        # the hand-off is not whole until rank 1 commits.
        wait_until(lambda: len(decoders[0].names) == len(contract.carried) and decoders[1].names)
        assert not any(d.done.is_set() for d in decoders)
        assert 0 < len(decoders[1].names) < len(contract.carried)
        stats = tp_broker.store.stats()
        assert (stats.receiving, stats.ready, stats.claimed) == (1, 0, 0)  # one hand-off, still being pushed
        go.set()
        pusher.join(20)
        for d in decoders:
            assert d.done.wait(20)

    for rank, d in enumerate(decoders):
        assert_same_bits(d.result.state, shard_arrays(contract, full, Shard(rank, 2), pushing=False))
    assert_holds_nothing(tp_broker)
    assert not tp_broker.registry.get_sample_value("handoff_resharded_bytes_total", {"model": contract.model})
    assert tp_broker.registry.get_sample_value("handoff_confirms_total", {"model": contract.model}) == 1
    tp_broker.store.confirm(contract.model, "req", decoders[1].claim, Shard(1, 2))  # a repeated confirm: still fine
    with pytest.raises(StaleClaim):
        tp_broker.store.confirm(contract.model, "req", decoders[1].claim + 1, Shard(1, 2))


@pytest.mark.parametrize("push_tp", [2, 4])  # streamed through; cut as pushed
def test_a_decode_rank_killed_while_receiving_a_push_under_way_leaves_its_part_for_the_next(tp_broker, push_tp):
    contract = LLAMA_1K  # 64 MiB a decode rank: more than the connection's buffers, so the stalled worker holds it
    full = seeded_tensors(contract, seed=24)
    go = threading.Event()
    with HandoffClient(tp_broker.address, timeout=20) as client:
        worker = subprocess.Popen(
            [sys.executable, str(WORKERS), "pull-and-stall", tp_broker.address, contract.model, "req", "1", "2"],
            stdout=subprocess.PIPE,
            text=True,
        )
        pusher = stalled_rank_push(tp_broker.address, contract, full, 0, push_tp, go, chunk_bytes=1 << 20)
        for rank in range(1, push_tp):
            push_rank(client, contract, "req", full, rank, push_tp)
        assert worker.stdout.readline().strip() == "stalled"  # it has chunks while rank 0 is still pushing
        assert tp_broker.store.stats().receiving == 1  # being pushed still
        worker.kill()
        worker.wait(timeout=10)
        broken = {"model": contract.model, "outcome": "broken"}
        wait_until(lambda: tp_broker.registry.get_sample_value("handoff_pulls_total", broken) == 1)  # claim back
        go.set()
        pusher.join(20)
        pulled = pull_all_ranks(client, contract, "req", 2)
    assert_same_bits(join_shards(contract, pulled, 2).state, full)
    assert_holds_nothing(tp_broker)


@pytest.mark.parametrize("push_tp", [2, 4])  # streamed through; cut as pushed
def test_a_rank_failing_while_decode_ranks_receive_aborts_every_decode_rank(tp_broker, push_tp):
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract, seed=22)
    go = threading.Event()
    with HandoffClient(tp_broker.address, timeout=20, chunk_bytes=ODD_CHUNK) as client:
        decoders, pusher = being_cut(client, contract, full, go, push_tp, corrupt=True)
        go.set()
        pusher.join(20)
        for d in decoders:
            assert d.done.wait(20)
    assert all(isinstance(d.result, PushAborted) for d in decoders), [d.result for d in decoders]
    assert_holds_nothing(tp_broker)


def finished_tensors(contract: Contract, full: dict, rank: int, tp: int) -> set[str]:
    """The tensors every pushing rank holding them has sent whole, once every rank but `rank` has pushed and `rank`
    has sent the first half of its frames (`stalled_rank_push`)."""
    shard = Shard(rank, tp)
    view = ShardContract.of(contract, shard, pushing=True)
    frames = chunk_frames(view, shard_arrays(contract, full, shard, pushing=True), chunk_bytes=ODD_CHUNK)
    sent: Counter[str] = Counter()
    for frame in frames[: len(frames) // 2]:
        chunk = decode_chunk(frame)
        sent[chunk.tensor] += len(chunk.data)
    return {c.name for c in contract.carried} - {c.name for c in view.carried if sent[c.name] < c.nbytes}


CUT_AS_PUSHED = [
    ("llama-3-8b", 1, 2),  # a whole push, pulled by two decode ranks
    ("llama-3-8b", 4, 2),  # each decode rank's heads come from two prefill ranks
    ("llama-3-8b", 2, 4),  # each from part of one
    ("qwen3-next", 4, 2),  # gated-delta conv rings and memories cut by head as the caches are
    ("qwen2-7b", 8, 8),  # KV heads replicated: the last rank pushes nothing but its header
]


@pytest.mark.parametrize("name,push_tp,pull_tp", CUT_AS_PUSHED)
def test_where_ranks_pull_other_heads_than_they_push_each_tensor_is_cut_as_soon_as_every_rank_has_sent_it(
    tp_broker, name, push_tp, pull_tp
):
    contract = MODELS[name]
    full = seeded_tensors(contract, seed=23)
    go = threading.Event()
    last = push_tp - 1
    with HandoffClient(tp_broker.address, timeout=20, chunk_bytes=ODD_CHUNK) as client:
        decoders = [Decoder(client, contract, "req", rank, pull_tp) for rank in range(pull_tp)]
        for rank in range(last):
            push_rank(client, contract, "req", full, rank, push_tp)
        pusher = stalled_rank_push(tp_broker.address, contract, full, last, push_tp, go)

        # The last prefill rank has sent half its frames: each decode rank holds exactly its tensors that every
        # prefill rank has sent whole, and no stream ends, because the hand-off is not whole until that rank commits.
        finished = finished_tensors(contract, full, last, push_tp)
        views = [ShardContract.of(contract, Shard(rank, pull_tp), pushing=False) for rank in range(pull_tp)]
        expected = [sorted(c.name for c in view.carried if c.name in finished) for view in views]
        assert any(expected)  # some tensors can go before the last rank is done
        wait_until(lambda: [len(d.names) for d in decoders] == [len(e) for e in expected])
        time.sleep(0.3)  # nothing more comes
        assert [sorted(d.names) for d in decoders] == expected
        assert not any(d.done.is_set() for d in decoders)
        assert tp_broker.store.stats().receiving == 1
        go.set()
        pusher.join(20)
        for d in decoders:
            assert d.done.wait(20)
    for rank, d in enumerate(decoders):
        assert_same_bits(d.result.state, shard_arrays(contract, full, Shard(rank, pull_tp), pushing=False))
    assert_holds_nothing(tp_broker)
    moved = tp_broker.registry.get_sample_value("handoff_resharded_bytes_total", {"model": contract.model})
    assert (moved > 0) == heads_move(contract, push_tp, pull_tp)


@pytest.mark.parametrize("push_tp", [4, 1])  # a rank of a sharded push; a whole push
def test_a_rank_pushed_again_while_its_part_is_being_cut_starts_the_hand_off_over(tp_broker, push_tp):
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract, seed=25)
    go = threading.Event()
    last = push_tp - 1
    with HandoffClient(tp_broker.address, timeout=20, chunk_bytes=ODD_CHUNK) as client:
        decoders, stalled = being_cut(client, contract, full, go, push_tp)
        with pytest.raises(ShardMismatch):  # the decode TP size is fixed by the first pull, cut or not yet
            client.pull(contract.model, "req", timeout=2)
        # The last rank pushes again, whole, while the frames of its first stream are being cut.
        push_rank(client, contract, "req", full, last, push_tp)
        for d in decoders:
            assert d.done.wait(20)
        assert all(isinstance(d.result, PushAborted) for d in decoders), [d.result for d in decoders]
        go.set()
        stalled.join(20)  # the first stream of the last rank is told it was replaced
        for rank in range(last):  # every other rank pushes again, as PushAborted told the engine
            push_rank(client, contract, "req", full, rank, push_tp)
        pulled = pull_all_ranks(client, contract, "req", 2)
    assert_same_bits(join_shards(contract, pulled, 2).state, full)
    assert_holds_nothing(tp_broker)


def test_a_hand_off_cancelled_while_being_cut_frees_every_part(tp_broker):
    contract = MODELS["llama-3-8b"]
    full = seeded_tensors(contract, seed=26)
    go = threading.Event()
    with HandoffClient(tp_broker.address, timeout=20, chunk_bytes=ODD_CHUNK) as client:
        decoders, stalled = being_cut(client, contract, full, go)
        assert client.cancel(contract.model, "req")
        for d in decoders:
            assert d.done.wait(20)
        # (CallCancelled: the cancel cut a stream the broker was writing to, before it could say why)
        results = [d.result for d in decoders]
        assert all(isinstance(r, (HandoffCancelled, CallCancelled)) for r in results), results
        go.set()
        stalled.join(20)
        assert_holds_nothing(tp_broker)
        with pytest.raises(HandoffGone, match="cancelled"):  # and it stays cancelled for a late rank
            push_rank(client, contract, "req", full, 3, 4)
