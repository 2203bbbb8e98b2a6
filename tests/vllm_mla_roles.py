"""tests/vllm_roles.py's vLLM instance for the MLA tests: `python tests/vllm_mla_roles.py ROLE MODEL_DIR SETTINGS.json`,
the same roles, settings and session commands, with vLLM's CPU MLA backend (CPU_MLA: block 16, no chunked prefill,
no prefix caching, forced by vLLM itself), `max_num_seqs` 4 unless given, and `dtype` float32 unless given.

Besides them, the session takes {"op": "latents", "path": FILE}: it saves (torch.save) the latent rows vLLM's own
MLA decode read since the previous such command, and forgets them. They are recorded where CPU_MLA's decode reads
them: `CPUMLAImpl.forward_mqa` is wrapped (in this process, where vLLM's worker runs: the uni executor) to copy, for
each decode request of the batch, the rows `kv_c_and_k_pe_cache[block_table[b, t // N], t % N]` for t < seq_lens[b],
by the block table and sequence lengths vLLM hands its decode kernel, before the kernel runs. Saved as
{"LAYER|SEQ_LEN": (seq_len, kv_lora_rank + qk_rope_head_dim) tensor}, the first read of each layer at each length.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm_roles

READ: dict[str, object] = {}  # "layer|seq_len" -> the rows CPU_MLA's decode read, the first time


def record_decode_reads() -> None:
    """Wrap CPU_MLA's decode (forward_mqa) to copy the latent rows it is about to read (module docstring)."""
    import torch
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    forward_mqa = CPUMLAImpl.forward_mqa

    def recording(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        decode = attn_metadata.decode
        block = kv_c_and_k_pe_cache.shape[-2]
        for b, n in enumerate(decode.seq_lens.tolist()):
            key = f"{layer.layer_name}|{n}"
            if key not in READ:
                t = torch.arange(n)
                READ[key] = kv_c_and_k_pe_cache[decode.block_table[b, t // block].long(), t % block].clone()
        return forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)

    CPUMLAImpl.forward_mqa = recording


def start(role: str, model_dir: str, settings: dict):
    from vllm import LLM

    kv_transfer = None
    if role != "plain":
        kv_transfer = {
            "kv_connector": "HandoffConnector",
            "kv_connector_module_path": "handoff_client.vllm",
            "kv_role": vllm_roles.ROLES[role],
            "kv_connector_extra_config": dict(settings["extra"]),
            "kv_load_failure_policy": "recompute",
        }
    record_decode_reads()
    return LLM(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True, distributed_executor_backend="uni",
        num_gpu_blocks_override=64, max_model_len=settings.get("max_model_len", 512),
        max_num_seqs=settings.get("max_num_seqs", 4), dtype=settings.get("dtype", "float32"),
        kv_cache_memory_bytes=settings["kv_cache_bytes"], kv_transfer_config=kv_transfer,
    )  # fmt: skip


def session(llm, start_seconds: float) -> None:
    import torch

    print(json.dumps({"ready": True, "start_seconds": start_seconds}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "generate":
            transfers = command.get("params") or [None] * len(command["prompts"])
            answer = vllm_roles.generate(llm, command["prompts"], transfers, command["max_tokens"])
        elif command["op"] == "latents":
            torch.save(dict(READ), command["path"])
            answer = {"saved": len(READ)}
            READ.clear()
        else:
            break
        print(json.dumps(answer), flush=True)
    os._exit(0)


if __name__ == "__main__":
    vllm_roles.start = start
    vllm_roles.session = session
    vllm_roles.main(*sys.argv[1:4])
