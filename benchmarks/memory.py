"""The broker's memory and CPU while it holds a hand-off, in one run: a fresh broker takes a push whole, then its
pull, twice. The first time it holds the bytes in pages it has never had; the second in the pages the first left.

    python benchmarks/memory.py            # 256 MiB
    python benchmarks/memory.py --quick    # 16 MiB

Reported: the broker's RSS before, while holding and at its peak, the peak's growth as a multiple of the bytes held
(the baseline: 1.0 would be one copy, nothing more), what it keeps after for the next pushes (until --trim-after
idle), and its CPU per GiB for a push then its pull, into fresh pages and into kept ones — when it is not sharing
the machine's cores with a pusher and a puller at the same time.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from _harness import (
    MiB,
    Services,
    arguments,
    cpu_now,
    cpu_since,
    finish,
    manifest,
    reset_peak,
    result,
    rss,
    setting_up,
    spawn,
    wait_ready,
)


def measure(services: Services, nbytes: int) -> dict:
    """The fresh broker's RSS around holding `nbytes`, and its CPU per GiB cold and warm."""
    model = "bench-held"
    broker, target = services.broker({model: manifest(model, nbytes)})
    reset_peak(broker.pid)
    base = rss(broker.pid)[0]
    cpu_per_gib, held_rss = [], 0
    for run in ("cold", "warm"):
        before = cpu_now(broker.pid)
        result(spawn("handoff-producer", target, model, f"held-{run}"))
        cpu_push = cpu_since(broker.pid, before)
        held_rss = held_rss or rss(broker.pid)[0]
        consumer = spawn("handoff-consumer", target, model, f"held-{run}")
        wait_ready(consumer)
        before = cpu_now(broker.pid)
        result(consumer)
        cpu_per_gib.append((cpu_push + cpu_since(broker.pid, before)) / (nbytes / (1 << 30)))
    peak = rss(broker.pid)[1]
    return {
        "bytes_held": nbytes,
        "rss_before_mib": base / MiB,
        "rss_holding_mib": held_rss / MiB,
        "peak_rss_mib": peak / MiB,
        "rss_kept_after_mib": rss(broker.pid)[0] / MiB,
        "peak_over_base_vs_held": (peak - base) / nbytes,
        "broker_cpu_s_per_gib_push_then_pull": cpu_per_gib[0],
        "broker_cpu_s_per_gib_push_then_pull_warm": cpu_per_gib[1],
    }


def report(results: dict) -> list[str]:
    m = results["memory"]
    return [
        (
            f"\nbroker memory holding {m['bytes_held'] / MiB:.0f} MiB: RSS {m['rss_before_mib']:.0f} MiB before, "
            f"{m['rss_holding_mib']:.0f} MiB holding, peak {m['peak_rss_mib']:.0f} MiB "
            f"(peak - before = {m['peak_over_base_vs_held']:.2f} x the bytes held), {m['rss_kept_after_mib']:.0f} MiB "
            f"kept after for the next pushes (until --trim-after idle)\nbroker CPU for a push then its pull, one at a "
            f"time: {m['broker_cpu_s_per_gib_push_then_pull']:.2f} s per GiB into a fresh broker, "
            f"{m['broker_cpu_s_per_gib_push_then_pull_warm']:.2f} s per GiB into the pages the first one left"
        )
    ]


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__).parse_args(argv)
    _, results = setting_up(args)
    with tempfile.TemporaryDirectory() as tmp, Services(Path(tmp)) as services:
        results["memory"] = measure(services, 16 * MiB if args.quick else 256 * MiB)
    finish(results, report(results), args.json)
    return results


if __name__ == "__main__":
    main()
