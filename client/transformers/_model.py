"""The transformers model as this adapter meets it: its contract checked against the broker's, its forward pass
(`cache=` in transformers 5.25, `past_key_values=` in 5.19), a fresh cache laid out by its config, and its own cache
after a prompt (the reference `load` and `audit` are held to)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from .._architectures import contract_from_config
from ..protocol.contract import Contract, differences
from ..protocol.errors import FingerprintMismatch
from ._layout import refusal

NAMES = ("broker", "transformers model")  # whose each value is, in a FingerprintMismatch's differences


class LoadRefused(ValueError):
    """A hand-off this adapter will not load (or a model it cannot carry), and why: it would not continue the
    prompt exactly."""


def _dtypes(contract: Contract) -> tuple[str, str]:
    """The contract's cache dtype and recurrent-state dtype, as contract_from_config takes them."""
    cache = next((c.dtype for c in contract.carried if not c.name.endswith((".memory", ".ssm"))), "bfloat16")
    state = next((c.dtype for c in contract.carried if c.name.endswith((".memory", ".ssm"))), "float32")
    return cache, state


def contract_for(client: Any, model: Any, name: str) -> Contract:
    """The broker's contract `name`, once the transformers model is shown to derive the same one from its config
    (FingerprintMismatch naming both fingerprints and every field that differs, with both values), and to be one this adapter
    carries (LoadRefused naming the tensor)."""
    contract = client.get_contract(name)
    cache, state = _dtypes(contract)
    own = contract_from_config(model.config.to_dict(), ctx=contract.ctx, dtype=cache, state_dtype=state, model=name)
    if own.fingerprint != contract.fingerprint:  # (every field that differs named, as the vLLM connector names them)
        raise FingerprintMismatch(name, contract.fingerprint, own.fingerprint, differences(contract, own, NAMES))
    if (why := refusal(contract)) is not None:
        raise LoadRefused(why)
    return contract


def _forward(model: Any, ids: torch.Tensor, cache: Any) -> Any:
    """One forward pass filling `cache`: `cache=` where the model takes it (transformers 5.25), else
    `past_key_values=` (5.19)."""
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {"cache" if "cache" in params else "past_key_values": cache}
    if "use_cache" in params:
        kwargs["use_cache"] = True
    with torch.no_grad():
        return model(ids.to(model.device), **kwargs)


def new_cache(model: Any) -> Any:
    """A fresh cache laid out by the model's own config (sliding windows, linear-attention layers)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def run_prompt(model: Any, prompt_ids: Sequence[int]) -> Any:
    """transformers' own cache after `prompt_ids` (the reference `load` and `audit` are held to)."""
    cache = new_cache(model)
    if prompt_ids:
        _forward(model, torch.tensor([list(prompt_ids)]), cache)
    return cache
