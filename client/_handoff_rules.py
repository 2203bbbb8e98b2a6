"""What every engine adapter obeys, written once: the vLLM connector (handoff_client.vllm) and the transformers
adapter (handoff_client.transformers) both call these, so two engines meet on the same rules.

    which rows        a tensor whose rows are positions carries the rows the prompt filled (Contract.at; the
                      contract's own rule, protocol/contract.py)
    the N - 1 rule    a contract that is not rewindable (recurrent state, a window's ring shorter than the cache)
                      is handed off one token short: a producer pushes the state after N - 1 of a prompt's N tokens,
                      a consumer never loads a hand-off of all N tokens and then runs token N - 1 again
                      (`handoff_position`, `stops_short`, `load_refusal`; docs/contracts.md, the last-token rule)
    the window's rows a ring of R rows after `rows` tokens holds positions [rows - R, rows), position p at row p mod R
                      (`window_rows`: where the ring starts, and the roll that puts it in position order)
    the digest        a hand-off names its prompt: `prompt_digest` (handoff_client.protocol.prompts, the one
                      implementation) of the first `position` tokens ends its id, and a consumer loads it only into
                      a prompt with the same digest (`params_refusal`)
    the params        what a producer hands the router, and a consumer takes as they are (`transfer_params`)

Nothing here imports an engine: an adapter holds its engine's layout knowledge, these rules hold for all of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from .protocol.contract import Contract
from .protocol.limits import MAX_HANDOFF_ID
from .protocol.prompts import prompt_digest

__all__ = ["handoff_id", "handoff_position", "load_refusal", "params_refusal", "prompt_digest", "stops_short",
           "transfer_params", "window_rows"]  # fmt: skip


def stops_short(contract: Contract) -> bool:
    """Whether the producer of `contract` hands off N - 1 of a prompt's N tokens (the contract is not rewindable)."""
    return not contract.rewindable


def handoff_position(contract: Contract, prompt_tokens: int) -> int | None:
    """The position a producer hands a prompt of `prompt_tokens` tokens off at: N - 1 under a contract that stops
    short, else N; None for a prompt of fewer than 2 tokens, which has nothing to hand over (the decoder computes
    the prompt's last token itself)."""
    if prompt_tokens < 2:
        return None
    return prompt_tokens - 1 if stops_short(contract) else prompt_tokens


def load_refusal(contract: Contract, position: int, prompt_tokens: int) -> str | None:
    """Consumer: why a hand-off at `position` must not be loaded into a request of `prompt_tokens` tokens under
    `contract` by the last-token rule (None: it may)."""
    if stops_short(contract) and position >= prompt_tokens:
        return (
            f"the hand-off holds the state after all {position} tokens of a {prompt_tokens}-token prompt, and the "
            f"decoder computes the last prompt token again after a load (vLLM's always does); {contract.model}'s "
            "contract cannot be rewound (recurrent state or a sliding window's ring), so its producer must stop one "
            "token short (the last-token rule)"
        )
    return None


def window_rows(rows: int, ring: int) -> tuple[int, int]:
    """A ring of `ring` rows after `rows` tokens: (the first position it holds, the roll that puts its rows in
    position order). It holds positions [max(0, rows - ring), rows), position p at row p mod ring; once wrapped
    (rows > ring), `np.roll(ring_rows, -shift)` is oldest first and `np.roll(oldest_first, shift)` the ring."""
    if rows <= ring:
        return 0, 0
    return rows - ring, rows % ring


def handoff_id(request: str, digest: str) -> str:
    """A hand-off's id: the producer's request id, then its prompt's digest, so an id names one prompt's state.
    Where that is more than the broker takes (MAX_HANDOFF_ID printable characters: vLLM takes request ids from the
    client's `X-Request-Id`), the request id is replaced by a BLAKE2b-128 of it, `h{32 hex}-{digest}`: still unique,
    still ending with the digest, and pushable."""
    whole = f"{request}-{digest}"
    if len(whole) <= MAX_HANDOFF_ID and whole.isprintable():
        return whole
    named = hashlib.blake2b(request.encode("utf-8", "surrogatepass"), digest_size=16)
    return f"h{named.hexdigest()}-{digest}"


def transfer_params(handoff: str, position: int, model: str, ticket: str, digest: str) -> dict[str, Any]:
    """The `kv_transfer_params` a producer returns, which a router passes to a decode instance as they are
    (docs/vllm.md, the router contract)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "handoff_id": handoff,
        "position": position,
        "model": model,
        "ticket": ticket,
        "prompt_digest": digest,
    }


def params_refusal(contract: Contract, params: Mapping[str, Any], prompt_tokens: int | None,
                   digest_of: Callable[[int], str] | None = None) -> str | None:  # fmt: skip
    """Why the hand-off `params` name must not be loaded into a request of `prompt_tokens` prompt tokens (None: it
    may), as every consumer checks it: a position that is not a token count or exceeds the prompt, the last-token
    rule, a digest that is not the prompt's own (`digest_of(n)`: the request's digest of its first n tokens, by
    `prompt_digest`), an id that does not end with its digest. Params without a `prompt_digest` (earlier routers),
    or a consumer that does not know the prompt (`prompt_tokens` None), are not refused for it: the caller says so."""
    position = params.get("position")
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        return f"kv_transfer_params position {position!r} is not a token count"
    if prompt_tokens is None:
        return None
    if position > prompt_tokens:
        return f"the hand-off holds {position} tokens, more than the request's prompt of {prompt_tokens}"
    if (why := load_refusal(contract, position, prompt_tokens)) is not None:
        return why
    digest = params.get("prompt_digest")
    if digest is None or digest_of is None:
        return None
    own = digest_of(position)
    if digest != own:
        return (
            f"prompt digest mismatch: the hand-off is of a prompt with digest {digest}, the request's first "
            f"{position} tokens have {own} (a router that swapped two requests' params, or a reused id)"
        )
    if not str(params.get("handoff_id")).endswith(f"-{digest}"):
        return f"the hand-off id does not end with its prompt digest {digest}"
    return None
