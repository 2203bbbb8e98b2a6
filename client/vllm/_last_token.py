"""The last-token rule at vLLM's edge, and what a contract that cannot be rewound asks of the engine.

vLLM's decoder always computes the prompt's last token itself: a load that covers the whole prompt is cut back by one
(`Scheduler._update_waiting_for_remote_kv`: `num_computed_tokens = num_tokens - 1`). For attention caches that rewrites
one row with the same values. A contract that is not `rewindable` (handoff_client.protocol.contract: a recurrent state,
a conv ring, a sliding window's ring shorter than the context) cannot be run back: loading the state after N tokens and
running token N-1 again is silently wrong. So, as the contract states it (docs/contracts.md):

Producer: a request handed off (`do_remote_decode`) under such a contract has its prompt's last token dropped
before it is scheduled (`truncate`; vLLM's NIXL and Mooncake connectors do the same): the prefill computes N-1
tokens, the hand-off is at position N-1, the request's one sampled token is discarded by the router. Requests not
handed off run untouched. A request that cannot be truncated (a 1-token prompt, prompt embeddings, or one that
skips reading cached tokens, e.g. prompt logprobs, which a decoder recomputes whole) is not handed off at all.

Consumer: a hand-off at position N >= the prompt's N tokens under such a contract is refused (`load_refusal`):
logged, counted, and vLLM computes the prompt itself. Never loaded and rerun. `stops_short` and `load_refusal` are
the rule every engine adapter obeys, written once in handoff_client._handoff_rules; this module applies it to
vLLM's requests and engine.

Start-up (`check_engine`): what this connector cannot do exactly for such a contract is refused by name: speculative
decoding (its drafts' state slots), `mamba_cache_mode` other than "none" (prefix caching of recurrent state, states
at block boundaries), and prefix caching on a decode instance (a local hit plus a partial load).
"""

from __future__ import annotations

import logging
from typing import Any

from handoff_client._handoff_rules import load_refusal, stops_short
from handoff_client.protocol.contract import Contract

from ._groups import GroupMap, Kind

__all__ = ["TRUNCATED", "check_engine", "load_refusal", "stops_short", "truncate"]  # (the rules re-exported here)

logger = logging.getLogger(__name__)

TRUNCATED = "_handoff_truncated"
"""The `kv_transfer_params` key marking a request already cut short (a preempted request comes back: cut once)."""


def truncate(request: Any, hash_block_size: int | None = None) -> str | None:
    """Producer: drop the last prompt token of a request to be handed off under a contract that stops short, as
    NIXL's `_truncate_request_for_prefill` does (prompt_token_ids, _all_token_ids, num_prompt_tokens; max_tokens 1;
    on vLLM 0.34 also the block hashes over the dropped token, `truncate_block_hashes` by `hash_block_size`, the
    KV-cache config's). Idempotent (a marker in its kv_transfer_params). Returns None when done, else why the request
    cannot be cut (then it must not be handed off)."""
    params = request.kv_transfer_params
    if params.get(TRUNCATED):
        return None
    if request.prompt_token_ids is None:
        return "a prompt of embeddings, not token ids"
    if request.num_prompt_tokens < 2:
        return f"a prompt of {request.num_prompt_tokens} token(s)"
    skips = getattr(request, "get_skip_reading_prefix_cache", None)  # vLLM 0.32, 0.33; 0.34: skip_reading_external_kv
    if (skips is not None and skips()) or getattr(request, "skip_reading_external_kv", False) is True:
        return "a request that reads no cached tokens (prompt logprobs): its decoder recomputes it whole"
    del request.prompt_token_ids[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    if hash_block_size and hasattr(request, "truncate_block_hashes"):  # (no speculator: check_engine, so no lookahead)
        request.truncate_block_hashes(hash_block_size, 0)
    params[TRUNCATED] = True
    return None


def check_engine(vllm_config: Any, contract: Contract, groups: GroupMap, consumer: bool) -> None:
    """Refuse (ValueError, naming the setting) what the connector cannot do exactly for a contract that stops
    short; nothing for a rewindable one."""
    if not stops_short(contract):
        return
    why = "state" if groups.has_state else "a sliding window's ring"
    model = contract.model
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError(f"{model}: the handoff connector does not carry {why} under speculative decoding (its draft "
                         "slots and its lookahead change which state a hand-off holds); start without "
                         "--speculative-config")  # fmt: skip
    for plan in groups.layers.values():
        if plan.kind is Kind.STATE:
            mode = getattr(plan.spec, "mamba_cache_mode", "none")
            if mode != "none":
                raise ValueError(f"{model}: mamba_cache_mode {mode!r} (prefix caching of recurrent state) keeps "
                                 "states at block boundaries, which the handoff connector does not carry; start with "
                                 "--no-enable-prefix-caching (mamba_cache_mode 'none')")  # fmt: skip
            if getattr(plan.spec, "num_speculative_blocks", 0):
                raise ValueError(f"{model}: `{plan.layer}` keeps {plan.spec.num_speculative_blocks} speculative "
                                 "state slots, which the handoff connector does not carry")  # fmt: skip
    if consumer and getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        raise ValueError(f"{model}: a decode instance of a model with {why} loads a hand-off whole or not at all; "
                         "prefix caching would mix its own cached prefix with a loaded state: start it with "
                         "--no-enable-prefix-caching")  # fmt: skip
