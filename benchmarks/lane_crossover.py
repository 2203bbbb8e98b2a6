"""Where the TCP lane starts to pay: a hand-off pushed then pulled (and confirmed) on the streams and on the lane, at
sizes around the broker's default --lane-min-bytes (1 MiB), p50 and p90 of each, side by side in one run.

    python benchmarks/lane_crossover.py [--iterations 30]

One broker process (serving every size on the lane: --lane-min-bytes 1), one client process doing push then pull,
so each figure is the whole round trip a small hand-off costs; the ratio is lane / streams (below 1: the lane is
faster). Ratios hold within a run only: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def manifest(nbytes: int) -> dict:
    rows = nbytes // 4096
    return {"model": f"x{nbytes}", "ctx": 2, "hidden": 8,
            "carried": [{"name": "k", "layer": 0, "rows": rows, "cols": 1024, "dtype": "float32"}]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    from handoff_client import HandoffClient

    with tempfile.TemporaryDirectory() as folder:
        for nbytes in SIZES:
            (Path(folder) / f"x{nbytes}.json").write_text(json.dumps(manifest(nbytes)))
        broker = subprocess.Popen(
            [sys.executable, "-m", "handoff_broker", "--log-level", "WARNING", "serve", "--port", "0",
             "--metrics-port", "-1", "--contracts", folder, "--lane-min-bytes", "1"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            target = re.match(r"handoff-broker listening on (\S+);", broker.stdout.readline()).group(1)
            print(f"{'bytes':>10} {'streams p50 ms':>15} {'lane p50 ms':>12} {'lane/streams':>13} {'p90 s/l ms':>14}")
            for nbytes in SIZES:
                model = f"x{nbytes}"
                times: dict[bool, list[float]] = {False: [], True: []}
                for lanes in (False, True):
                    with HandoffClient(target, lanes=lanes) as client:
                        contract = client.get_contract(model)
                        tensors = {"k": np.ones(contract.carried[0].shape, np.float32)}
                        into = {"k": np.zeros(contract.carried[0].shape, np.float32)}
                        for i in range(args.iterations + 3):
                            started = time.perf_counter()
                            client.push(model, f"{lanes}-{i}", 1, tensors)
                            client.pull(model, f"{lanes}-{i}", into=into)
                            if i >= 3:  # the first few warm the connection and the broker's pages
                                times[lanes].append((time.perf_counter() - started) * 1000)
                s50, l50 = statistics.median(times[False]), statistics.median(times[True])
                s90 = statistics.quantiles(times[False], n=10)[-1]
                l90 = statistics.quantiles(times[True], n=10)[-1]
                print(f"{nbytes:>10} {s50:>15.2f} {l50:>12.2f} {l50 / s50:>13.2f} {s90:>7.1f}/{l90:<6.1f}")
        finally:
            broker.terminate()
            broker.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
