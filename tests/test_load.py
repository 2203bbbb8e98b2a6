"""32 prefill and 32 decode workers against one broker with little memory, with random cancels and kills:
every hand-off is pulled exactly once bit-identical, or refused as cancelled, or was never pushed whole; none twice;
and at the end the broker holds nothing and its RSS is back near where it started.

A longer run, by hand: `python benchmarks/load.py --seconds 60 --pairs 32`.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

from conftest import MANIFESTS

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = ROOT / "server" / "manifests"


def _load_module():
    spec = importlib.util.spec_from_file_location("load", ROOT / "benchmarks" / "load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["load"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_under_load_with_cancels_and_kills_nothing_is_lost_doubled_or_leaked(tmp_path: Path):
    load = _load_module()
    # The embedded demo-hybrid, whose caches carry only the rows each random prompt filled, beside every dtype whole.
    shutil.copy(EMBEDDED / "demo-hybrid.json", tmp_path)
    shutil.copy(MANIFESTS / "every-dtype.json", tmp_path)
    report = load.run_against_own_broker(
        seconds=3, pairs=32, max_bytes="24MiB", models=["demo-hybrid", "every-dtype"], contracts=str(tmp_path)
    )
    print(json.dumps(report, indent=2))  # the counts, for whoever reads the log
    assert report["problems"] == []
    assert report["delivered_twice_or_more"] == 0
    assert report["delivered_once"] > 50
    for fate in ("normal", "kill-pusher", "kill-puller", "cancel"):
        assert report["fates"].get(fate, 0) > 0, fate
    assert report["outcomes"].get("puller killed", 0) > 0 and report["outcomes"].get("push killed", 0) > 0
    assert (report["resident_bytes_at_end"], report["hand_offs_held_at_end"]) == (0, 0)
    rss = report["broker_rss_mib"]
    assert rss["end"] <= rss["start"] + 32, rss
