"""transformers as a decode engine (`handoff_client.transformers.load`): the first token of a 1k-token prompt from a
hand-off against transformers recomputing the prompt, in the same run (`--quick`: 257 tokens, fewer runs).

    recompute   model(prompt) in a fresh DynamicCache: the prompt's N tokens, the last one's logits only
    load        load(client, params, model, prompt_ids=prompt): the hand-off's N - 1 tokens pulled from a broker on
                loopback into a fresh cache, then model(last token, that cache): the same logits' token

Each `load` run pulls its own hand-off, pushed before the timing by `prefill` (a dense model's hand-off holds all N
tokens; `load` keeps N - 1 of them and the decoder computes the last, as vLLM's does). The two are interleaved run by
run; medians. The model is random-weight, float32, built from config in this process (a Llama of 8 layers, hidden
1024, 16 heads of 64, 4 KV heads: 16 KiB of KV a token; `--layers`, `--hidden` to change), so the ratio depends on
how much compute a token costs against how many bytes it carries: a larger model gains more. CPU, this machine's
cores; no GPU figure here.

    python benchmarks/transformers_load.py [--tokens 1025] [--runs 7] [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def build(layers: int, hidden: int):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=8192,
                                      tie_word_embeddings=False)  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1025, help="prompt tokens (1025: a 1k-token hand-off, N - 1)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--json", metavar="FILE", help="write the figures here too")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 257 tokens, 2 layers, 2 runs")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.runs, args.layers = 257, min(args.runs, 2), 2

    import torch
    from handoff_broker import BrokerConfig, build_server
    from handoff_client import HandoffClient, contract_from_config
    from handoff_client.transformers import load, prefill

    torch.set_grad_enabled(False)
    model = build(args.layers, args.hidden)
    contract = contract_from_config(model.config.to_dict(), ctx=8192, dtype="float32", model="bench-llama")
    server, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={contract.model: contract}))
    server.start()
    prompt = [(i * 7) % 8000 + 3 for i in range(args.tokens)]
    times: dict[str, list[float]] = {"recompute": [], "load": []}
    tokens: dict[str, int] = {}
    try:
        with HandoffClient(server.address) as client:
            for _ in range(args.runs + 1):  # the first run warms both paths up, and is not counted
                started = time.perf_counter()
                logits = model(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]  # (the last token's alone)
                recompute = time.perf_counter() - started
                tokens["recompute"] = int(logits.argmax())
                params = prefill(client, model, prompt, model_name=contract.model)
                started = time.perf_counter()
                cache = load(client, params, model, prompt_ids=prompt)
                logits = model(torch.tensor([prompt[-1:]]), past_key_values=cache).logits[0, -1]
                loaded = time.perf_counter() - started
                tokens["load"] = int(logits.argmax())
                times["recompute"].append(recompute)
                times["load"].append(loaded)
    finally:
        server.stop(grace=0.2)
    recompute, loaded = (statistics.median(times[k][1:]) for k in ("recompute", "load"))
    kv_bytes = contract.at(args.tokens - 1).nbytes
    figures = {
        "tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "runs": args.runs,
        "hand_off_bytes": kv_bytes, "recompute_ms": recompute * 1e3, "load_ms": loaded * 1e3,
        "load_vs_recompute": loaded / recompute, "same_token": tokens["load"] == tokens["recompute"],
    }  # fmt: skip
    if args.quick:
        print("QUICK RUN: a smoke test of the benchmark itself (small sizes, few runs); not measurements")
    print(f"transformers, first token of a {args.tokens}-token prompt ({args.layers} layers, hidden {args.hidden}, "
          f"float32, {torch.get_num_threads()} threads), medians of {args.runs} runs:")  # fmt: skip
    print(f"  recompute the prompt          {recompute * 1e3:9.1f} ms")
    print(f"  load the hand-off ({kv_bytes / 2**20:.1f} MiB)  {loaded * 1e3:9.1f} ms   "
          f"{loaded / recompute:.2f}x recompute; same token: {figures['same_token']}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
