"""A vLLM instance in a process of its own, for the vLLM tests: `python tests/vllm_roles.py ROLE MODEL_DIR
SETTINGS.json` runs the prompts in the settings file through an offline LLM and prints one JSON line: each prompt's
output tokens, cached tokens and kv_transfer_params. ROLE: plain (no connector), producer, consumer or both
(kv_both). A producer asks for every prompt's hand-off (`"do_remote_decode": true`, as a router does) unless the
settings give each prompt's kv_transfer_params (null: a plain request).

With `"session": true` in the settings it prints `{"ready": ...}` once started and then takes one JSON command a
line on stdin, answering each with one JSON line, so that a test can drive several engines in turn without paying
their start-up again: {"op": "generate", "prompts": [...], "params": [...], "max_tokens": n} (params: each prompt's
kv_transfer_params or null), {"op": "release"} (steps until no finished request holds pages: {"blocks_held": n}),
{"op": "flush", "timeout": s} (waits for the pushes under way to end, tp 1 only: {"flushed": bool}),
{"op": "reset_prefix_cache"} (vLLM's prefix cache emptied, so that prompts run before give no local hits:
{"reset": true}), {"op": "corrupt", "on": bool} (the negative control's switch below, for the requests after it:
{"corrupt": on}), {"op": "trace", "on": bool} (the order of the worker's hooks and the forward: `trace`),
{"op": "writers", "on": bool} (the threads vLLM's CPU cache writer runs on: `writers`), {"op": "exit"}. tests/vllm_driver.py starts these processes and drives them. Settings: prompts,
block_size, max_tokens, kv_transfer_params, kv_cache_bytes, extra (the connector's kv_connector_extra_config), and
optionally dtype (bfloat16), tp (1: over vLLM's `mp` executor when more), max_model_len (1024), prefix_caching
(false), max_num_seqs (vLLM's default), cpu (the CPU features vLLM's platform decides by, driven: tests/vllm_cpu.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROLES = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}


def start(role: str, model_dir: str, settings: dict, engine: dict):
    """The role's offline LLM: eager, the settings' `tp` (the uni executor at 1, vLLM's `mp` one above), their
    kv_cache_bytes, and the connector with their `extra` (none for plain). `engine`: the LLM's other arguments (this
    script's: `engine_arguments`; a script that wraps this one has its own: vllm_hybrid_roles.py, vllm_mla_roles.py)."""
    from vllm import LLM

    if settings.get("cpu"):  # vLLM's platform decisions made as on a CPU with these features (tests/vllm_cpu.py)
        from vllm_cpu import deciding_as

        deciding_as(settings["cpu"])
    kv_transfer = None
    if role != "plain":
        extra = dict(settings["extra"])
        if extra.pop("corrupt-pulled-kv", False):  # a test's switch, never one of the connector's settings
            corrupt_pulled_keys()
        kv_transfer = {
            "kv_connector": "HandoffConnector",
            "kv_connector_module_path": "handoff_client.vllm",
            "kv_role": ROLES[role],
            "kv_connector_extra_config": extra,
            "kv_load_failure_policy": "recompute",
        }
    tp = settings.get("tp", 1)
    return LLM(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True,
        distributed_executor_backend="uni" if tp == 1 else "mp", tensor_parallel_size=tp,
        kv_cache_memory_bytes=settings["kv_cache_bytes"], kv_transfer_config=kv_transfer,
        **engine,
    )  # fmt: skip


def engine_arguments(settings: dict) -> dict:
    """This script's LLM arguments beside `start`'s: 64 blocks, the settings' block_size, max_model_len (1024), dtype
    (bfloat16), prefix_caching (false) and max_num_seqs (vLLM's default)."""
    scheduling = {"max_num_seqs": settings["max_num_seqs"]} if "max_num_seqs" in settings else {}
    return dict(
        num_gpu_blocks_override=64, block_size=settings["block_size"],
        max_model_len=settings.get("max_model_len", 1024), dtype=settings.get("dtype", "bfloat16"),
        enable_prefix_caching=settings.get("prefix_caching", False), **scheduling,
    )  # fmt: skip


CORRUPTING = [False]  # whether the wrapper below reverses what it writes (the session's "corrupt" command)


def corrupt_pulled_keys(on: bool = True) -> None:
    """The negative control of test_vllm.py: the connector writes every pulled key with its rows reversed, so a
    decode that really reads the pulled KV gives other tokens. Installed in this process, where vLLM's worker runs
    (VLLM_ENABLE_V1_MULTIPROCESSING=0 and the uni executor), by wrapping the worker half's one write of a layer
    (once); `on` False leaves the wrapper writing what arrived, unchanged."""
    from handoff_client.vllm._worker import WorkerHalf

    CORRUPTING[0] = on
    if getattr(WorkerHalf._write_layer, "corrupting", False):
        return
    write = WorkerHalf._write_layer

    def write_reversed_keys(self, load, layer_name: str, arrived: dict) -> None:
        key_name, _ = self.tensors[layer_name]
        if CORRUPTING[0] and key_name in arrived:
            keys = arrived[key_name].copy()
            keys[load.first : load.rows] = keys[load.first : load.rows][::-1]
            arrived = {**arrived, key_name: keys}
        write(self, load, layer_name, arrived)

    write_reversed_keys.corrupting = True
    WorkerHalf._write_layer = write_reversed_keys


TRACE: list[str] = []  # what the "trace" command records: the worker's hooks and the model's forward, in call order
TRACING = [False]  # whether it records now


def trace(llm, on: bool) -> dict:
    """The session's "trace" command: with `on`, record from now the order in which vLLM's step calls the worker
    half's `wait_for_copies` and `start_load_kv` and the model's forward (installed once, in this process, where
    vLLM's worker runs: the uni executor); off, stop and answer what was recorded: {"trace": [...]}."""
    from handoff_client.vllm._worker import WorkerHalf

    if not getattr(WorkerHalf.start_load_kv, "traced", False):
        for name in ("wait_for_copies", "start_load_kv"):
            hook = getattr(WorkerHalf, name)

            def traced(self, *args, _hook=hook, _name=name, **kwargs):
                if TRACING[0]:
                    TRACE.append(_name)
                return _hook(self, *args, **kwargs)

            traced.traced = True
            setattr(WorkerHalf, name, traced)
        llm.apply_model(lambda model: model.register_forward_pre_hook(
            lambda *_: TRACE.append("forward") if TRACING[0] else None))  # fmt: skip
    TRACING[0] = on
    recorded = list(TRACE)
    TRACE.clear()
    return {"trace": recorded}


WRITERS: set[str] = set()  # what the "writers" command records: the threads CPU_ATTN's cache writer ran on
WRITING = [False]  # whether it records now


def writers(on: bool) -> dict:
    """The session's "writers" command: with `on`, record from now the name of each thread on which vLLM's CPU cache
    writer (CPU_ATTN's `do_kv_cache_update`, the forward's and the connector's loads') runs, in this process, where
    vLLM's worker runs (the uni executor); off, stop and answer them: {"writers": [...]}."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl

    if not getattr(Impl.do_kv_cache_update, "recorded", False):
        update = Impl.do_kv_cache_update

        def recorded(self, *args, **kwargs):
            if WRITING[0]:
                WRITERS.add(threading.current_thread().name)
            return update(self, *args, **kwargs)

        recorded.recorded = True
        Impl.do_kv_cache_update = recorded
    WRITING[0] = on
    seen = sorted(WRITERS)
    WRITERS.clear()
    return {"writers": seen}


def generate(llm, prompts: list[list[int]], transfers: list[dict | None], max_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = []
    for transfer in transfers:
        extra = {"kv_transfer_params": dict(transfer)} if transfer else None
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False,
                                     extra_args=extra))  # fmt: skip
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "cached": [o.num_cached_tokens for o in outputs],
        "kv_transfer_params": [o.kv_transfer_params for o in outputs],
        "generate_seconds": time.perf_counter() - started,
    }


def main(role: str, model_dir: str, settings_file: str, engine: Callable[[dict], dict] = engine_arguments,
         more: Mapping[str, Callable[[dict], dict]] | None = None) -> None:  # fmt: skip
    """The instance run, one shot or as a session (module docstring). A script that wraps this one passes `engine`,
    its LLM arguments for the settings (`start`), and `more`, the session commands it adds (`session`)."""
    settings = json.loads(Path(settings_file).read_text())
    started = time.perf_counter()
    llm = start(role, model_dir, settings, engine(settings))
    start_seconds = time.perf_counter() - started
    if settings.get("session"):
        return session(llm, start_seconds, more)
    prompts = settings["prompts"]
    transfers = settings.get("kv_transfer_params")
    if transfers is None:
        transfers = [{"do_remote_decode": True} if role == "producer" else None for _ in prompts]
    report = generate(llm, prompts, transfers, 1 if role == "producer" else settings["max_tokens"])
    report["start_seconds"] = start_seconds
    if role == "producer":
        if settings.get("tp", 1) == 1:  # the worker's connector lives in this process only with the uni executor
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            assert get_kv_transfer_group().flush(60), "pushes still under way after 60 s"
        report["blocks_held"] = blocks_held_after_release(llm)
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown


def session(llm, start_seconds: float, more: Mapping[str, Callable[[dict], dict]] | None = None) -> None:
    """The session's loop (module docstring); `more`: the commands a script that wraps this one adds, by op, each
    answering a command with its JSON answer (vllm_mla_roles.py's latents)."""
    print(json.dumps({"ready": True, "start_seconds": start_seconds}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] in (more or {}):
            answer = more[command["op"]](command)
        elif command["op"] == "generate":
            transfers = command.get("params") or [None] * len(command["prompts"])
            answer = generate(llm, command["prompts"], transfers, command["max_tokens"])
        elif command["op"] == "release":
            answer = {"blocks_held": blocks_held_after_release(llm)}
        elif command["op"] == "flush":  # (the worker's connector lives in this process: the uni executor)
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            answer = {"flushed": get_kv_transfer_group().flush(command.get("timeout", 60))}
        elif command["op"] == "reset_prefix_cache":
            answer = {"reset": llm.reset_prefix_cache()}
        elif command["op"] == "trace":
            answer = trace(llm, command["on"])
        elif command["op"] == "writers":
            answer = writers(command["on"])
        elif command["op"] == "corrupt":
            corrupt_pulled_keys(command["on"])
            answer = {"corrupt": command["on"]}
        else:
            break
        print(json.dumps(answer), flush=True)
    os._exit(0)


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
