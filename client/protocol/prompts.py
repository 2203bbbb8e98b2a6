"""Which prompt a hand-off belongs to: the prompt digest every engine adapter computes the same way.

`prompt_digest` is THE one implementation, for every engine on either side of a hand-off: the vLLM connector
(handoff_client.vllm: its producer puts the digest in `kv_transfer_params["prompt_digest"]` and at the end of the
hand-off id, its consumer loads only params whose digest is its own request's) and any other engine adapter, e.g. the
Hugging Face transformers adapter (client/transformers/, issue #36), which calls
`handoff_client.protocol.prompts.prompt_digest` to make params a vLLM decoder accepts, or to check a vLLM
producer's. Never compute it anywhere else: a second copy that drifts is a hand-off loaded into the wrong prompt, or
every hand-off refused.

What it covers is what makes two prompts' KV differ: the token ids, and where the engine has them, the multimodal
items placed among the first tokens (their content hash and placeholder), the adapter (LoRA) and the cache salt.
A text-only prompt with no adapter and no salt digests its token ids alone, BLAKE2b-64 of them as little-endian
int64, in hex: an engine that knows nothing but the prompt's ids computes the same digest (and so the digest of
today's params is unchanged). Imports nothing of the broker's; numpy only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

Multimodal = tuple[str, int, int]
"""A multimodal item of the prompt: (its content hash, the offset of its first placeholder token, its length)."""

EXTRAS_PERSON = b"handoff-prompt1"
"""BLAKE2b's personalization when a digest covers more than token ids: such a digest never equals a token-only one
(increment the digit if the extras' encoding ever changes)."""


def prompt_digest(
    token_ids: Sequence[int],
    *,
    multimodal: Sequence[Multimodal] = (),
    adapter: str | None = None,
    cache_salt: str | None = None,
) -> str:
    """The digest of a prompt's first `len(token_ids)` tokens (16 hex characters): equal inputs give equal digests
    on every host and engine, any other input a different one (but for 2^-64).

    `token_ids`: the prompt's first tokens, the hand-off's `position` of them. `multimodal`: the prompt's multimodal
    items (content hash, placeholder offset, length); those whose placeholder starts at or past `len(token_ids)` are
    not in the hand-off and are left out, the rest are covered in offset order. `adapter`: the LoRA adapter's name
    (None: the base model). `cache_salt`: the request's cache salt (None or "": none). With none of the three it
    is BLAKE2b-64 of the token ids as little-endian int64, nothing else."""
    ids = np.asarray(token_ids, dtype="<i8").tobytes()
    held = sorted((int(offset), int(length), str(identifier)) for identifier, offset, length in multimodal
                  if int(offset) < len(token_ids))  # fmt: skip
    if not held and adapter is None and not cache_salt:
        return hashlib.blake2b(ids, digest_size=8).hexdigest()
    extras = json.dumps({"mm": held, "adapter": adapter, "salt": cache_salt or None}, separators=(",", ":"))
    digest = hashlib.blake2b(ids, digest_size=8, person=EXTRAS_PERSON)
    digest.update(len(ids).to_bytes(8, "little"))  # (where the ids end: no extras can pass for tokens)
    digest.update(extras.encode())
    return digest.hexdigest()
