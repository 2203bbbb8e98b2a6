"""Every side-by-side comparison of handoff-broker against its baselines, one after the other, in one command. Each
is a script of its own, with the same options, and prints ratios against baselines measured in its own run:

    throughput.py    MiB/s of 1 MiB to a Llama-3-8B hand-off through the broker (streams, TCP lane, shared-memory
                     lane) against memcpy x2, a raw TCP relay, a checked relay, Redis, a naive and a tuned gRPC relay
    prompts.py       time to the decoder's KV after prompts of 512 to 8k tokens, against the same hand-off padded to
                     the full context and against the TCP relay
    latency.py       a 64 KiB hand-off's round trip against the gRPC floor (the same three calls doing nothing)
    resharding.py    tensor-parallel 2 -> 2 and 4 -> 2 against the whole hand-off (1 -> 1)
    concurrency.py   1, 4 and 16 concurrent pairs against one pair alone
    memory.py        the broker's RSS and CPU holding a hand-off, against the bytes held

    python benchmarks/bench.py                          # all of them
    python benchmarks/bench.py --only throughput        # one (repeatable); or python benchmarks/throughput.py
    python benchmarks/bench.py --quick --json out.json  # small sizes, few runs; every figure, by section, to a file

What the comparisons share (payloads, role processes, CPU and memory readings, the broker's start) is _harness.py;
the role processes are _baselines.py, _grpc_relay.py and _handoff_roles.py, started through _roles.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import concurrency
import latency
import memory
import prompts
import resharding
import throughput
from _harness import arguments

SECTIONS = {"memory": memory, "throughput": throughput, "prompts": prompts, "latency": latency,
            "resharding": resharding, "concurrency": concurrency}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = arguments(__doc__)
    parser.add_argument("--only", choices=SECTIONS, action="append",
                        help="run only this comparison (repeatable; default: every one)")  # fmt: skip
    args = parser.parse_args(argv)
    passed = [*(["--quick"] if args.quick else []), *(["--runs", str(args.runs)] if args.runs else []),
              *(["--chunk-bytes", str(args.chunk_bytes)] if args.chunk_bytes else [])]  # fmt: skip
    merged: dict = {}
    for name, module in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        figures = module.main(passed)
        notes = sorted({*merged.get("notes", []), *figures["notes"]})
        merged = {**figures, **merged, name: figures[name], "notes": notes}  # (the first one's machine and quick)
    if args.json:
        Path(args.json).write_text(json.dumps(merged, indent=2))
    return merged


if __name__ == "__main__":
    main()
