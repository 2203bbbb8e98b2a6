"""Where the lanes start to pay: a hand-off pushed then pulled (and confirmed) on the streams, on the TCP lane and on
the shared-memory lane, at sizes around the broker's default --lane-min-bytes (1 MiB), p50 and p90 of each, side by
side in one run.

    python benchmarks/lane_crossover.py [--iterations 30]

One broker process (serving every size on either lane: --lane-min-bytes 1, --shared-memory-lane-min-bytes 1), one
client process doing push then pull,
so each figure is the whole round trip a small hand-off costs; the ratios are lane / streams (below 1: the lane is
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

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20]


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
             "--metrics-port", "-1", "--contracts", folder, "--lane-min-bytes", "1",
             "--shared-memory-lane-min-bytes", "1"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            target = re.match(r"handoff-broker listening on (\S+);", broker.stdout.readline()).group(1)
            paths = {"streams": {"lanes": False}, "tcp": {"shared_memory": False}, "shm": {}}
            print(f"{'bytes':>10}" + "".join(f" {name + ' p50 ms':>15}" for name in paths)
                  + f" {'tcp/streams':>12} {'shm/streams':>12}  p90 ms (each)")  # fmt: skip
            for nbytes in SIZES:
                model = f"x{nbytes}"
                times: dict[str, list[float]] = {name: [] for name in paths}
                for name, settings in paths.items():
                    with HandoffClient(target, **settings) as client:
                        contract = client.get_contract(model)
                        tensors = {"k": np.ones(contract.carried[0].shape, np.float32)}
                        into = {"k": np.zeros(contract.carried[0].shape, np.float32)}
                        for i in range(args.iterations + 3):
                            started = time.perf_counter()
                            client.push(model, f"{name}-{i}", 1, tensors)
                            client.pull(model, f"{name}-{i}", into=into)
                            if i >= 3:  # the first few warm the connection and the broker's pages
                                times[name].append((time.perf_counter() - started) * 1000)
                p50 = {name: statistics.median(t) for name, t in times.items()}
                p90 = "/".join(f"{statistics.quantiles(t, n=10)[-1]:.1f}" for t in times.values())
                print(f"{nbytes:>10}" + "".join(f" {p50[name]:>15.2f}" for name in paths)
                      + f" {p50['tcp'] / p50['streams']:>12.2f} {p50['shm'] / p50['streams']:>12.2f}  {p90}")  # fmt: skip
        finally:
            broker.terminate()
            broker.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
