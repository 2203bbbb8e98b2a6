"""Driving vLLM instances for the hybrid tests: each tests/vllm_driver.py's Engine in session mode, running
tests/vllm_hybrid_roles.py and bound to a core of its own in turn, started together so that their start-ups overlap;
and what the tests read off a hand-off and the broker.
"""

from __future__ import annotations

import time
from pathlib import Path

from vllm_driver import Engine

ROLES = Path(__file__).resolve().parent / "vllm_hybrid_roles.py"
MAX_TOKENS = 8  # (tests/vllm_driver.py's Engine.generate default)
KV_CACHE_BYTES = 64 << 20
ASKED = {"do_remote_decode": True, "do_remote_prefill": False}


def start_engine(role: str, model_dir: Path, folder: Path, name: str | None = None, **settings) -> Engine:
    """One instance of tests/vllm_hybrid_roles.py in session mode, `settings` over the hybrid tests' own; started,
    not waited for (`ready`)."""
    settings = {"session": True, "kv_cache_bytes": KV_CACHE_BYTES, "max_tokens": MAX_TOKENS, "prompts": [], **settings}
    return Engine(role, model_dir, folder, settings, script=ROLES, name=name)


def engines(model_dir: Path, folder: Path, target: str, model: str, **roles: dict) -> dict[str, Engine]:
    """Several instances started at once (their start-ups overlap), each ready when returned; named by role, or
    `role:name` for a second one of a role."""
    started = {name: start_engine(name.split(":")[0], model_dir, folder, name=name.replace(":", "-"),
                                  extra={"target": target, "model": model}, **settings)
               for name, settings in roles.items()}  # fmt: skip
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
