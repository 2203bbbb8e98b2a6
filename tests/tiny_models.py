"""The random-weight models the vLLM tests build with transformers (no hub), in a subprocess of their own so that
the test process never imports transformers beside vLLM's CPU build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def build_tiny_llama(folder: Path) -> None:
    """A 2-layer Llama (hidden 256, 4 attention heads, 2 KV heads of 64, vocab 512, seed 0) saved in bf16."""
    build = (
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "torch.manual_seed(0)\n"
        "cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,\n"
        "                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,\n"
        "                  tie_word_embeddings=False)\n"
        "LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", build, str(folder)], check=True, capture_output=True, timeout=300)
