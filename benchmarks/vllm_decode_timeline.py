"""Where the decode instance's first token spends its time, through the broker against vLLM's ExampleConnector, in
one run: the engines and the model of vllm_engines.py, with probes on the decode engines' steps and on each
connector's load.

    python benchmarks/vllm_decode_timeline.py                 # 6 prompts of 1,026 tokens, the small Llama
    python benchmarks/vllm_decode_timeline.py --quick         # 2 prompts of 258 tokens, the tiny Llama
    python benchmarks/vllm_decode_timeline.py --py-spy PREFIX # also sample both decode engines with py-spy during
                                                              # their prompts (raw stacks to PREFIX-handoff.txt, ...)

Two prefill engines (vllm_engines.py's own: the handoff producer, ExampleConnector writing its files) prepare the
prompts; then each decode engine runs them one at a time with its probes, which append one JSON line per event to a
file (a `time.perf_counter()` of the engine's process):
    generate        LLM.generate's start and end: the first token's whole time
    step            every engine step: how many ran, and which one computed (the model's forward, with its tokens)
    load            handoff: start_load_kv handing the pull to a thread; the pull's start and end, the time its
                    thread spent waiting for tensors from the broker (network, checks), the time spent writing
                    them into the pages (scatter: on the pull's thread, or on writer threads beside it, so the two
                    may overlap within the pull's whole); get_finished reporting it. ExampleConnector: its start_load_kv (reading the
                    files and writing them into the pages, inside the step's forward)
The summary splits each connector's first token into phases, medians over the prompts, each as ms per 1k prompt
tokens and as a multiple of ExampleConnector's whole first token (the baseline); a third decode engine without a
connector (recompute: the whole prompt prefilled again) is timed the same way. Needs vLLM's CPU build.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import vllm_engines
from vllm_engines import MODEL, SMALL, TINY, build_model

EVENTS = "TIMELINE_EVENTS"  # the environment variable naming the events file of a probed engine
PY_SPY = "TIMELINE_PY_SPY"  # ... and, optionally, "py-spy binary|output file" for the handoff decode engine


def mark(kind: str, **fields: object) -> None:
    """Append one event (its time, its kind, its fields) to the events file."""
    with open(os.environ[EVENTS], "a") as out:
        out.write(json.dumps({"t": time.perf_counter(), "kind": kind, **fields}) + "\n")


def install_probes(prompts: int) -> None:
    """Wrap LLM.generate, EngineCore.step and each connector's load path to mark their events (in this process)."""
    import vllm
    from handoff_client import HandoffClient
    from handoff_client.vllm._worker import WorkerHalf
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    calls = {"generate": 0, "steps": 0, "tokens": 0}
    local = threading.local()
    spy: dict[str, subprocess.Popen] = {}

    generate = vllm.LLM.generate

    def probed_generate(self, *args, **kwargs):
        index = calls["generate"]
        calls["generate"] += 1
        if index == 1 and os.environ.get(PY_SPY):  # after the warm-up: sample the prompts, not the start-up
            binary, output = os.environ[PY_SPY].split("|")
            spy["process"] = subprocess.Popen([binary, "record", "--pid", str(os.getpid()), "--rate", "250",
                                               "--format", "raw", "--threads", "--output", output])  # fmt: skip
            time.sleep(1.0)  # attached before the first prompt
        mark("generate", phase="begin", index=index, steps=calls["steps"])
        out = generate(self, *args, **kwargs)
        mark("generate", phase="end", index=index, steps=calls["steps"])
        if index == prompts and "process" in spy:
            spy["process"].send_signal(signal.SIGINT)
            spy["process"].wait(timeout=30)
        return out

    vllm.LLM.generate = probed_generate

    schedule = Scheduler.schedule

    def probed_schedule(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        calls["tokens"] = out.total_num_scheduled_tokens
        return out

    Scheduler.schedule = probed_schedule

    def probed(step):  # EngineCore.step or .step_with_batch_queue, whichever the engine runs
        def probed_step(self):
            calls["steps"] += 1
            started = time.perf_counter()
            outputs, executed = step(self)
            if executed:
                mark("forward", begin=started, steps=calls["steps"], tokens=calls["tokens"])
            return outputs, executed

        return probed_step

    EngineCore.step = probed(EngineCore.step)
    EngineCore.step_with_batch_queue = probed(EngineCore.step_with_batch_queue)

    start_load = WorkerHalf.start_load_kv

    def probed_start_load(self, metadata):
        if metadata.loads:
            mark("load_start", requests=[load.request_id for load in metadata.loads], steps=calls["steps"])
        return start_load(self, metadata)

    WorkerHalf.start_load_kv = probed_start_load

    pull = WorkerHalf._pull
    written: dict[str, float] = {}  # request -> seconds its layers' writes into the pages took (any thread)
    written_lock = threading.Lock()

    def probed_pull(self, load):
        local.waiting, local.first = 0.0, None
        began = time.perf_counter()
        pull(self, load)
        with written_lock:
            scatter = written.pop(load.request_id, 0.0)
        mark("pull", begin=began, first=local.first, waiting=local.waiting, scatter=scatter, steps=calls["steps"])

    WorkerHalf._pull = probed_pull

    write = WorkerHalf._write_layer

    def probed_write(self, load, *args):  # on the pull's thread, or on a writer thread of its own
        started = time.perf_counter()
        write(self, load, *args)
        with written_lock:
            written[load.request_id] = written.get(load.request_id, 0.0) + time.perf_counter() - started

    WorkerHalf._write_layer = probed_write

    pull_tensors = HandoffClient.pull_tensors

    class ProbedPull:
        """The pull as the worker takes it (its attributes, `position` included), its iteration timed."""

        def __init__(self, pulled) -> None:
            self.pulled = pulled

        def __getattr__(self, name: str):
            return getattr(self.pulled, name)

        def __iter__(self):
            tensors = iter(self.pulled)
            while True:
                asked = time.perf_counter()
                try:
                    item = next(tensors)
                except StopIteration:
                    local.waiting += time.perf_counter() - asked  # (the confirm)
                    return
                local.waiting += time.perf_counter() - asked
                local.first = local.first or time.perf_counter()
                yield item

    def probed_pull_tensors(self, *args, **kwargs):
        return ProbedPull(pull_tensors(self, *args, **kwargs))

    HandoffClient.pull_tensors = probed_pull_tensors

    get_finished = WorkerHalf.get_finished

    def probed_get_finished(self, finished, *args):
        released, received = get_finished(self, finished, *args)
        if received:
            mark("reported", steps=calls["steps"])
        return released, received

    WorkerHalf.get_finished = probed_get_finished

    example_load = ExampleConnector.start_load_kv

    def probed_example_load(self, *args, **kwargs):
        started = time.perf_counter()
        example_load(self, *args, **kwargs)
        mark("example_load", begin=started)

    ExampleConnector.start_load_kv = probed_example_load


def probed_engine(role: str, model_dir: str, settings_file: str) -> None:
    """vllm_engines.py's engine with the probes installed first."""
    install_probes(len(json.loads(Path(settings_file).read_text())["prompts"]))
    vllm_engines.engine(role, model_dir, settings_file)


def run_probed(role: str, model_dir: Path, workdir: Path, py_spy: str | None = None, **settings) -> list[dict]:
    """A decode engine with probes: its events, prompt by prompt (the warm-up's left out)."""
    file, events = workdir / f"{role}-{time.monotonic_ns()}.json", workdir / f"{role}.events"
    file.write_text(json.dumps(settings))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
           EVENTS: str(events), **({PY_SPY: py_spy} if py_spy else {})}  # fmt: skip
    done = subprocess.run([sys.executable, __file__, "_engine", role, str(model_dir), str(file)], env=env, check=False,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the {role} engine failed:\n{done.stderr[-4000:]}")
    cached = json.loads(done.stdout.strip().splitlines()[-1])["cached"]
    if role != "none" and not all(cached):
        raise SystemExit(f"the {role} engine loaded nothing for some prompts (tokens loaded: {cached})")
    prompts: list[list[dict]] = []
    for line in events.read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == "generate" and event["phase"] == "begin":
            prompts.append([])
        prompts[-1].append(event)
    return prompts[1:]


def phases(events: list[dict]) -> dict[str, float]:
    """One prompt's first token split into phases, in seconds (each phase ends where the next begins)."""
    at = {e["kind"] if e["kind"] != "generate" else f"generate_{e['phase']}": e for e in events}
    begin, end = at["generate_begin"]["t"], at["generate_end"]["t"]
    forward = [e for e in events if e["kind"] == "forward"][-1]
    split = {"total": end - begin, "forward": forward["t"] - forward["begin"], "after": end - forward["t"],
             "forward_tokens": forward["tokens"]}  # fmt: skip
    if "example_load" in at:  # inside the forward's step: reading the files and writing the pages
        load = at["example_load"]
        split |= {"to_forward": forward["begin"] - begin, "load": load["t"] - load["begin"]}
        split["forward"] -= split["load"]
        return split
    if "load_start" not in at:  # recompute: the forward is the whole prompt's prefill
        split["to_forward"] = forward["begin"] - begin
        return split
    load, pull, reported = at["load_start"], at["pull"], at["reported"]
    split |= {
        "to_load": load["t"] - begin,  # the request scheduled, its blocks allocated, the load's step begun
        "to_pull": pull["begin"] - load["t"],  # the pull's thread starting
        "pull": pull["t"] - pull["begin"],  # the pull's whole: these two, where they do not overlap, and the rest
        "waiting": pull["waiting"],  # the pull's thread waiting for tensors (network, broker, checks, confirm)
        "scatter": pull["scatter"],  # writing them into the pages (on the pull's thread, or beside it)
        "to_reported": reported["t"] - pull["t"],  # the pull's end seen by get_finished
        "to_forward": forward["begin"] - reported["t"],  # the step that reported it ending, the next scheduling it
        "spun_steps": reported["steps"] - load["steps"],  # engine steps run while the pull ran
    }
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts of 258 tokens, the tiny model")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=1026, help="prompt length (ExampleConnector finds n·128 + 2)")
    parser.add_argument("--py-spy", metavar="PREFIX", help="sample both decode engines, raw stacks to PREFIX-NAME.txt")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    count, tokens, shape = (2, 258, TINY) if args.quick else (args.prompts, args.tokens, SMALL)
    prompts = [[(i * (17 + p) + 2 * p) % 500 + 3 for i in range(tokens)] for p in range(count)]
    none = [None] * count
    spy = None
    if args.py_spy:
        binary = subprocess.run(["which", "py-spy"], capture_output=True, text=True, check=False).stdout.strip()
        spy = f"{binary or 'py-spy'}|{Path(args.py_spy).resolve()}"  # (-handoff.txt, -example.txt added)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "model"
        build_model(model_dir, shape)
        config = workdir / "config.json"
        config.write_text((model_dir / "config.json").read_text())
        broker = subprocess.Popen([sys.executable, "-m", "handoff_broker", "serve", "--host", "127.0.0.1", "--port",
                                   "0", "--model-config", f"{MODEL}={config}", "--config-ctx", "4096"],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            target = broker.stdout.readline().split("listening on ")[1].split(";")[0]
            common = {"prompts": prompts, "target": target, "storage": str(workdir / "files")}
            asked = [{"do_remote_decode": True}] * count  # the router's ask to hand each prompt off
            pushed = vllm_engines.run_engine(
                "handoff-kv_producer", model_dir, workdir, block=128, params=asked, **common
            )
            vllm_engines.run_engine("example", model_dir, workdir, block=128, params=none, **common)
            handoff = run_probed("handoff-kv_consumer", model_dir, workdir, spy and f"{spy}-handoff.txt", block=32,
                                 params=pushed["params"], **common)  # fmt: skip
            example = run_probed("example", model_dir, workdir, spy and f"{spy}-example.txt", block=128, params=none,
                                 **common)  # fmt: skip
            recompute = run_probed("none", model_dir, workdir, block=32, params=none, **common)
        finally:
            broker.terminate()
            broker.wait(timeout=20)
    split = {
        name: {key: statistics.median(phases(p)[key] for p in runs) for key in phases(runs[0])}
        for name, runs in (("handoff", handoff), ("example", example), ("recompute", recompute))
    }
    baseline = split["example"]["total"]
    print(f"{count} prompts of {tokens} tokens; the decode's first token, medians; ms per 1k prompt tokens "
          f"(x ExampleConnector's whole first token)")  # fmt: skip
    for name, row in split.items():
        print(f"  {name}")
        for key, seconds in row.items():
            if key == "spun_steps":
                print(f"    {key:<14} {seconds:8.0f} engine steps while the pull ran")
            elif key == "forward_tokens":
                print(f"    {key:<14} {seconds:8.0f} tokens computed")
            else:
                print(f"    {key:<14} {1e6 * seconds / tokens:8.1f}   ({seconds / baseline:.2f}x)")
    if args.json:
        each = {name: [phases(p) for p in runs] for name, runs in (("handoff", handoff), ("example", example))}
        Path(args.json).write_text(json.dumps({"tokens": tokens, "prompts": count, "phases_s": split,
                                               "each_prompt_s": each}, indent=2))  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_engine":
        probed_engine(*sys.argv[2:5])
    else:
        main()
