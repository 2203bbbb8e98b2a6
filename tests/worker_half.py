"""A vLLM connector's worker half for a dense-attention contract, given its layers as `register_kv_caches` gives an
engine's (each layer's group and kind from `group_map`, a FLASH_ATTN page layout per layer, every tensor pushed at
TP 1, or a given rank's part) without an engine, which only a vLLM start-up builds: for tests of what the worker
does between vLLM's calls and a real broker (tests/test_vllm_idle_wait.py, tests/test_vllm_producer.py). Needs torch
and vLLM."""

from __future__ import annotations

import torch
from handoff_client.protocol.contract import Contract
from handoff_client.protocol.shards import Shard
from handoff_client.vllm import _worker
from handoff_client.vllm._groups import group_map
from handoff_client.vllm._layouts import Geometry
from handoff_client.vllm._movers import AttentionMover
from handoff_client.vllm._pages import FlashLayout
from handoff_client.vllm._settings import ConnectorSettings
from handoff_client.vllm._tp import rank_contracts


def attention_worker(
    contract: Contract,
    settings: ConnectorSettings,
    *,
    kv_heads: int,
    head_dim: int,
    block: int,
    blocks: int,
    shard: Shard | None = None,
) -> _worker.WorkerHalf:
    """The worker half of an engine of `contract`'s layers (`model.layers.{i}.self_attn.attn`), its pages zero;
    `shard`: a tensor-parallel rank's, holding and pushing its part (`kv_heads` is then the rank's)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    layers = sorted({c.layer for c in contract.carried})
    names = [f"model.layers.{i}.self_attn.attn" for i in layers]
    spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads, head_size=head_dim, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    half = _worker.WorkerHalf(settings, contract, None, config)
    whole = (contract, frozenset(c.name for c in contract.carried))
    holds, half.pushed = rank_contracts(contract, shard) if shard else whole
    half.shard = shard
    half.groups = group_map(config, holds)
    half.layer_of = half.groups.layer_of
    for name, plan in half.groups.layers.items():
        half.pages[name] = torch.zeros(blocks, kv_heads, block, 2 * head_dim)
        half.movers[name] = AttentionMover(plan, FlashLayout(Geometry(kv_heads, head_dim, block), "FLASH_ATTN"))
    return half
