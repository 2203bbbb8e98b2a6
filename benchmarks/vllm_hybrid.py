"""The vLLM connector with a hybrid model (`python benchmarks/vllm_engines.py --hybrid`): for the same prompt, the
decode instance's first token through the broker against recomputing the prompt, and the bytes of each hand-off,
at 1k and 8k prompt tokens (`--quick`: 257 and 1,025).

The model is the tests' tiny random-weight Qwen3-Next (tests/tiny_hybrids.py: 3 gated-delta-net layers, 1
attention layer of 2 KV heads of 64, bf16, 512 B of KV a token; each gated-delta-net layer's conv ring and memory
in bf16, as vLLM's CPU build resolves them). The last-token rule holds: the producer hands off N - 1 of a prompt's
N tokens, and the decoder computes the last one. Each engine is a process of its own (offline `LLM`, one request
at a time, prefix caching off):

    prefill   handoff (kv_producer): the prompt with max_tokens 1, its hand-off asked for and pushed
    decode    the same prompt, max_tokens 1: recompute (no connector: prefills it whole) | handoff (kv_consumer:
              pulls N - 1 tokens' attention rows and the state, computes the last token)

Medians over the prompts. Bytes per hand-off are the contract's at the hand-off's position (what the broker takes
in, less framing): the attention rows of N - 1 tokens and the state, whose size does not depend on N.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = "bench-qwen3-next"
LENGTHS = (1025, 8193)
QUICK_LENGTHS = (257, 1025)


def engine(role: str, model_dir: str, settings_file: str) -> None:
    """One engine (a subprocess): runs each prompt alone, max_tokens 1, and prints each one's seconds as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = json.loads(Path(settings_file).read_text())
    transfer = None
    if role != "recompute":
        transfer = {"kv_connector": "HandoffConnector", "kv_connector_module_path": "handoff_client.vllm",
                    "kv_role": role, "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"target": settings["target"], "model": MODEL}}  # fmt: skip
    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, distributed_executor_backend="uni",
              max_model_len=settings["max_model_len"], dtype="bfloat16", kv_cache_memory_bytes=1 << 30,
              kv_transfer_config=transfer, enable_prefix_caching=False, max_num_seqs=1)  # fmt: skip
    warm = [TokensPrompt(prompt_token_ids=[(7 * i) % 500 + 1 for i in range(64)])]
    llm.generate(warm, SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    seconds, cached, params_out = [], [], []
    for prompt, given in zip(settings["prompts"], settings["params"]):
        if role == "kv_producer":
            given = {"do_remote_decode": True, "do_remote_prefill": False}
        extra = {"kv_transfer_params": given} if given else None
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False, extra_args=extra)
        started = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - started)
        cached.append(output.num_cached_tokens)
        if role == "kv_producer":
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            params_out.append({k: v for k, v in output.kv_transfer_params.items()
                               if k != "remote_prefill_cached_tokens"})  # fmt: skip
            assert get_kv_transfer_group().flush(120)  # one request at a time: its push ends before the next
    print(json.dumps({"seconds": seconds, "cached": cached, "params": params_out}), flush=True)
    os._exit(0)  # skip vLLM's slow teardown


def _run(role: str, model_dir: Path, workdir: Path, **settings) -> dict:
    file = workdir / f"hybrid-{role}-{time.monotonic_ns()}.json"
    file.write_text(json.dumps(settings))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(workdir / "vllm-cache")}
    done = subprocess.run([sys.executable, __file__, "_engine", role, str(model_dir), str(file)], env=env,
                          check=False, capture_output=True, text=True, timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the hybrid {role} engine failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(workdir: Path, quick: bool, count: int) -> dict:
    """Build the model, start a broker serving its contract, run the three engines; the figures by prompt length."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from handoff_client import Contract
    from tiny_hybrids import build_tiny_hybrid

    lengths = QUICK_LENGTHS if quick else LENGTHS
    ctx = max(lengths) + 64
    model_dir = build_tiny_hybrid("qwen3_next", workdir / "qwen3-next")
    manifests = workdir / "manifests"
    manifests.mkdir()
    cli = [sys.executable, "-m", "handoff_broker"]
    subprocess.run([*cli, "contract-from-config", str(model_dir), "--model", MODEL, "--ctx", str(ctx), "--state-dtype",
                    "bfloat16", "-o", str(manifests / f"{MODEL}.json")], check=True)  # fmt: skip
    contract = Contract.load(manifests / f"{MODEL}.json")
    prompts = [[(i * (13 + p) + p) % 500 + 3 for i in range(n)] for n in lengths for p in range(count)]
    broker = subprocess.Popen([*cli, "serve", "--host", "127.0.0.1", "--port", "0", "--contracts", str(manifests),
                               "--metrics-port", "-1", "--max-bytes", str(1 << 30)], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        target = broker.stdout.readline().split("listening on ")[1].split(";")[0]
        common = {"prompts": prompts, "target": target, "max_model_len": ctx}
        produced = _run("kv_producer", model_dir, workdir, params=[None] * len(prompts), **common)
        handoff = _run("kv_consumer", model_dir, workdir, params=produced["params"], **common)
        recompute = _run("recompute", model_dir, workdir, params=[None] * len(prompts), **common)
    finally:
        broker.terminate()
        broker.wait(timeout=20)
    assert handoff["cached"] == [len(p) - 1 for p in prompts], handoff["cached"]  # N - 1 tokens came through
    state = sum(c.nbytes for c in contract.carried if not c.rows_are_positions)
    figures = {"state_bytes": state}
    for n in lengths:
        mine = [i for i, p in enumerate(prompts) if len(p) == n]
        position = produced["params"][mine[0]]["position"]
        figures[str(n)] = {"position": position, "bytes": contract.at(position).nbytes,
                           "recompute_ms": _median_ms(recompute, mine), "handoff_ms": _median_ms(handoff, mine)}  # fmt: skip
    return figures


def _median_ms(report: dict, indices: list[int]) -> float:
    return 1000 * statistics.median(report["seconds"][i] for i in indices)


def report(figures: dict, count: int) -> None:
    state = figures["state_bytes"]
    print(f"hybrid (tiny Qwen3-Next, 3 gated-delta-net + 1 attention layer, bf16), {count} prompts a length; "
          "decode's first token, medians")  # fmt: skip
    for n, row in figures.items():
        if n == "state_bytes":
            continue
        print(f"  {n:>5} tokens  recompute {row['recompute_ms']:8.1f} ms   handoff {row['handoff_ms']:8.1f} ms "
              f"({row['handoff_ms'] / row['recompute_ms']:.2f}x)   {row['bytes']:,} B a hand-off at position "
              f"{row['position']}, of it state {state:,} B ({state / row['bytes']:.0%})")  # fmt: skip


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "_engine":
    engine(*sys.argv[2:5])
