"""`vllm serve` for the vLLM tests: an OpenAI-compatible server in a process of its own, bound to one core, its log in
a file; and the HTTP calls the tests make to it (completions, streamed or not, /health, /metrics)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engine_zygote import command as zygote_command
from engine_zygote import ended


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model_dir: Path, folder: Path, port: int, arguments: list[str], bind: str) -> tuple[subprocess.Popen, Path]:
    """`vllm serve MODEL_DIR --port PORT ARGUMENTS...` on loopback, the engine in the server's process, its OpenMP
    threads on core `bind`: (the process, its log)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--port", str(port), "--host", "127.0.0.1", *arguments]  # fmt: skip
    env = {**os.environ, "VLLM_CACHE_ROOT": str(folder / "vllm-cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_OMP_THREADS_BIND": bind}  # fmt: skip
    log = folder / f"serve-{port}.log"
    with open(log, "w") as out:
        return subprocess.Popen(zygote_command(command), stdout=out, stderr=subprocess.STDOUT, env=env), log


def stop(process: subprocess.Popen) -> None:
    """Terminated, else killed; waited for."""
    ended(process)


def post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def post_stream(url: str, body: dict, timeout: float = 120) -> list[int]:
    """The token ids of a streamed completion, gathered from its server-sent events."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    tokens: list[int] = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            data = line.decode().strip().removeprefix("data: ")
            if data and data != "[DONE]":
                tokens += json.loads(data)["choices"][0].get("token_ids") or []
    return tokens


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-5000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.25)
    raise AssertionError(f"{url} did not come up in {timeout} s: {log.read_text()[-3000:]}")


def metric(url: str, name: str, expected: float, timeout: float = 20) -> float | None:
    """The value of series `name` on the instance's /metrics, polled until it is `expected` (vLLM ships its stats
    from the engine to the server a moment after the step); None if it is not there."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            lines = response.read().decode().splitlines()
        values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{")]
        value = sum(values) if values else None
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


class Served:
    """A `vllm serve` started, not waited for (`healthy` waits), on a free port; `close` stops it."""

    def __init__(self, model_dir: Path, folder: Path, arguments: list[str], bind: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process, self.log = serve(model_dir, folder, self.port, arguments, bind)

    def healthy(self) -> Served:
        wait_healthy(self.url, self.process, self.log)
        return self

    def close(self) -> None:
        if self.process.poll() is None:
            stop(self.process)
