"""Driving vLLM instances for the vLLM tests: each a process of its own (tests/vllm_roles.py, or a script that wraps
it), started without waiting for it, so that the start-ups of a module's engines overlap one another and the tests'
own work, and each bound to a core of its own in turn (VLLM_CPU_OMP_THREADS_BIND: two engines bound to the same
cores spin their OpenMP threads against each other). An engine is either driven one JSON command a line (session
mode: `"session": true` in its settings) or runs its prompts start to finish (one shot).

Engine start-ups are what the vLLM tests spend their time on (15-40 s each on 2 cores in a fresh interpreter, most of
it importing torch and vLLM on one core; a few seconds forked from tests/engine_zygote.py, as each is): a module
starts every engine it needs at once, in one fixture, and its tests share them. A session
engine's stdout carries its answers (vLLM's own log lines between them are kept, for `text`); a one-shot engine's
stdout goes to a file, so that a process nobody reads yet never blocks on a full pipe.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from engine_zygote import command

ROLES = Path(__file__).resolve().parent / "vllm_roles.py"
_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
_next_core = itertools.cycle(_CORES)


def next_core() -> str:
    """The core the next engine is bound to: each in turn."""
    return str(next(_next_core))


class Engine:
    """One vLLM instance in its own process (`script ROLE MODEL_DIR SETTINGS.json`), its output kept in `folder`."""

    def __init__(self, role: str, model_dir: Path, folder: Path, settings: dict, *, script: Path = ROLES,
                 bind: str | None = None, name: str | None = None, env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.name = name or role
        self.session = bool(settings.get("session"))
        stem = f"{self.name}-{time.monotonic_ns()}"
        file = folder / f"{stem}.json"
        file.write_text(json.dumps(settings))
        self.out_path, self.err_path = folder / f"{stem}.out", folder / f"{stem}.err"
        self.printed: list[str] = []
        self._ready = False
        env = {**os.environ, "VLLM_CACHE_ROOT": str(folder / "vllm-cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_OMP_THREADS_BIND": bind or next_core(), **(env or {})}  # fmt: skip
        with open(self.err_path, "w") as err, open(self.out_path, "w") as out:
            self.process = subprocess.Popen(command([sys.executable, str(script), role, str(model_dir), str(file)]),
                                            stdin=subprocess.PIPE if self.session else subprocess.DEVNULL,
                                            stdout=subprocess.PIPE if self.session else out, stderr=err, text=True,
                                            env=env)  # fmt: skip

    # -- session mode

    def _answer(self) -> dict:
        """The next JSON line the instance prints; vLLM's own lines before it are kept for `text`."""
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
            self.printed.append(line)
        raise AssertionError(f"{self.name} ended: {self.text()[-5000:]}")

    def ready(self) -> Engine:
        """Once started (waited for the first time only): the engine itself."""
        if not self._ready:
            assert self._answer().get("ready"), self.text()[-5000:]
            self._ready = True
        return self

    def send(self, op: str, **command) -> None:
        """A command, without waiting for its answer (`answer`)."""
        self.ready()
        self.process.stdin.write(json.dumps({"op": op, **command}) + "\n")
        self.process.stdin.flush()

    def answer(self) -> dict:
        return self._answer()

    def ask(self, op: str, **command) -> dict:
        self.send(op, **command)
        return self._answer()

    def generate(self, prompts: list[list[int]], params: list[dict | None] | None = None, max_tokens: int = 8) -> dict:
        """The prompts run at once (params: each one's kv_transfer_params, or None: a plain request)."""
        return self.ask("generate", prompts=prompts, params=params, max_tokens=max_tokens)

    # -- one shot

    def finished(self, timeout: float = 300) -> int:
        """The exit status, once the instance has run to its end."""
        return self.process.wait(timeout=timeout)

    def report(self) -> dict:
        """A one-shot instance's JSON report, once it has ended well."""
        assert self.finished() == 0, self.text()[-5000:]
        return json.loads(self.out_path.read_text().strip().splitlines()[-1])

    # -- both

    def text(self) -> str:
        """Everything the instance printed so far, its stdout then its stderr."""
        return "".join(self.printed) + self.out_path.read_text() + self.err_path.read_text()

    def close(self) -> None:
        """Ended, however it is: asked to exit, else killed."""
        if self.process.poll() is None:
            try:
                if self.session:
                    self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                    self.process.stdin.close()
                self.process.wait(timeout=30 if self.session else 0.1)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()
