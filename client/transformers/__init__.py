"""Hugging Face transformers as a prefill or decode engine of the broker: the second engine beside vLLM, meeting it
through the model's contract (docs/engines.md).

    params = prefill(client, model, prompt_ids, model_name="tiny-llama")     # push; vLLM's decoder takes params
    cache = load(client, params, model, prompt_ids=prompt_ids)                # pull a hand-off (vLLM's or prefill's)
    model.generate(torch.tensor([prompt_ids]), past_key_values=cache, ...)   # computes only what cache lacks
    report = audit(client, params, model, prompt_ids)                         # report.ok, report.first_bad

Both sides follow the rules every adapter follows (handoff_client._handoff_rules, the same code the vLLM connector
calls): a contract that cannot be rewound is handed off one token short, a 1-token prompt makes no hand-off, a
window's ring crosses in ring order, and a hand-off names its prompt by digest. `prefill` returns the
`kv_transfer_params` a vLLM decode instance with the handoff connector takes as they are; `load` checks what vLLM's
consumer checks (the model's contract by fingerprint, the position, the prompt's digest) and refuses by name what it
cannot load exactly (LoadRefused).

The model's contract is the broker's (`client.get_contract(name)`), and the model must derive the same one from its
own config (`contract_from_config` in the broker's dtypes): else FingerprintMismatch, naming the first tensor that
differs. Batch 1; CPU or any device the model is on. torch and transformers are imported here only: the client does
not need them (`pip install '.[transformers]'`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from .._handoff_rules import handoff_id as make_id
from .._handoff_rules import handoff_position, params_refusal, prompt_digest, stops_short, transfer_params
from .._torch import from_numpy, to_numpy
from ..protocol.contract import Contract
from ._audit import AuditReport
from ._layout import read_cache, torch_dtype, write_cache
from ._model import LoadRefused, contract_for, new_cache, run_prompt

__all__ = ["AuditReport", "LoadRefused", "audit", "contract_for", "load", "prefill", "run_prompt"]


def prefill(client: Any, model: Any, prompt_ids: Sequence[int], *, model_name: str, handoff_id: str | None = None,
            ttl: float | None = None, timeout: float | None = None) -> dict[str, Any] | None:  # fmt: skip
    """Run the prompt through `model` and push its carried state under `model_name`'s contract; the
    `kv_transfer_params` a vLLM decode instance (kv_consumer) takes as they are. The state is the one after N - 1 of
    the prompt's N tokens where the contract cannot be rewound, else after N (handoff_position); a prompt of one
    token makes no hand-off (None). The id is `handoff_id` (else a random one) then the prompt's digest."""
    contract = contract_for(client, model, model_name)
    prompt = list(prompt_ids)
    position = handoff_position(contract, len(prompt))
    if position is None:
        return None
    digest = prompt_digest(prompt[:position])
    name = make_id(handoff_id or f"transformers-{uuid.uuid4().hex}", digest)
    tensors = read_cache(run_prompt(model, prompt[:position]), contract, position)
    pushed = client.push(model_name, name, position, {n: to_numpy(t) for n, t in tensors.items()},
                         ttl=ttl, timeout=timeout)  # fmt: skip
    return transfer_params(name, position, model_name, pushed.ticket, digest)


def _kv_heads(model: Any) -> int:
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def checked_params(contract: Contract, params: Mapping[str, Any], prompt_ids: Sequence[int] | None) -> int:
    """The position `params` name, once they are shown loadable into `prompt_ids` (LoadRefused, naming why: what
    vLLM's consumer checks, _handoff_rules.params_refusal)."""
    if params.get("model", contract.model) != contract.model:
        raise LoadRefused(f"the params name model {params.get('model')!r}, the model's contract is {contract.model}")
    if "handoff_id" not in params:
        raise LoadRefused(f"{contract.model}: kv_transfer_params without a handoff_id name no hand-off")
    prompt = None if prompt_ids is None else list(prompt_ids)
    digest_of = None if prompt is None else (lambda n: prompt_digest(prompt[:n]))
    if (why := params_refusal(contract, params, None if prompt is None else len(prompt), digest_of)) is not None:
        raise LoadRefused(f"{contract.model}: hand-off {params['handoff_id']} not loaded: {why}")
    return int(params["position"])


def held_tokens(contract: Contract, position: int, prompt_ids: Sequence[int] | None) -> int:
    """How many tokens a loaded cache holds: all `position` where the contract cannot be rewound (its producer
    stopped short); else one fewer than the prompt where the hand-off covers it all (transformers' generate, given a
    cache covering the whole prompt, reruns its last token and appends a second row), and without the prompt one
    fewer than the position (a rewindable cache may always be cut back)."""
    if stops_short(contract):
        return position
    if prompt_ids is None:
        return max(position - 1, 0)
    return min(position, len(prompt_ids) - 1)


def load(client: Any, kv_transfer_params: Mapping[str, Any], model: Any, *, prompt_ids: Sequence[int] | None = None,
         timeout: float | None = None) -> Any:  # fmt: skip
    """Pull the hand-off the params name (from vLLM's producer or from `prefill`; from the broker their ticket names,
    if any) into a fresh transformers cache, so that `model.generate(prompt, past_key_values=cache)` continues the
    prompt exactly, computing only what the cache does not hold (`held_tokens`). With `prompt_ids` the prompt's
    digest and the last-token rule are checked as vLLM's consumer checks them; without, only the model, the
    position and the id. LoadRefused (naming why) where it cannot load exactly: before the pull, leaving the
    hand-off in the broker; a hand-off whose own position is not its params' is refused once pulled (it is
    misnamed: no prompt can load it as they say)."""
    params = dict(kv_transfer_params)
    contract = contract_for(client, model, str(params.get("model", "")))
    position = checked_params(contract, params, prompt_ids)
    handoff = client.pull(contract.model, str(params["handoff_id"]), ticket=params.get("ticket"), timeout=timeout)
    if handoff.position != position:  # (known only once pulled: a hand-off its params misname is not loadable)
        raise LoadRefused(f"{contract.model}: hand-off {params['handoff_id']} is at position {handoff.position}, its "
                          f"params say {position}; nothing loaded")  # fmt: skip
    held = held_tokens(contract, position, prompt_ids)
    cache = new_cache(model)
    state = {name: from_numpy(array) for name, array in handoff.state.items()}
    heads = {c.layer: c.heads or _kv_heads(model) for c in contract.carried}  # each layer's own, as the contract says
    write_cache(cache, contract, position, held, state, heads, model.dtype, model.device)
    return cache


def audit(client: Any, kv_transfer_params: Mapping[str, Any], model: Any, prompt_ids: Sequence[int], *,
          producer: str = "vllm", timeout: float | None = None) -> AuditReport:  # fmt: skip
    """Compare every carried tensor of the hand-off the params name with what `model` computes for the prompt,
    reading it without a claim, so its decoder is untouched: an AuditReport (`ok`, `first_bad`, each tensor's
    errors and tolerance, notes; _audit.py has the tolerances by dtype and producing engine)."""
    from ._audit import audit as run

    return run(client, kv_transfer_params, model, prompt_ids, producer=producer, timeout=timeout)


__all__ += ["checked_params", "held_tokens", "new_cache", "torch_dtype"]
