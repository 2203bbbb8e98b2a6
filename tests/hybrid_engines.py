"""Driving vLLM instances for the hybrid tests: each instance a process of its own (tests/vllm_hybrid_roles.py, in
session mode), started together so that their start-ups overlap, and driven a command at a time; and what the tests
read off a hand-off and the broker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROLES = Path(__file__).resolve().parent / "vllm_hybrid_roles.py"
MAX_TOKENS = 8
KV_CACHE_BYTES = 64 << 20
ASKED = {"do_remote_decode": True, "do_remote_prefill": False}


class Engine:
    """One vLLM instance in its own process, driven a command at a time (vllm_roles.py's session); its log kept."""

    def __init__(self, role: str, model_dir: Path, folder: Path, **settings) -> None:
        file = folder / f"{role}-{time.monotonic_ns()}.json"
        file.write_text(json.dumps({"session": True, "kv_cache_bytes": KV_CACHE_BYTES, "max_tokens": MAX_TOKENS,
                                    "prompts": [], **settings}))  # fmt: skip
        self.log = folder / f"{file.stem}.log"
        self.printed: list[str] = []
        env = {**os.environ, "VLLM_CACHE_ROOT": str(folder / "vllm-cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, str(ROLES), role, str(model_dir), str(file)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                            env=env)  # fmt: skip

    def _answer(self) -> dict:
        """The next JSON line the instance prints; vLLM's own log lines on stdout are kept for `text`."""
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
            self.printed.append(line)
        raise AssertionError(self.text()[-5000:])

    def text(self) -> str:
        """Everything the instance logged so far."""
        return "".join(self.printed) + self.log.read_text()

    def ready(self) -> Engine:
        assert "ready" in self._answer()
        return self

    def generate(self, prompts: list[list[int]], params: list[dict | None] | None = None,
                 max_tokens: int = MAX_TOKENS) -> dict:  # fmt: skip
        command = {"op": "generate", "prompts": prompts, "params": params, "max_tokens": max_tokens}
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write('{"op": "exit"}\n')
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def engines(model_dir: Path, folder: Path, target: str, model: str, **roles: dict) -> dict[str, Engine]:
    """Several instances started at once (their start-ups overlap), each ready when returned; named by role, or
    `role:name` for a second one of a role."""
    started = {name: Engine(name.split(":")[0], model_dir, folder, extra={"target": target, "model": model},
                            **settings) for name, settings in roles.items()}  # fmt: skip
    try:
        return {role: engine.ready() for role, engine in started.items()}
    except BaseException:
        for engine in started.values():
            engine.close()
        raise


def hand_off(producer: Engine, prompts: list[list[int]]) -> list[dict]:
    """Each prompt prefilled with its hand-off asked for: the params the decoder gets (less
    `remote_prefill_cached_tokens`, which vLLM would report as the decoder's own cached tokens)."""
    params = producer.generate(prompts, [dict(ASKED) for _ in prompts], max_tokens=1)["kv_transfer_params"]
    return [{k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"} for p in params]


def received(broker, model: str, expected: float | None = None, timeout: float = 60) -> float:
    """Bytes an in-process broker took in for `model`; with `expected`, polled until it is that (the producer
    pushes in the background, after its response)."""
    deadline = time.monotonic() + timeout
    while True:
        value = broker.registry.get_sample_value("handoff_received_bytes_total", {"model": model}) or 0.0
        if expected is None or value >= expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def state_bytes(contract) -> int:
    """Bytes of a contract's recurrent state (its tensors whose rows are not positions): the same at any position."""
    return sum(c.nbytes for c in contract.carried if not c.rows_are_positions)
