"""`handoff-broker status` and `health` against a fleet target (#38 item 2): each broker by name and the fleet's
total. Before, `status` with `a:1,b:2` crashed (a FleetClient has no status()) and `health` asked gRPC for a host
named `a:1,b:2` (UNAVAILABLE, naming no broker)."""

from __future__ import annotations

import subprocess
import sys

COMMAND = [sys.executable, "-m", "handoff_broker"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=60, check=False)


def test_status_and_health_of_a_fleet_name_each_broker_and_total_them(start_broker, contracts):
    from conftest import seeded_tensors
    from handoff_client import HandoffClient

    up, down = start_broker(), start_broker()
    with HandoffClient(up.address) as client:
        client.push("demo-hybrid", "held", 1, seeded_tensors(contracts["demo-hybrid"]))
    fleet = f"{up.address},{down.address}"
    status = _run("status", "--target", fleet)
    assert status.returncode == 0, status.stderr
    assert f"{up.address}: serving" in status.stdout and f"{down.address}: serving" in status.stdout
    assert f"fleet {fleet}: 2 of 2 brokers answered; hand-offs held: 1; bytes: " in status.stdout
    health = _run("health", "--target", fleet)
    assert health.returncode == 0, health.stderr
    first, second = sorted([up.address, down.address])  # (the set's order)
    assert f"{first}: SERVING\n{second}: SERVING\nfleet {fleet}: 2 of 2 brokers SERVING" in health.stdout
    down.stop(grace=0)
    status = _run("status", "--target", fleet, "--timeout", "2")
    assert status.returncode == 1 and "Traceback" not in status.stderr
    assert f"fleet {fleet}: 1 of 2 brokers answered ({down.address} did not); hand-offs held: 1" in status.stdout
    assert f"{down.address}: " in status.stdout
    health = _run("health", "--target", fleet, "--timeout", "2")
    assert health.returncode == 1
    assert f"{down.address}: UNAVAILABLE" in health.stdout and f"fleet {fleet}: 1 of 2 brokers SERVING" in health.stdout
    empty = _run("health", "--target", "etcd://127.0.0.1:1/none", "--timeout", "1")
    assert empty.returncode == 1 and "the fleet's broker set cannot be read" in empty.stderr
