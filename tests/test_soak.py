"""The adversarial soak (benchmarks/soak.py), short: a broker process at every limit a client can push against at
once — waiting pulls, silent push streams, stalled readers, tiny chunks, numbers out of bounds — answers health and
status within a second throughout, lets a good client's hand-offs through, and at the end holds nothing, serves no
stream, and is back near its start in memory; its threads never pass gRPC's pool. A longer run, by hand:
`python benchmarks/soak.py --seconds 120`."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module
    spec.loader.exec_module(module)
    return module


def test_at_every_limit_at_once_the_broker_answers_serves_and_recovers():
    report = _soak_module().run(seconds=15)
    print(json.dumps(report, indent=2))  # the figures, for whoever reads the log
    assert report["probe_failures"] == [] and report["probe_worst_seconds"] < 1.0
    assert report["good_failures"] == [] and report["good_hand_offs"] >= 5
    every_limit_met = {"waiting pulls: BrokerBusy", "silent pushes: CallCancelled", "tiny chunks: CapacityExhausted",
                       "bad numbers: ShardLayout", "bad numbers: MalformedRequest", "stalled readers: ended"}  # fmt: skip
    assert every_limit_met <= set(report["outcomes"])
    assert (report["held_at_end"], report["streams_in_flight_at_end"], report["resident_bytes_at_end"]) == (0, 0, 0)
    threads, rss = report["threads"], report["rss_mib"]
    assert threads["peak"] <= threads["start"] + threads["workers"] + 4  # the pool's threads, and nothing else
    assert rss["end"] <= rss["start"] + 32
