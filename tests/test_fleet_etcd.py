"""Fleet membership from etcd (Debian's etcd-server, started here on loopback): brokers register with leases; a
broker that joins is used within a refresh; one that drains leaves at once; one that dies leaves when its lease ends."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import assert_same_bits, seeded_tensors
from handoff_client import FleetClient, HandoffClient
from test_claims import wait_until

MODEL = "every-dtype"
REFRESH = 0.3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd(tmp_path):
    with running_etcd(tmp_path) as (url, _):
        yield url


@contextmanager
def running_etcd(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """etcd on loopback: its URL, and its process (to pause it)."""
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's etcd-server (see .ci/run)")
        pytest.skip("no etcd binary on PATH (apt-get install etcd-server); CI installs it")
    client, peer = free_port(), free_port()
    process = subprocess.Popen(
        [binary, "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", client), timeout=0.5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "etcd did not start"
                time.sleep(0.1)
        yield f"etcd://127.0.0.1:{client}/handoff", process
    finally:
        process.send_signal(signal.SIGCONT)  # (if a test left it paused)
        process.terminate()
        process.wait(15)


def members(client: FleetClient) -> set[str]:
    return set(client._set.brokers())


def test_brokers_join_and_leave_the_set_through_etcd(etcd, start_broker, contracts):
    first, second = start_broker(etcd=etcd, etcd_lease=2), start_broker(etcd=etcd, etcd_lease=2)
    tensors = seeded_tensors(contracts[MODEL])
    with HandoffClient(etcd, refresh=REFRESH) as fleet:
        assert isinstance(fleet, FleetClient)
        wait_until(lambda: members(fleet) == {first.address, second.address}, timeout=5)
        for i in range(10):
            fleet.push(MODEL, f"r{i}", 1, tensors)
        assert first.store.stats().ready > 0 and second.store.stats().ready > 0
        for i in range(10):
            assert_same_bits(fleet.pull(MODEL, f"r{i}", timeout=5).state, tensors)

        joined = time.monotonic()
        third = start_broker(etcd=etcd, etcd_lease=2)
        wait_until(lambda: third.address in members(fleet), timeout=5)
        print(f"a joining broker was in the set after {time.monotonic() - joined:.2f} s (refresh {REFRESH} s)")

        left = time.monotonic()
        second.stop(grace=0.5)  # drains: revokes its lease first
        wait_until(lambda: second.address not in members(fleet), timeout=5)
        print(f"a draining broker left the set after {time.monotonic() - left:.2f} s")

        died = time.monotonic()
        third.registration.stop(revoke=False)  # the process dies: nobody revokes, the lease lapses
        third.server.stop(0)
        wait_until(lambda: third.address not in members(fleet), timeout=10)
        elapsed = time.monotonic() - died
        print(f"a dead broker left the set after {elapsed:.2f} s (lease 2 s)")
        assert elapsed >= 1.0  # it was the lease, not a revoke

        fleet.push(MODEL, "after", 1, tensors)
        assert_same_bits(fleet.pull(MODEL, "after", timeout=5).state, tensors)
        assert members(fleet) == {first.address}


def test_a_lease_whose_put_failed_is_revoked():
    """Registering takes a lease, then puts the key under it; when the put fails (etcd refusing it: its space
    quota, a request too large) the lease is revoked, not left to hang on (the broker retries every third of its
    TTL, each try taking another). A gateway that grants and refuses every put stands in for etcd here."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from handoff_broker.registry import EtcdRegistration

    calls: list[tuple[str, dict]] = []

    class Gateway(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # (http.server calls it by this name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append((self.path, body))
            answer = {"/v3/lease/grant": (200, {"ID": "7", "TTL": "5"}), "/v3/kv/put": (500, {"error": "quota"})}
            status, payload = answer.get(self.path, (200, {}))
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        registration = EtcdRegistration(f"etcd://127.0.0.1:{server.server_port}/fleet", "10.0.0.1:50051", 5)
        with pytest.raises(OSError):
            registration.start()
        assert [path for path, _ in calls] == ["/v3/lease/grant", "/v3/kv/put", "/v3/lease/revoke"]
        assert calls[-1][1] == {"ID": "7"}
    finally:
        server.shutdown()
        server.server_close()
