"""Tensor parallelism at vLLM's edge: which rank of which TP size this worker is, which part of a hand-off it pushes
and pulls, and a start-up check that vLLM gives this rank exactly the KV heads the broker thinks it holds.

Each prefill rank r of t pushes `shard=(r, t)`: its own heads of every split tensor (a replicated head only by the first
rank holding it, the tensors not split only by rank 0); a rank with nothing of its own still pushes its empty part,
since the broker makes a hand-off pullable only once every rank has pushed. Each decode rank q of d pulls `shard=(q, d)`
and gets its heads whatever TP size pushed (the broker reshards: docs/client.md, "Tensor-parallel engines").

The check: the broker's rule (`handoff_client.protocol.shards.held_heads`: rank r of t holds heads [r·H/t, (r+1)·H/t),
or head r·H/t when H < t and vLLM replicates) is compared, at start-up, with what vLLM's own weight loader gives the
rank. A one-channel-per-head `QKVParallelLinear` (vLLM's class, a few floats) is built in the worker, head i's key
weight is set to i through vLLM's `weight_loader`, and the rank's key rows are read back: the heads vLLM's model loads
on this rank. Any difference refuses start-up, naming the heads on each side: a wrong head is wrong tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from handoff_client.protocol.contract import Contract
from handoff_client.protocol.shards import Shard, held_heads, view


def tp_shard() -> Shard:
    """This worker's rank and TP size, from vLLM's own parallel state."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return Shard(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())


def vllm_kv_heads(vllm_config: Any, total_kv_heads: int, shard: Shard) -> tuple[int, ...]:
    """The KV heads (of `total_kv_heads`) vLLM's weight loader gives rank `shard.rank`, learned by loading an
    index-coded key weight into a tiny QKVParallelLinear."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import QKVParallelLinear

    with set_current_vllm_config(vllm_config), torch.device("cpu"):
        layer = QKVParallelLinear(hidden_size=1, head_size=1, total_num_heads=shard.size,
                                  total_num_kv_heads=total_kv_heads, bias=False, params_dtype=torch.float32,
                                  prefix="handoff_connector.tp_probe")  # fmt: skip
        coded = torch.arange(total_kv_heads, dtype=torch.float32).reshape(total_kv_heads, 1)
        layer.weight_loader(layer.weight, coded, "k")
        rows = layer.weight.data[layer.num_heads : layer.num_heads + layer.num_kv_heads, 0]
    return tuple(int(head) for head in rows.tolist())


def check_kv_heads(vllm_config: Any, contract: Contract, shard: Shard) -> None:
    """Refuse (ValueError, naming both) if vLLM gives this rank other KV heads than the broker's rule says (for the
    attention caches: vLLM's QKV projection is what replicates heads)."""
    caches = [c for c in contract.carried if c.heads and c.name.endswith(("k_cache", "v_cache"))]
    for total in sorted({c.heads for c in caches}):
        carried = next(c for c in caches if c.heads == total)
        first, end = held_heads(contract.model, carried, shard)  # ShardLayout where the TP size cannot share them
        ours = tuple(range(first, end))
        try:
            theirs = vllm_kv_heads(vllm_config, total, shard)
        except Exception as e:  # what cannot be checked is refused
            raise ValueError(f"{contract.model}: could not learn which of {total} KV heads vLLM gives TP {shard}: "
                             f"{e!r}; refusing rather than guess") from e  # fmt: skip
        if theirs != ours:
            raise ValueError(f"{contract.model}: at TP {shard}, vLLM loads KV heads {list(theirs)} of {total} but "
                             f"the broker would hand this rank heads {list(ours)}; refusing a wrong copy")  # fmt: skip


def rank_contracts(contract: Contract, shard: Shard) -> tuple[Contract, frozenset[str]]:
    """This rank's view of the contract (the tensors it holds, at its own shapes) and the names it pushes."""
    holds = view(contract, shard, pushing=False)
    pushed = view(contract, shard, pushing=True)
    return holds, frozenset(c.name for c in pushed.carried)
