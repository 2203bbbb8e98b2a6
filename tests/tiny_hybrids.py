"""The random-weight hybrid and sliding-window models the vLLM tests and benchmarks build with transformers (no hub),
each in a subprocess of its own so that the caller never imports transformers beside vLLM's CPU build.

    build_tiny_hybrid("qwen3_next", folder)   3 gated-delta-net layers and 1 attention layer (4 KV-cache groups)
    build_tiny_hybrid("gemma3", folder)       sliding window 64 on layers 0 and 2, global attention on 1 and 3
    build_tiny_hybrid("nemotron_h", folder)   Mamba2, attention, MLP, Mamba2 ("M*-M")
    build_tiny_hybrid("granitemoehybrid", folder)   Mamba2, attention, Mamba2, Mamba2
    build_tiny_hybrid("falcon_h1", folder)    2 layers, each a Mamba2 mixer beside attention

All share vocab 512, hidden 128, 4 query heads and 2 KV heads of 64, bf16, seed 0, untied embeddings (a random tied
model only repeats its last token). The recurrent layers get a slow decay and a louder output so that their state
has a say in the tokens: with the state not carried, a decoder's tokens differ.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

KINDS = ("qwen3_next", "gemma3", "nemotron_h", "granitemoehybrid", "falcon_h1")

BUILD = """
import sys, torch
import transformers as t
torch.manual_seed(0)
kind, folder = sys.argv[1], sys.argv[2]
common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=16384, tie_word_embeddings=False)
mamba = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=1)
if kind == "qwen3_next":  # the CPU build's GDN kernel: k_dim = v_dim = 64; conv dim 2*2*64 + 4*64 = 512
    config = t.Qwen3NextConfig(**common, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                               shared_expert_intermediate_size=128)
    model = t.Qwen3NextForCausalLM(config)
elif kind == "gemma3":
    model = t.Gemma3ForCausalLM(t.Gemma3TextConfig(**common, num_hidden_layers=4, sliding_window=64,
                                                   sliding_window_pattern=2))
elif kind == "nemotron_h":
    config = t.NemotronHConfig(**{k: v for k, v in common.items() if k != "intermediate_size"},
                               intermediate_size=256, hybrid_override_pattern="M*-M", num_hidden_layers=4,
                               mamba_num_heads=4, mamba_head_dim=32, n_groups=1, ssm_state_size=16, conv_kernel=4,
                               expand=1)
    model = t.NemotronHForCausalLM(config)
elif kind == "granitemoehybrid":
    config = t.GraniteMoeHybridConfig(**{k: v for k, v in common.items() if k != "head_dim"}, num_hidden_layers=4,
                                      layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=0,
                                      shared_intermediate_size=256, **mamba)
    model = t.GraniteMoeHybridForCausalLM(config)
elif kind == "falcon_h1":
    config = t.FalconH1Config(**common, num_hidden_layers=2, mamba_d_ssm=128, mamba_chunk_size=64, **mamba)
    model = t.FalconH1ForCausalLM(config)
else:
    raise SystemExit(f"unknown kind {kind}")
with torch.no_grad():  # random init decays the state within a token or two: give it a memory of tens of tokens
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "out_proj"):
            module.A_log.fill_(-3.0)
            module.out_proj.weight.mul_(10)
model.to(torch.bfloat16).save_pretrained(folder)
"""


def build_tiny_hybrid(kind: str, folder: Path) -> Path:
    """Build and save the tiny `kind` (one of KINDS) under `folder`; returns `folder`."""
    if kind not in KINDS:
        raise ValueError(f"{kind}: not one of {KINDS}")
    done = subprocess.run([sys.executable, "-c", BUILD, kind, str(folder)], check=False,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"building a tiny {kind} failed: {done.stderr[-3000:]}")
    return folder


REFERENCE = """
import sys, numpy as np, torch, transformers as t
model = t.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
prompt = [int(x) for x in sys.argv[2].split(",")]
with torch.no_grad():
    cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
out = {}
for i, layer in enumerate(cache.layers):
    if getattr(layer, "recurrent_states", None) and layer.recurrent_states.get(0) is not None:
        s = layer.recurrent_states[0][0].float()  # S_h per head: GDN (v_heads, k_dim, v_dim), Mamba2 (H, P, N)
        out[f"layers.{i}.per_head"] = s.numpy()
        out[f"layers.{i}.recurrent"] = s.permute(1, 0, 2).reshape(s.shape[1], -1).numpy()
        out[f"layers.{i}.conv"] = layer.conv_states[0][0].float().t().numpy()  # (kernel, conv_dim)
np.savez(sys.argv[3], **out)
"""


def transformers_state(model_dir: Path, prompt: list[int], out: Path) -> dict:
    """A hybrid's recurrent state after `prompt` as transformers computes it (bf16 weights, float32 state), per
    recurrent layer i: `layers.{i}.per_head`, S_h per head as transformers keeps it (gated-delta-net (V, k_dim,
    v_dim), Mamba2 (H, head_dim, state)); `layers.{i}.recurrent`, the same in the contract's layout, S_h per head on
    its columns (GDN memory[a, h·v_dim + b], Mamba2 ssm[p, h·N + n] = S_h[...]); and `layers.{i}.conv`, the conv
    state's last `kernel` inputs in time order (kernel, conv_dim), channels [Q | K | V] or [x | B | C]."""
    import numpy as np

    done = subprocess.run([sys.executable, "-c", REFERENCE, str(model_dir), ",".join(map(str, prompt)), str(out)],
                          check=False, capture_output=True, text=True, timeout=300)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"transformers' reference state failed: {done.stderr[-3000:]}")
    with np.load(out) as saved:
        return dict(saved)
