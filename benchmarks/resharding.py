"""Tensor-parallel engines on both sides, in one run: the same hand-off pushed and pulled whole (TP 1 -> 1, the
baseline), at equal TP sizes (2 -> 2: each rank's shard streams through) and resharded (4 -> 2: the broker cuts each
pulling rank's heads out of the pushing ranks' as the push arrives).

    python benchmarks/resharding.py            # 256 MiB
    python benchmarks/resharding.py --quick    # 16 MiB

Every rank is a process of its own, as in vLLM or SGLang; all pushing ranks start together (on a line each reads
from stdin), timed from the first push's start to the last pull's end. Also when the first decode rank had its first
tensor, as a fraction of the push's duration. Medians of --runs.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from _harness import MiB, Services, arguments, finish, manifest, result, setting_up, spawn, wait_ready

PAIRS = ((1, 1), (2, 2), (4, 2))  # (prefill TP, decode TP); the first is the baseline


def measure(services: Services, runs: int, nbytes: int) -> dict:
    """MiB/s of each TP pair, against the whole hand-off's, and when its first tensor reached a decode rank."""
    model = "bench-reshard"
    _, target = services.broker({model: manifest(model, nbytes)})
    rows, firsts = {}, {}
    for push_tp, pull_tp in PAIRS:
        times, first = [], []
        for run in range(runs):
            key = f"tp-{push_tp}-{pull_tp}-{run}"
            pullers = [spawn("handoff-rank", target, model, key, "pull", r, pull_tp) for r in range(pull_tp)]
            pushers = [spawn("handoff-rank", target, model, key, "push", r, push_tp, fed=True) for r in range(push_tp)]
            for process in pullers + pushers:
                wait_ready(process)
            for pusher in pushers:
                pusher.stdin.write("go\n")
                pusher.stdin.flush()
            pushed, pulled = [result(p) for p in pushers], [result(p) for p in pullers]
            start, pushed_at = min(r["t0"] for r in pushed), max(r["t1"] for r in pushed)
            times.append(max(r["t1"] for r in pulled) - start)
            first.append((min(r["t_first"] for r in pulled) - start) / (pushed_at - start))
        rows[f"{push_tp} -> {pull_tp}"] = nbytes / MiB / statistics.median(times)
        firsts[f"{push_tp} -> {pull_tp}"] = statistics.median(first)
    whole = rows["1 -> 1"]
    return {
        "bytes": nbytes,
        "paths": {
            name: {"mib_s": mib_s, "vs_whole": mib_s / whole, "first_tensor_at": firsts[name]}
            for name, mib_s in rows.items()
        },
    }


def report(results: dict) -> list[str]:
    r = results["resharding"]
    title = f"tensor-parallel ranks, prefill TP -> decode TP ({r['bytes'] / MiB:.0f} MiB)   MiB/s   x whole"
    lines = [f"\n{title}   first tensor at"]
    for name, figures in r["paths"].items():
        lines.append(
            f"  {name:<10} {figures['mib_s']:>36.0f} {figures['vs_whole']:>9.2f}"
            f" {100 * figures['first_tensor_at']:>14.1f}% of the push"
        )
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__).parse_args(argv)
    runs, results = setting_up(args)
    with tempfile.TemporaryDirectory() as tmp, Services(Path(tmp)) as services:
        results["resharding"] = measure(services, runs, 16 * MiB if args.quick else 256 * MiB)
    finish(results, report(results), args.json)
    return results


if __name__ == "__main__":
    main()
