"""tests/vllm_roles.py's vLLM instance for the MLA tests: `python tests/vllm_mla_roles.py ROLE MODEL_DIR SETTINGS.json`,
the same roles, settings and session commands, with vLLM's CPU MLA backend asked by name (CPU_MLA: block 16, no
chunked prefill, no prefix caching, forced by vLLM itself; on a CPU with AMX tiles vLLM would pick AMX_MLA, which takes
bfloat16 alone and whose pages the connector refuses: docs/vllm.md#cpus), `max_num_seqs` 4 unless given, `dtype`
float32 unless given, and `tp` (1: the uni executor; more: vLLM's `mp` executor, one worker process a rank).

Besides vllm_roles.py's session commands, the session takes {"op": "latents"}: it answers with the latent rows vLLM's
own MLA decode read, on every TP rank, since the previous such command, saved under the folder in HANDOFF_TEST_MLA_READS
(one torch.save file each: {"RANK|LAYER|SEQ_LEN": file}), and forgets them. They are recorded where CPU_MLA's decode
reads them: `CPUMLAImpl.forward_mqa` is wrapped, in every process this module is imported into (this one, and each TP
worker vLLM spawns, which imports it as its main module), to copy, for each decode request of the batch, the rows
`kv_c_and_k_pe_cache[block_table[b, t // N], t % N]` for t < seq_lens[b], by the block table and sequence lengths vLLM
hands its decode kernel, before the kernel runs: a (seq_len, kv_lora_rank + qk_rope_head_dim) tensor, the first read of
each layer at each length since the last collection.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm_roles

READS = os.environ.get("HANDOFF_TEST_MLA_READS")  # the folder the recorder saves into (none: no recording)


def record_decode_reads(folder: str) -> None:
    """Wrap CPU_MLA's decode (forward_mqa) to save the latent rows it is about to read (module docstring)."""
    import torch
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    forward_mqa = CPUMLAImpl.forward_mqa

    def recording(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        decode = attn_metadata.decode
        block = kv_c_and_k_pe_cache.shape[-2]
        rank = get_tensor_model_parallel_rank()
        for b, n in enumerate(decode.seq_lens.tolist()):
            path = Path(folder) / f"{rank}|{layer.layer_name}|{n}.pt"
            if not path.exists():  # the first read at this length since the last collection
                t = torch.arange(n)
                rows = kv_c_and_k_pe_cache[decode.block_table[b, t // block].long(), t % block]
                torch.save(rows.clone(), path.with_suffix(".tmp"))
                path.with_suffix(".tmp").rename(path)
        return forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)

    CPUMLAImpl.forward_mqa = recording


if READS:  # at import: in this process and in every TP worker process vLLM spawns (it imports this module as main)
    record_decode_reads(READS)


def engine_arguments(settings: dict) -> dict:
    """The MLA instances' LLM arguments beside vllm_roles.start's (module docstring)."""
    return {
        "num_gpu_blocks_override": 64, "max_model_len": settings.get("max_model_len", 512),
        "max_num_seqs": settings.get("max_num_seqs", 4), "dtype": settings.get("dtype", "float32"),
        "attention_backend": "CPU_MLA",  # on every CPU: with AMX tiles vLLM picks AMX_MLA unless asked (module doc)
    }  # fmt: skip


def latents(command: dict) -> dict:
    """The session's latents command: the files saved since the last one, by "RANK|LAYER|SEQ_LEN", forgotten here
    (the step that read them has ended: every file is complete)."""
    saved = Path(READS).glob("*.pt")
    return {path.stem: str(path.rename(path.with_suffix(".read"))) for path in saved}


if __name__ == "__main__":
    vllm_roles.main(*sys.argv[1:4], engine=engine_arguments, more={"latents": latents})
