"""The contracts a broker serves: from a folder of manifests, or the embedded demo model.

A manifest is the design card's `to_json` form plus a top-level `model` and a `dtype` on each carried entry:
    {"model": "...", "ctx": N, "hidden": N, "carried": [{"name", "layer", "rows", "cols", "dtype"}, ...]}
Loading is all or nothing: a bad manifest stops the broker's start with a message naming the file and the field.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from handoff_client.protocol.errors import ManifestError

if TYPE_CHECKING:
    from handoff_client.protocol.contract import Contract

DEFAULT_MODEL = "demo-hybrid"


def default_contracts() -> dict[str, Contract]:
    """The embedded demo: a small hybrid model whose hand-off has every kind of carried tensor.

    Layers 0 and 2 are gated-delta (linear-attention) layers, as `contract-from-config` derives a Qwen3-Next of that
    size: the conv ring of the last kernel - 1 = 3 inputs, touched first, as conv_q, conv_k and conv_v (4 heads of 64
    channels each), then the recurrent memory (64 key dims by 4 value heads x 64 value dims, float32 as engines keep
    it), all split by head. Layers 1 and 3 are attention layers: a key then a value cache of ctx = 4096 rows by 2 KV
    heads x 64, bfloat16. Not rewindable: a real producer would push one token short (docs/contracts.md).
    """
    text = resources.files(__package__).joinpath("manifests", f"{DEFAULT_MODEL}.json").read_text()

    from handoff_client.protocol.contract import (
        Contract,  # (numpy and ml_dtypes: imported only when contracts are read)
    )

    contract = Contract.from_json(json.loads(text), source=f"<embedded {DEFAULT_MODEL}.json>")
    return {contract.model: contract}


def load_contracts(folder: Path) -> dict[str, Contract]:
    """Every `*.json` manifest in `folder`, by model; ManifestError on the first that is not a contract."""
    if not folder.is_dir():
        raise ManifestError(f"{folder}: not a folder of contract manifests")
    from handoff_client.protocol.contract import Contract

    contracts: dict[str, Contract] = {}
    sources: dict[str, Path] = {}
    for path in sorted(folder.glob("*.json")):
        contract = Contract.load(path)
        if contract.model in contracts:
            raise ManifestError(f"{path}: model: `{contract.model}` is already declared by {sources[contract.model]}")
        contracts[contract.model] = contract
        sources[contract.model] = path
    if not contracts:
        raise ManifestError(f"{folder}: holds no *.json manifest")
    return contracts
