"""`handoff-broker demo`: a broker, a prefill process and a decode process, one hand-off, verified bit for bit.

The decode process starts first and waits for the hand-off (pull before push); the prefill process pushes the demo
model's carried state after a prompt of `--position` tokens, far shorter than the context: its whole cache arrays go
in, and only the rows the prompt filled (and the gated-delta state, whole) cross the wire. The decoder checks every
tensor against the same seeded values and reports. Run as a module
(`python -m handoff_broker.demo push|pull ...`) it is one of the two workers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from .contracts import DEFAULT_MODEL

if TYPE_CHECKING:  # (imported where used: the command line builds its parser from this module, cheaply)
    import numpy as np
    from handoff_client import Contract


def demo_tensors(contract: Contract, seed: int) -> dict[str, np.ndarray]:
    """Seeded values for every carried tensor, the same in any process."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tensors = {}
    for carried in contract.carried:
        if carried.numpy_dtype.kind in "iu":
            info = np.iinfo(carried.numpy_dtype)
            values = rng.integers(info.min, info.max, size=carried.shape, endpoint=True)
        else:
            values = rng.standard_normal(carried.shape)
        tensors[carried.name] = values.astype(carried.numpy_dtype)
    return tensors


def _fingerprint_bytes(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def push_worker(target: str, model: str, handoff_id: str, position: int, seed: int) -> dict:
    from handoff_client import HandoffClient

    with HandoffClient(target) as client:
        tensors = demo_tensors(client.get_contract(model), seed)
        started = time.perf_counter()
        result = client.push(model, handoff_id, position, tensors)
        return {
            "role": "prefill",
            "bytes": result.bytes,
            "chunks": result.chunks,
            "seconds": time.perf_counter() - started,
        }


def pull_worker(target: str, model: str, handoff_id: str, seed: int, timeout: float) -> dict:
    from handoff_client import HandoffClient
    from handoff_client.protocol.contract import cut_to_filled

    with HandoffClient(target) as client:
        contract = client.get_contract(model)
        started = time.perf_counter()
        handoff = client.pull(model, handoff_id, timeout=timeout)
        seconds = time.perf_counter() - started
        filled = contract.at(handoff.position)
        expected = cut_to_filled(filled, demo_tensors(contract, seed))
        tensors = [
            {
                "name": c.name,
                "layer": c.layer,
                "shape": list(handoff.state[c.name].shape),
                "dtype": c.dtype,
                "bytes": c.nbytes,
                "identical": _fingerprint_bytes(handoff.state[c.name]) == _fingerprint_bytes(expected[c.name]),
            }
            for c in filled.carried
        ]
        return {
            "role": "decode",
            "position": handoff.position,
            "seconds": seconds,
            "tensors": tensors,
            "full_context_bytes": contract.nbytes,
        }


def _worker_command(role: str, target: str, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "handoff_broker.demo", role, "--target", target, "--model", args.model]
    return command + ["--handoff-id", args.handoff_id, "--seed", str(args.seed), "--position", str(args.position)]


def run_demo(args: argparse.Namespace) -> int:
    """The whole demo; 0 when every tensor arrived identical."""
    from .app import BrokerConfig, build_server  # (the server extra: only when the demo runs its broker)

    config = BrokerConfig(host="127.0.0.1", port=0)
    contract = config.contracts.get(args.model)
    if contract is None or args.position >= contract.ctx:  # (refused here, not after a decoder waited its timeout)
        why = f"--position {args.position}: {args.model} holds positions 0..{contract.ctx - 1}" if contract else (
            f"--model {args.model}: the demo serves {', '.join(config.contracts)}")  # fmt: skip
        print(f"handoff-broker demo: {why}", file=sys.stderr)
        return 2
    broker, port = build_server(config)
    with broker:
        target = f"127.0.0.1:{port}"
        print(f"broker on {target}, serving {', '.join(broker.config.contracts)}")
        started = time.perf_counter()
        decoder = subprocess.Popen(_worker_command("pull", target, args), stdout=subprocess.PIPE, text=True)
        prefill = subprocess.run(_worker_command("push", target, args), stdout=subprocess.PIPE, text=True, check=False)
        decoded, _ = decoder.communicate(timeout=120)
        elapsed = time.perf_counter() - started
        if prefill.returncode != 0 or decoder.returncode != 0:
            print("a worker failed; its error is above", file=sys.stderr)
            return 1
        pushed, pulled = json.loads(prefill.stdout), json.loads(decoded)
        stats = broker.store.stats()
    print(
        f"prefill process pushed {pushed['bytes']} bytes in {pushed['chunks']} chunks "
        f"in {pushed['seconds'] * 1000:.1f} ms"
    )
    print(
        f"decode process pulled the hand-off after {pulled['position']} tokens in {pulled['seconds'] * 1000:.1f} ms "
        "(its wait for the push included)"
    )
    print(f"{'layer':>5}  {'tensor':<34} {'shape':<12} {'dtype':<9} {'bytes':>10}  bit-identical")
    for t in pulled["tensors"]:
        shape = "x".join(map(str, t["shape"]))
        print(
            f"{t['layer']:>5}  {t['name']:<34} {shape:<12} {t['dtype']:<9} {t['bytes']:>10}  {'yes' if t['identical'] else 'NO'}"
        )
    total = sum(t["bytes"] for t in pulled["tensors"])
    identical = all(t["identical"] for t in pulled["tensors"])
    print(
        f"{len(pulled['tensors'])} tensors, {total} bytes, {'all bit-identical' if identical else 'MISMATCH'}; "
        f"{elapsed:.2f} s end to end; broker holds {stats.resident_bytes} bytes after the confirm"
    )
    print(
        f"only the rows {pulled['position']} tokens filled crossed: {total} of the {pulled['full_context_bytes']} "
        f"bytes the whole context would hold ({pulled['full_context_bytes'] / total:.1f}x less)"
    )
    return 0 if identical and stats.resident_bytes == 0 else 1


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from .flags import count

    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"the contract to hand off ({DEFAULT_MODEL})")
    parser.add_argument("--handoff-id", default="demo-request-1", help="the hand-off's id (demo-request-1)")
    parser.add_argument("--position", type=count(0, 1 << 24, "a number of tokens"), default=100,
                        help="prompt tokens prefilled (default 100)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=42, help="seeds the tensors both workers compute (42)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m handoff_broker.demo", description=__doc__)
    parser.add_argument("role", choices=["push", "pull"])
    parser.add_argument("--target", required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    add_demo_arguments(parser)
    args = parser.parse_args(argv)
    if args.role == "push":
        result = push_worker(args.target, args.model, args.handoff_id, args.position, args.seed)
    else:
        result = pull_worker(args.target, args.model, args.handoff_id, args.seed, args.timeout)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
