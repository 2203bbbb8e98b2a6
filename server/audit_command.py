"""`handoff-broker audit`: an operator's check of one hand-off against a reference engine (docs/engines.md, "Audit").

    handoff-broker audit MODEL_DIR --params PARAMS.json --prompt 3,10,17,... [--target HOST:PORT] [--producer vllm]

MODEL_DIR is the model's Hugging Face directory (config.json and weights), PARAMS the `kv_transfer_params` the
producer returned (a JSON object, or @FILE), the prompt its token ids (or --prompt-file, one JSON list). The hand-off
is read without a claim, so its decoder is untouched; the model recomputes the prompt in transformers
(handoff_client.transformers.audit) and every carried tensor is compared. Prints one line per tensor and the
verdict; exits 0 when the hand-off is the prompt's within the stated tolerances, 1 when not (or on any error: a
hand-off already confirmed, an unknown model, another contract). A client command: it needs the `transformers`
extra, not the server's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subcommands: argparse._SubParsersAction, connection_flags: object) -> None:
    """The `audit` command's flags (and the connection flags, `connection_flags(parser)`)."""
    audit = subcommands.add_parser("audit", help="check a hand-off against a reference engine, without claiming it")
    connection_flags(audit)  # type: ignore[operator]
    audit.add_argument("model_dir", metavar="MODEL_DIR", help="the model's Hugging Face directory (config and weights)")
    audit.add_argument("--params", required=True, help="the producer's kv_transfer_params: a JSON object, or @FILE")
    prompt = audit.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt's token ids, comma-separated")
    prompt.add_argument("--prompt-file", metavar="FILE", help="a file holding the prompt's token ids as a JSON list")
    audit.add_argument("--producer", default="vllm", help="the engine that made the hand-off: its tolerances (vllm)")
    audit.add_argument("--dtype", choices=DTYPES, default="float32", help="the reference model's dtype (float32)")
    audit.add_argument("--timeout", type=float, default=60.0, help="seconds for the read (60)")
    audit.set_defaults(run=run)


def _params(value: str) -> dict:
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    params = json.loads(text)
    if not isinstance(params, dict) or "handoff_id" not in params or "model" not in params:
        raise ValueError("--params must be a JSON object with at least `handoff_id` and `model` (kv_transfer_params)")
    return params


def _prompt(args: argparse.Namespace) -> list[int]:
    if args.prompt is not None:
        return [int(t) for t in args.prompt.split(",") if t.strip()]
    ids = json.loads(Path(args.prompt_file).read_text())
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueError(f"--prompt-file {args.prompt_file}: not a JSON list of token ids")
    return ids


def run(args: argparse.Namespace) -> int:
    """Read, recompute, compare, print; 0 when the hand-off passes."""
    from handoff_client import HandoffClient, HandoffError

    from .commands import _connection

    try:
        params, prompt = _params(args.params), _prompt(args)
    except (OSError, ValueError) as e:
        print(f"audit: {e}", file=sys.stderr)
        return 1
    try:
        import torch
        import transformers
        from handoff_client.transformers import audit
    except ImportError as e:
        print(f"audit: needs torch and transformers (pip install '.[transformers]'): {e}", file=sys.stderr)
        return 1
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    with HandoffClient(args.target, **_connection(args)) as client:
        try:
            report = audit(client, params, model, prompt, producer=args.producer, timeout=args.timeout)
        except (HandoffError, ValueError) as e:
            print(f"audit: {getattr(e, 'message', e)}", file=sys.stderr)
            return 1
    print(report.summary())
    return 0 if report.ok else 1
