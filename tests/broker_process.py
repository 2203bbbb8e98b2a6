"""A broker as its own process (`handoff-broker serve`), for tests that measure what the broker holds from outside:
its RSS and its descriptors, read from /proc, as an operator's monitor (or the OOM killer) sees them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Self

from certs import Authority
from handoff_client import Contract

COMMAND = [sys.executable, "-m", "handoff_broker", "--log-level", "ERROR", "serve", "--port", "0"]


class BrokerProcess:
    """`handoff-broker serve` with `contracts` (written as manifests under `folder`) and `args`; `tls` serves TLS
    from a fresh CA (`client_options` then trusts it). Stopped by `stop` (or as a context manager)."""

    def __init__(self, folder: Path, contracts: list[Contract], *args: str, tls: bool = False) -> None:
        manifests = folder / "manifests"
        manifests.mkdir(exist_ok=True)
        for contract in contracts:
            (manifests / f"{contract.model}.json").write_text(json.dumps(contract.to_json()))
        folder_flag = ["--contracts", str(manifests)] if contracts else []  # (none: `args` give them, --model-config)
        command = [*COMMAND, *folder_flag, "--metrics-port", "-1", *args]
        self.client_options: dict[str, object] = {}
        if tls:
            ca = Authority("handoff test CA")
            server = ca.issue("localhost", server=True)
            (folder / "server.pem").write_bytes(server.cert)
            (folder / "server.key").write_bytes(server.key)
            command += ["--tls-cert", str(folder / "server.pem"), "--tls-key", str(folder / "server.key")]
            self.client_options = {"tls_root_certificates": ca.pem, "tls_server_name": "localhost"}
        self._log = folder / "broker.log"
        with self._log.open("w") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.process.stdout.readline()
        match = re.match(r"handoff-broker listening on (\S+);", line)
        if match is None:
            self.stop()
            raise AssertionError(f"the broker did not start: {line!r} {self._log.read_text()[-2000:]}")
        self.address = match.group(1)
        health = re.search(r"; health on :(\d+)", line)  # (with --health-port)
        self.health_port = int(health.group(1)) if health else None

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss(self) -> int:
        """Resident bytes, from /proc/PID/status."""
        text = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024

    def threads(self) -> int:
        text = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(r"^Threads:\s+(\d+)", text, re.MULTILINE).group(1))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def admin_token_file(folder: Path, token: str = "admin") -> Path:
    """A --tokens file under `folder` holding one token, `token`, named `ops`, with the admin role."""
    from handoff_broker.auth import hash_token

    path = folder / "tokens.json"
    path.write_text(json.dumps({"tokens": [{"name": "ops", "sha256": hash_token(token), "roles": ["admin"]}]}))
    return path
