"""Ops dashboards scrape /metrics: after real traffic through a live broker, the figures moved as they should,
and no label carries an id."""

from __future__ import annotations

import urllib.request

from conftest import seeded_tensors
from handoff_client import HandoffClient
from prometheus_client.parser import text_string_to_metric_families
from support import header_frame, raises_handoff_error, raw_push
from test_claims import wait_until


def scrape(broker) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_traffic_moves_the_figures_a_dashboard_reads(start_broker, contracts):
    broker = start_broker(metrics_port=0, ttl=0.3)
    demo = contracts["demo-hybrid"]
    with HandoffClient(broker.address) as client:
        tensors = seeded_tensors(demo)
        client.push("demo-hybrid", "a", 1, tensors)
        held = scrape(broker)
        assert value(held, "handoff_held", state="ready") == 1
        assert value(held, "handoff_resident_bytes") == demo.nbytes
        assert value(held, "handoff_capacity_bytes") == broker.config.max_bytes
        client.pull("demo-hybrid", "a")
        client.push("demo-hybrid", "a", 1, tensors)  # a blind retry of a delivered hand-off
        raises_handoff_error(client.pull, "llama-9", "x", timeout=1)  # unknown model: label "unknown"
        raises_handoff_error(raw_push, broker.address, [header_frame(demo, "bad", position=demo.ctx)])
        client.push("demo-hybrid", "expires", 1, tensors)
        client.push("demo-hybrid", "cancelled", 1, tensors)
        client.cancel("demo-hybrid", "cancelled")
        raises_handoff_error(client.pull, "demo-hybrid", "cancelled", timeout=1)  # a refused pull
        wait_until(lambda: broker.store.stats().ready == 0)
    after = scrape(broker)
    assert value(after, "handoff_pushes_total", model="demo-hybrid", outcome="committed") == 3
    assert value(after, "handoff_pushes_total", model="demo-hybrid", outcome="duplicate") == 1
    assert value(after, "handoff_pushes_total", model="demo-hybrid", outcome="refused") == 1
    assert value(after, "handoff_pulls_total", model="demo-hybrid", outcome="delivered") == 1
    assert value(after, "handoff_pulls_total", model="demo-hybrid", outcome="refused") == 1
    assert value(after, "handoff_rejections_total", model="demo-hybrid", reason="POSITION_OUT_OF_RANGE") == 1
    assert value(after, "handoff_rejections_total", model="unknown", reason="UNKNOWN_MODEL") == 1
    assert value(after, "handoff_received_bytes_total", model="demo-hybrid") == 4 * demo.nbytes
    assert value(after, "handoff_sent_bytes_total", model="demo-hybrid") == demo.nbytes
    assert value(after, "handoff_confirms_total", model="demo-hybrid") == 1
    assert value(after, "handoff_expired_total", model="demo-hybrid") == 1
    assert value(after, "handoff_cancelled_total", model="demo-hybrid") == 1
    assert value(after, "handoff_push_duration_seconds_count", model="demo-hybrid") == 4
    assert value(after, "handoff_end_to_end_seconds_count", model="demo-hybrid") == 1
    assert value(after, "handoff_wait_for_decoder_seconds_count", model="demo-hybrid") == 1
    assert value(after, "handoff_resident_bytes") == 0
    assert value(after, "handoff_streams_in_flight", kind="push") == 0
    for name, labels in after:
        if name.startswith("handoff_") and name != "handoff_build_info":  # (one series: the release it runs)
            assert {k for k, _ in labels} <= {"model", "outcome", "reason", "state", "kind", "lane", "le"}, name


def test_a_broken_pull_is_counted_as_broken_and_returned(start_broker, contracts):
    broker = start_broker(metrics_port=0)
    from support import open_channel, raw_pull

    with HandoffClient(broker.address) as client, open_channel(broker.address) as channel:
        client.push("wide-attention", "r", 1, seeded_tensors(contracts["wide-attention"]))
        stream = raw_pull(channel, "wide-attention", "r")
        next(stream)
        stream.cancel()
        wait_until(lambda: broker.store.stats().ready == 1)
        client.pull("wide-attention", "r")
    samples = scrape(broker)
    assert value(samples, "handoff_pulls_total", model="wide-attention", outcome="broken") == 1
    assert value(samples, "handoff_pulls_total", model="wide-attention", outcome="delivered") == 1
    assert value(samples, "handoff_lease_returns_total", model="wide-attention") == 1


def test_the_build_and_the_process_are_exported_beside_the_hand_offs(start_broker):
    """Fails before the fix: no handoff_build_info and no process_* metrics, so an operator could not watch the
    broker's RSS against its memory limit, nor see which release a pod runs."""
    import platform
    from importlib import metadata

    import handoff_client

    broker = start_broker(metrics_port=0)
    samples = scrape(broker)
    build = {"version": handoff_client.__version__, "python": platform.python_version(),
             "grpc": metadata.version("grpcio")}  # fmt: skip
    assert value(samples, "handoff_build_info", **build) == 1
    assert value(samples, "process_resident_memory_bytes") > 10 << 20  # a Python with grpc and numpy loaded
    assert value(samples, "process_open_fds") > 0
    assert value(samples, "process_cpu_seconds_total") > 0
    assert value(samples, "process_max_fds") > 0


def test_no_metric_name_stutters(start_broker):
    """Fails before the fix: hand-offs held were `handoff_handoffs`."""
    broker = start_broker(metrics_port=0)
    names = {name for name, _ in scrape(broker)}
    ours = {name for name in names if name.startswith("handoff_")}
    assert "handoff_held" in ours
    assert not [name for name in ours if name.removeprefix("handoff_").startswith("handoff")]


def test_every_metric_the_broker_exports_is_documented(start_broker):
    """docs/operations.md names each: fails if a metric is added (or renamed) without its line there."""
    import re
    from pathlib import Path

    operations = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    broker = start_broker(metrics_port=0)
    with urllib.request.urlopen(f"http://127.0.0.1:{broker.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    exported = set(re.findall(r"^# TYPE ((?:handoff|process)_\w+) ", text, re.MULTILINE))  # (samples or none yet)
    assert "handoff_lane_bytes_total" in exported and "process_resident_memory_bytes" in exported
    assert sorted(name for name in exported if f"`{name}" not in operations) == []


def test_pulls_waiting_for_their_push_are_counted_in_flight(start_broker, contracts):
    """handoff_streams_in_flight{kind="pull"} counts a pull from its admission: 7 pulls waiting for their pushes
    read 0 when it counted only after the claim (#37)."""
    import threading

    broker = start_broker()
    tensors = seeded_tensors(contracts["demo-hybrid"])
    in_flight = lambda: broker.registry.get_sample_value("handoff_streams_in_flight", {"kind": "pull"})
    with HandoffClient(broker.address) as client:
        pulls = [threading.Thread(target=client.pull, args=("demo-hybrid", f"later-{n}"), kwargs={"timeout": 20})
                 for n in range(3)]  # fmt: skip
        for pull in pulls:
            pull.start()
        wait_until(lambda: broker.admission.waiting.taken == 3)
        assert in_flight() == 3
        for n in range(3):
            client.push("demo-hybrid", f"later-{n}", 1, tensors)
        for pull in pulls:
            pull.join(20)
    wait_until(lambda: in_flight() == 0)
