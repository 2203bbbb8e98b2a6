"""Time to the decoder's KV after prompts of each length, in one run: a hand-off carrying only the rows its prompt
filled, against the same hand-off padded to the full context (a contract without `rows_are_positions`, as the
project moved every cache before hand-offs carried only their filled rows) and against the raw TCP relay moving the
same filled bytes.

    python benchmarks/prompts.py            # Llama-3-8B at 32k context, prompts of 512, 2k and 8k tokens
    python benchmarks/prompts.py --quick    # two of its layers at 4k context, prompts of 512 and 2k tokens

Each hand-off is a prefill process pushing its whole cache arrays (what crosses is up to the contract) and a decoder
process pulling into its whole preallocated caches; timed from the push's start to the pull's return, the decoder's
filled rows checked against the prefill's (CRC32C). The padded hand-off moves the same bytes at any prompt length, so
it runs once per run. Medians of --runs.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from _harness import (
    MiB,
    Services,
    arguments,
    finish,
    llama3_8b,
    port_from,
    relay_run,
    result,
    setting_up,
    spawn,
    wait_ready,
)


def measure(services: Services, runs: int, ctx: int, layers: int, positions: list[int]) -> dict:
    """Every prompt length's seconds through the broker, against the padded hand-off and the TCP relay."""
    model, padded = "llama-3-8b-prompts", "llama-3-8b-padded"
    _, target = services.broker({model: llama3_8b(model, ctx, layers, positional=True),
                                 padded: llama3_8b(padded, ctx, layers)})  # fmt: skip
    rows: dict[str, list] = {f"{p} tokens": [] for p in positions}
    tcp: dict[str, list] = {f"{p} tokens": [] for p in positions}
    filled: dict[str, int] = {}
    padded_times: list[float] = []
    port_file = services.workdir / "tcp-prompts.port"
    relay = services.keep(spawn("tcp-relay", port_file, runs * len(positions)))
    tcp_port = port_from(port_file)

    def through(model_name: str, key: str, position: int) -> tuple[float, int]:
        consumer = spawn("prompt-consumer", target, model_name, key)
        wait_ready(consumer)
        time.sleep(0.1)  # the pull is waiting at the broker before the push starts
        p, c = result(spawn("prompt-producer", target, model_name, key, position)), result(consumer)
        if p["crc"] != c["crc"]:
            raise RuntimeError("the decoder's filled rows differ from the prefill's")
        return c["t1"] - p["t0"], p["bytes"]

    for run in range(runs):
        for position in positions:
            name = f"{position} tokens"
            seconds, filled[name] = through(model, f"{model}-{position}-{run}", position)
            rows[name].append(seconds)
            consumer = spawn("tcp-consumer", tcp_port, filled[name])
            wait_ready(consumer)
            producer = spawn("tcp-producer", tcp_port, filled[name])
            tcp[name].append(relay_run(producer, consumer, filled[name])["seconds"])
        padded_times.append(through(padded, f"{padded}-{run}", positions[0])[0])
    relay.wait(timeout=60)
    full = statistics.median(padded_times)
    return {
        "label": f"Llama-3-8B{f' ({layers} layers)' if layers != 32 else ''}, {ctx // 1024}k ctx",
        "ctx": ctx,
        "padded_seconds": full,
        "rows": {
            name: {
                "bytes": filled[name],
                "seconds": statistics.median(times),
                "x_faster_than_padded": full / statistics.median(times),
                "vs_tcp": statistics.median(tcp[name]) / statistics.median(times),
            }
            for name, times in rows.items()
        },
    }


def report(results: dict) -> list[str]:
    r = results["prompts"]
    lines = [f"\n{r['label']}: prefill push to decoder's KV     MiB     ms   x faster than padded   x tcp relay"]
    for name, figures in r["rows"].items():
        lines.append(
            f"  {name:<12} {figures['bytes'] / MiB:>34.0f} {1000 * figures['seconds']:>6.0f}"
            f" {figures['x_faster_than_padded']:>22.1f} {figures['vs_tcp']:>13.2f}"
        )
    lines.append(f"  padded to the full {r['ctx']} context (any prompt): {1000 * r['padded_seconds']:.0f} ms")
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__).parse_args(argv)
    runs, results = setting_up(args)
    ctx, layers = (4096, 2) if args.quick else (32768, 32)
    positions = [512, 2048] if args.quick else [512, 2048, 8192]
    with tempfile.TemporaryDirectory() as tmp, Services(Path(tmp)) as services:
        results["prompts"] = measure(services, runs, ctx, layers, positions)
    finish(results, report(results), args.json)
    return results


if __name__ == "__main__":
    main()
