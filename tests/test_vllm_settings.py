"""The connector's contract name, decided against vLLM's own config objects (no engine: a VllmConfig is what the
connector is given, and building one reads only the model's config.json)."""

from __future__ import annotations

from pathlib import Path

import pytest
from handoff_client.vllm._settings import ConnectorSettings, served_contract


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """vLLM's config of a tiny Llama, as an offline `LLM(model=PATH)` given no served_model_name builds it."""
    from transformers import LlamaConfig
    from vllm.config import ModelConfig, VllmConfig

    folder = tmp_path_factory.mktemp("model") / "tiny-llama"
    LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024).save_pretrained(folder)  # fmt: skip
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, max_model_len=1024, dtype="bfloat16")
    return VllmConfig(model_config=model)


def test_a_model_vllm_names_by_its_path_is_refused_naming_the_connector_setting(vllm_config):
    """vLLM names a model by its path when no served_model_name is given; no contract is named so. The refusal names
    the path and the setting that fixes it, not a `--model` flag (in vLLM that is the model's path)."""
    path = vllm_config.model_config.served_model_name
    assert Path(path).is_dir()  # what vLLM itself chose, checked: the premise of the test
    with pytest.raises(ValueError) as refused:
        served_contract(vllm_config, ConnectorSettings.from_extra_config({"target": "127.0.0.1:1"}))
    assert repr(path) in str(refused.value) and "kv_connector_extra_config's `model`" in str(refused.value)
    assert "--model" not in str(refused.value)


def test_the_connector_setting_names_the_contract(vllm_config):
    settings = ConnectorSettings.from_extra_config({"target": "127.0.0.1:1", "model": "tiny-llama"})
    contract = served_contract(vllm_config, settings)
    assert contract.model == "tiny-llama" and contract.ctx == 1024


@pytest.mark.parametrize(("given", "chosen"), [(True, True), ("false", False), (False, False), (None, True)])
def test_push_while_copying_is_true_or_false_and_true_unless_said(given, chosen):
    extra = {"target": "127.0.0.1:1"} | ({} if given is None else {"push-while-copying": given})
    assert ConnectorSettings.from_extra_config(extra).push_while_copying is chosen


@pytest.mark.parametrize("given", ["yes", "auto", 1, 0.5, None])
def test_push_while_copying_refuses_anything_else_naming_the_setting(given):
    with pytest.raises(ValueError, match=r"push-while-copying is .*; it takes true or false"):
        ConnectorSettings.from_extra_config({"push-while-copying": given})


@pytest.mark.parametrize(("key", "given"), [("timeout", 0), ("timeout", -1), ("timeout", "nan"), ("timeout", "inf"),
                                            ("timeout", True), ("timeout", "soon"), ("timeout", 1e9), ("ttl", -5),
                                            ("ttl", float("nan")), ("ttl", None)])  # fmt: skip
def test_a_timeout_or_ttl_that_is_not_a_bounded_number_of_seconds_is_refused_naming_it(key, given):
    with pytest.raises(ValueError, match=rf"{key} is .*; it takes seconds, .*, at most 86400"):
        ConnectorSettings.from_extra_config({key: given})


def test_timeout_and_ttl_take_seconds_as_numbers_or_strings():
    settings = ConnectorSettings.from_extra_config({"timeout": "2.5", "ttl": 0})
    assert (settings.timeout, settings.ttl) == (2.5, 0.0)


@pytest.mark.parametrize(("runner", "within"), [("1", True), ("0", False)])
def test_the_producer_copies_within_the_step_exactly_where_vllm_runs_its_v2_model_runner(
    vllm_config, monkeypatch, runner, within
):
    """vLLM's V2 runner writes reallocated pages before handle_preemptions; its V1 runner does not (the CPU build's)."""
    from handoff_client.vllm._worker import reuses_pages_before_preemptions

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    assert vllm_config.use_v2_model_runner is within  # (vLLM's own reading of it)
    assert reuses_pages_before_preemptions(vllm_config) is within
