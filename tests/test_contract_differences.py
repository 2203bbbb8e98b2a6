"""What differs between two contracts for one model, named: `protocol.contract.differences` and the
FingerprintMismatch that carries it (the vLLM connector raises it at start-up with the broker's contract and its
own: tests/test_vllm_cpus.py shows it through a real engine). Two hex fingerprints tell a person nothing; the field,
the tensors it differs in and both values tell them which flag to change."""

from __future__ import annotations

from dataclasses import replace

import grpc
from handoff_client._architectures import contract_from_config
from handoff_client.protocol import errors
from handoff_client.protocol.contract import Contract, differences

QWEN3_NEXT = {
    "model_type": "qwen3_next", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "full_attention_interval": 4, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
}  # fmt: skip


def qwen(**options) -> Contract:
    return contract_from_config(QWEN3_NEXT, model="tiny-qwen3-next", **{"ctx": 1024, **options})


def test_equal_contracts_differ_in_nothing():
    assert differences(qwen(), qwen()) == []


def test_a_state_dtype_is_one_entry_naming_the_field_both_values_and_the_tensors_in_contract_order():
    broker, engine = qwen(state_dtype="bfloat16"), qwen(state_dtype="float32")
    memory = ", ".join(f"`layers.{i}.linear_attn.memory`" for i in range(3))
    assert differences(broker, engine, ("broker", "engine")) == [
        f"dtype bfloat16 at the broker, float32 at the engine ({memory})"
    ]


def test_each_field_that_differs_is_named_and_a_long_list_of_tensors_shortened():
    broker, caller = qwen(), qwen(ctx=2048, dtype="float32")
    found = differences(broker, caller)
    assert found[0] == "ctx 1024 at the broker, 2048 at the caller"
    assert "dtype bfloat16 at the broker, float32 at the caller (`layers.0.linear_attn.conv_q`" in found[1]
    assert found[1].endswith("more)")  # conv q, k, v of three layers and the attention's key and value
    assert found[2] == "rows 1024 at the broker, 2048 at the caller (`layers.3.self_attn.k_cache`, " \
                       "`layers.3.self_attn.v_cache`)"  # fmt: skip


def test_tensors_only_one_side_carries_and_their_order_are_named():
    full = qwen()
    fewer = replace(full, carried=full.carried[:-1])
    assert differences(full, fewer) == ["1 tensor(s) only at the broker (`layers.3.self_attn.v_cache`)"]
    assert differences(full, replace(full, carried=full.carried[::-1])) == ["the order of the tensors"]


def test_the_mismatch_says_what_differs_and_keeps_it_across_the_wire():
    broker, engine = qwen(state_dtype="bfloat16"), qwen(state_dtype="float32")
    error = errors.FingerprintMismatch(engine.model, broker.fingerprint, engine.fingerprint,
                                       differences(broker, engine), "start the broker with --config-state-dtype")  # fmt: skip
    assert error.message.startswith(f"tiny-qwen3-next: contract fingerprint mismatch. Broker: {broker.fingerprint}, "
                                    f"caller: {engine.fingerprint}; they differ in dtype bfloat16 at the broker, "
                                    "float32 at the caller (`layers.0.linear_attn.memory`")  # fmt: skip
    assert error.message.endswith("; start the broker with --config-state-dtype")
    status = errors.to_status(error)
    again = errors.from_status(grpc.StatusCode.FAILED_PRECONDITION, status.message, list(status.details))
    assert (type(again), again.message, again.fields) == (type(error), error.message, error.fields)
    assert again.fields["differences"].startswith("dtype bfloat16 at the broker, float32 at the caller")
    plain = errors.FingerprintMismatch("m", "aa", "bb")  # where the raiser has only the fingerprints, as before
    assert plain.message == ("m: contract fingerprint mismatch. Broker: aa, caller: bb; fetch the broker's contract "
                             "(GetContract) or deploy the same manifest on both sides")  # fmt: skip
