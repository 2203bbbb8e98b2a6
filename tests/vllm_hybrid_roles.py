"""tests/vllm_roles.py's vLLM instance, started the way the hybrid tests need it: `python tests/vllm_hybrid_roles.py
ROLE MODEL_DIR SETTINGS.json`, the same roles, settings and session commands, and besides them: `block_size` (null:
vLLM's own choice, which a hybrid model's page alignment makes), `max_num_batched_tokens` (the prefill chunk) and
`max_num_seqs` (1 unless given: one request at a time, so a bf16 run does not depend on its batch),
`disable_hybrid_kv_cache_manager` (null: vLLM decides), and the default
`dtype` bfloat16 (the CPU build's gated-delta-net kernel takes nothing else).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm_roles


def engine_arguments(settings: dict) -> dict:
    """The hybrid instances' LLM arguments beside vllm_roles.start's (module docstring)."""
    return {
        "block_size": settings.get("block_size"), "max_model_len": settings.get("max_model_len", 1024),
        "max_num_batched_tokens": settings.get("max_num_batched_tokens"),
        "max_num_seqs": settings.get("max_num_seqs", 1), "dtype": settings.get("dtype", "bfloat16"),
        "enable_prefix_caching": False,
        "disable_hybrid_kv_cache_manager": settings.get("disable_hybrid_kv_cache_manager"),
    }  # fmt: skip


if __name__ == "__main__":
    vllm_roles.main(*sys.argv[1:4], engine=engine_arguments)
