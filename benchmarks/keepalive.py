"""What the client's keepalive costs push and pull (issue #37): a client with handoff_client's channel options as
they are (HTTP/2 pings every 2 s while a call is under way, answered within 2 s, so a frozen broker is known in
seconds) against the same client with keepalive off (the options before), in one run, against one broker process,
the two clients' rounds interleaved so that the machine's drift falls on both:

    python benchmarks/keepalive.py            # 5 rounds of 200 round trips of 64 KiB and 3 of 32 MiB on the streams
    python benchmarks/keepalive.py --quick    # 2 rounds, fewer

Latency: push then pull (with its confirm) of 64 KiB, p50 and p99. Throughput: push then pull of 32 MiB on the gRPC
streams (lanes off: the path whose flow the pings share). Each figure of the keepalive client as a ratio to the
baseline's (1.00: no cost).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _handoff_roles import tensors_of
from _harness import arguments, finish, manifest, setting_up

KEEPALIVE_OPTIONS = {
    "grpc.keepalive_time_ms",
    "grpc.keepalive_timeout_ms",
    "grpc.http2.ping_timeout_ms",
    "grpc.http2.max_pings_without_data",
    "grpc.keepalive_permit_without_calls",
}
"""The channel options #37 added: the baseline client is made without them (gRPC keeps the first of two values
given for one option, so they cannot be turned off by giving them again)."""
SMALL, LARGE = 64 << 10, 32 << 20


def _broker(folder: Path) -> tuple[subprocess.Popen, str]:
    for model, nbytes in (("bench-small", SMALL), ("bench-large", LARGE)):
        (folder / f"{model}.json").write_text(json.dumps(manifest(model, nbytes)))
    process = subprocess.Popen(
        [sys.executable, "-m", "handoff_broker", "--log-level", "ERROR", "serve", "--port", "0", "--metrics-port",
         "-1", "--contracts", str(folder), "--no-lanes", "--grace", "0"], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    match = re.match(r"handoff-broker listening on (\S+);", process.stdout.readline())
    if match is None:
        process.kill()
        raise RuntimeError("the broker did not start")
    return process, match.group(1)


def _without_keepalive(address: str):
    """A client with the channel options it had before #37."""
    import handoff_client._client as one_broker
    from handoff_client import HandoffClient

    options = one_broker.CHANNEL_OPTIONS
    one_broker.CHANNEL_OPTIONS = tuple(o for o in options if o[0] not in KEEPALIVE_OPTIONS)
    try:
        return HandoffClient(address, lanes=False)
    finally:
        one_broker.CHANNEL_OPTIONS = options


def _round(client, model: str, tensors: dict, times: int, tag: str) -> list[float]:
    seconds = []
    for i in range(times):
        started = time.perf_counter()
        client.push(model, f"{tag}-{i}", 1, tensors)
        client.pull(model, f"{tag}-{i}")
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    args = arguments(__doc__).parse_args()
    runs, results = setting_up(args)
    from handoff_client import HandoffClient

    rounds, small_n, large_n = (2, 50, 1) if args.quick else (max(runs, 5), 200, 3)
    with tempfile.TemporaryDirectory() as tmp:
        broker, address = _broker(Path(tmp))
        try:
            clients = {
                "keepalive off (before)": _without_keepalive(address),
                "keepalive on": HandoffClient(address, lanes=False),
            }
            first = next(iter(clients.values()))
            tensors = {model: tensors_of(first.get_contract(model)) for model in ("bench-small", "bench-large")}
            small = {name: [] for name in clients}
            large = {name: [] for name in clients}
            for r in range(rounds):
                for name, client in clients.items() if r % 2 == 0 else reversed(clients.items()):
                    small[name] += _round(client, "bench-small", tensors["bench-small"], small_n, f"s{r}-{len(name)}")
                    large[name] += _round(client, "bench-large", tensors["bench-large"], large_n, f"l{r}-{len(name)}")
            for client in clients.values():
                client.close()
        finally:
            broker.terminate()
            broker.wait(30)
    base, new = clients
    lines = [f"{'':24}{'64 KiB p50':>12}{'p99':>10}{'32 MiB MB/s':>14}"]
    figures = {}
    for name in clients:
        p50, p99 = np.percentile(small[name], 50) * 1e3, np.percentile(small[name], 99) * 1e3
        rate = 2 * LARGE / np.median(large[name]) / 1e6  # (pushed and pulled)
        figures[name] = {"p50_ms": p50, "p99_ms": p99, "large_mb_s": rate}
        lines.append(f"{name:24}{p50:>10.2f}ms{p99:>8.2f}ms{rate:>14.0f}")
    ratio = {k: figures[new][k] / figures[base][k] for k in figures[base]}
    lines.append(
        f"{'ratio (on / off)':24}{ratio['p50_ms']:>11.2f}x{ratio['p99_ms']:>9.2f}x{ratio['large_mb_s']:>13.2f}x"
    )
    results.update(figures=figures, ratio=ratio)
    finish(results, lines, args.json)


if __name__ == "__main__":
    main()
