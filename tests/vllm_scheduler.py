"""vLLM 0.32's real scheduler in this process, with the handoff connector's scheduler half loaded by vLLM itself
(`KVConnectorFactory`, from `kv_transfer_config`), stepped without a model: each step's `SchedulerOutput` is what
vLLM's scheduler made, and its model output gives each request that finished its scheduled tokens one sampled token.
So the connector meets vLLM's own scheduling (preemption, resumption, either model runner's way of sending resumed
requests) where no engine can run it: vLLM's V2 model runner, every GPU's default, needs Triton, which its CPU build
lacks, so `VllmConfig.use_v2_model_runner` answers as told while the scheduler is built, which reads it then.

No broker is needed: a producer's scheduler half only asks its target for its incarnation in the background
(_incarnations.py; none answers here, and its tickets name none). Needs vLLM's CPU build."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 1024, "tie_word_embeddings": False, "torch_dtype": "float32",
         "rms_norm_eps": 1e-5, "hidden_act": "silu"}  # fmt: skip
"""A tiny Llama's config.json: the scheduler reads the model's config, never its weights."""
MODEL = "tiny-sched"
SAMPLED = 7  # the token every step samples


@contextmanager
def answering(cls: type, name: str, value: bool) -> Iterator[None]:
    """vLLM reads property `name` of `cls` as `value` meanwhile (`VllmConfig.use_v2_model_runner`: V2 where Triton
    runs; `KVCacheConfig.needs_kv_cache_zeroing`: with Mamba layers or mixed-precision caches)."""
    saved = cls.__dict__[name]
    type.__setattr__(cls, name, property(lambda self: value))
    try:
        yield
    finally:
        type.__setattr__(cls, name, saved)


def scheduler(folder: Path, *, v2: bool, blocks: int, block: int = 16, role: str = "kv_both",
              zeroing: bool = False) -> Scheduler:  # fmt: skip
    """vLLM's scheduler of a tiny Llama with `blocks` KV blocks of `block` tokens (the first is vLLM's null block),
    its connector the handoff connector in `role`, built by vLLM as an engine builds it; `zeroing`: vLLM zeroes
    fresh blocks before use, as it does for caches with Mamba layers or mixed precisions."""
    model_dir = folder / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(LLAMA))
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=1024, dtype="float32",
                        served_model_name=MODEL)  # fmt: skip
    transfer = KVTransferConfig(kv_connector="HandoffConnector", kv_connector_module_path="handoff_client.vllm",
                                kv_role=role, kv_connector_extra_config={"target": "127.0.0.1:1"})  # fmt: skip
    config = VllmConfig(  # (its validation refuses V2 without Triton: the scheduler alone is told V2 below)
        model_config=model,
        cache_config=CacheConfig(block_size=block, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024, is_encoder_decoder=False
        ),
        kv_transfer_config=transfer,
    )
    config.cache_config.num_gpu_blocks = blocks
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LLAMA["num_hidden_layers"])]
    spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    with answering(VllmConfig, "use_v2_model_runner", v2), answering(KVCacheConfig, "needs_kv_cache_zeroing", zeroing):
        made = Scheduler(config, kv, StructuredOutputManager(config), block_size=block)
    assert made.use_v2_model_runner is v2
    return made


def request(request_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None) -> Request:
    """A request as vLLM's engine makes it, `kv_transfer_params` `params`."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                              extra_args={"kv_transfer_params": params} if params is not None else None)  # fmt: skip
    return Request(request_id, prompt, sampling, None)


def step(engine: Scheduler, late: bool = False) -> SchedulerOutput:
    """One step: vLLM schedules; each request whose scheduled tokens end its known tokens samples one; the step's
    loads end at once (`finished_recving`), as do the pushes of requests vLLM has finished (`finished_sending`), as
    a worker half reports them. `late`: those reports reach the scheduler a step later, as vLLM 0.33's fault
    tolerance replays a failed step's `KVConnectorOutput` at the next one."""
    output = engine.schedule()
    ids = list(output.num_scheduled_tokens)
    sampled = [[SAMPLED] if engine.requests[r].num_computed_tokens >= engine.requests[r].num_tokens else []
               for r in ids]  # fmt: skip
    meta = output.kv_connector_metadata
    held = set(getattr(engine, "_handoff_saved", set()))
    engine._handoff_saved = held | {save.request_id for save in meta.saves}
    released = held & set(output.finished_req_ids)
    engine._handoff_saved -= released
    transfers = KVConnectorOutput(finished_sending=released, finished_recving={load.request_id for load in meta.loads})
    if late:
        transfers, engine._handoff_late = getattr(engine, "_handoff_late", None), transfers
    result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
                               kv_connector_output=transfers)  # fmt: skip
    for outputs in engine.update_from_output(output, result).values():
        for out in outputs.outputs:
            if out.kv_transfer_params is not None:  # what the engine hands the router with the request's end
                PARAMS.setdefault(engine, {})[out.request_id] = out.kv_transfer_params
    return output


PARAMS: dict[Scheduler, dict[str, dict]] = {}
"""Each scheduler's finished requests' `kv_transfer_params` (`step`), by request id."""
