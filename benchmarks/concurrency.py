"""Concurrent hand-offs, in one run: N pusher/puller pairs at once through one broker, against one pair alone (the
baseline): the aggregate MiB/s, and the slowest and fastest pair's.

    python benchmarks/concurrency.py            # 16 MiB hand-offs; 1, 4 and 16 pairs
    python benchmarks/concurrency.py --quick    # 1 MiB; 1 and 4 pairs

One pushing process and one pulling process, each with a thread per pair (the pulls made first); the aggregate is
every byte over (the last pull's end - the first push's start), a pair's from its push's start to its pull's end.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from _harness import MiB, Services, arguments, finish, manifest, result, setting_up, spawn, wait_ready


def measure(services: Services, nbytes: int, levels: list[int]) -> dict:
    """Each level's aggregate and per-pair MiB/s, the aggregate against one pair's."""
    model = "bench-pairs"
    _, target = services.broker({model: manifest(model, nbytes)})
    figures = {}
    for pairs in levels:
        prefix = f"conc-{pairs}"
        pullers = spawn("handoff-pairs", target, model, pairs, "pull", prefix)
        wait_ready(pullers)
        pushers = spawn("handoff-pairs", target, model, pairs, "push", prefix)
        pulled, pushed = result(pullers)["times"], result(pushers)["times"]
        start = min(t for t, _ in pushed)
        end = max(t for _, t in pulled)
        per_pair = [nbytes / MiB / (pulled[i][1] - pushed[i][0]) for i in range(pairs)]
        figures[str(pairs)] = {
            "aggregate_mib_s": pairs * nbytes / MiB / (end - start),
            "slowest_pair_mib_s": min(per_pair),
            "fastest_pair_mib_s": max(per_pair),
        }
    alone = figures[str(levels[0])]["aggregate_mib_s"]
    for row in figures.values():
        row["vs_one_pair"] = row["aggregate_mib_s"] / alone
    return figures


def report(results: dict) -> list[str]:
    lines = ["\nconcurrent pusher/puller pairs (handoff)   aggregate MiB/s   x 1 pair   slowest pair   fastest pair"]
    for pairs, figures in results["concurrency"].items():
        lines.append(
            f"  {pairs:>3} pairs {figures['aggregate_mib_s']:>33.0f} {figures['vs_one_pair']:>10.2f}"
            f" {figures['slowest_pair_mib_s']:>14.0f} {figures['fastest_pair_mib_s']:>14.0f}"
        )
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__).parse_args(argv)
    _, results = setting_up(args)
    nbytes, levels = (MiB, [1, 4]) if args.quick else (16 * MiB, [1, 4, 16])
    with tempfile.TemporaryDirectory() as tmp, Services(Path(tmp)) as services:
        results["concurrency"] = measure(services, nbytes, levels)
    finish(results, report(results), args.json)
    return results


if __name__ == "__main__":
    main()
