"""A vLLM instance in a process of its own, for tests/test_vllm.py: `python tests/vllm_roles.py ROLE MODEL_DIR
SETTINGS.json` runs the prompts in the settings file through an offline LLM and prints one JSON line: each prompt's
output tokens, cached tokens and kv_transfer_params. ROLE: plain (no connector), producer or consumer."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(role: str, model_dir: str, settings_file: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = json.loads(Path(settings_file).read_text())
    kv_transfer = None
    if role != "plain":
        extra = dict(settings["extra"])
        if extra.pop("corrupt-pulled-kv", False):  # a test's switch, never one of the connector's settings
            corrupt_pulled_keys()
        kv_transfer = {
            "kv_connector": "HandoffConnector",
            "kv_connector_module_path": "handoff_client.vllm",
            "kv_role": "kv_producer" if role == "producer" else "kv_consumer",
            "kv_connector_extra_config": extra,
            "kv_load_failure_policy": "recompute",
        }
    started = time.perf_counter()
    llm = LLM(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True, distributed_executor_backend="uni",
        num_gpu_blocks_override=64, block_size=settings["block_size"], max_model_len=settings.get("max_model_len", 1024),
        dtype="bfloat16", kv_cache_memory_bytes=settings["kv_cache_bytes"], kv_transfer_config=kv_transfer,
        enable_prefix_caching=False,
    )  # fmt: skip
    ready = time.perf_counter()
    prompts = [TokensPrompt(prompt_token_ids=p) for p in settings["prompts"]]
    params = []
    for transfer in settings.get("kv_transfer_params") or [None] * len(prompts):
        extra = {"kv_transfer_params": transfer} if transfer else None
        tokens = 1 if role == "producer" else settings["max_tokens"]
        params.append(SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False,
                                     extra_args=extra))  # fmt: skip
    outputs = llm.generate(prompts, params, use_tqdm=False)
    done = time.perf_counter()
    report = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "cached": [o.num_cached_tokens for o in outputs],
        "kv_transfer_params": [o.kv_transfer_params for o in outputs],
        "start_seconds": ready - started,
        "generate_seconds": done - ready,
    }
    if role == "producer":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        assert get_kv_transfer_group().flush(60), "pushes still under way after 60 s"
        report["blocks_held"] = blocks_held_after_release(llm)
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown


def corrupt_pulled_keys() -> None:
    """The negative control of test_vllm.py: the connector writes every pulled key with its rows reversed, so a
    decode that really reads the pulled KV gives other tokens. Installed in this process, where vLLM's worker runs
    (VLLM_ENABLE_V1_MULTIPROCESSING=0 and the uni executor), by wrapping the worker half's one write of a layer."""
    from handoff_client.vllm._worker import WorkerHalf

    write = WorkerHalf._write_layer

    def write_reversed_keys(self, load, layer_name: str, arrived: dict) -> None:
        key_name, _ = self.tensors[layer_name]
        if key_name in arrived:
            keys = arrived[key_name].copy()
            keys[load.first : load.rows] = keys[load.first : load.rows][::-1]
            arrived = {**arrived, key_name: keys}
        write(self, load, layer_name, arrived)

    WorkerHalf._write_layer = write_reversed_keys


def blocks_held_after_release(llm) -> int:
    """The KV blocks still allocated once the engine has stepped until it holds no finished request's pages."""
    core = llm.llm_engine.engine_core.engine_core  # in process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    deadline = time.monotonic() + 30
    while core.scheduler.has_finished_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
    pool = core.scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # (one block is vLLM's null block)


if __name__ == "__main__":
    main(*sys.argv[1:4])
