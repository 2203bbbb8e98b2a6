"""What each `handoff-broker` command does (server/cli.py parses the command line and calls one of these).

`serve` and `demo` run a broker and need the server extra; the others need only the client library, so a worker's
client-only install can check a broker's health and status, derive and check contracts, and hash tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from handoff_client.protocol.errors import ManifestError

if TYPE_CHECKING:
    from handoff_client.protocol.contract import Contract

logger = logging.getLogger("handoff_broker")

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _config_contract(path: Path, *, label: str, naming: str, **options: object) -> Contract:
    """The contract a Hugging Face config.json describes: `path` is the file, or a model directory holding it (the
    form `vllm serve --model DIR` takes). ManifestError starting with `label` (the flag and path) when it cannot.

    Invariant: a contract is named by `options["model"]` or by the config's own `_name_or_path`, never by its
    model_type: a real Hugging Face config.json carries no name, and `llama` would neither match vLLM's
    --served-model-name nor tell two Llama configs apart. Without either, the refusal asks for `naming`.
    """
    from handoff_client import contract_from_config

    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ManifestError(f"{label}: not a readable config.json: {e}") from None
    if not options.get("model") and not (isinstance(config, dict) and config.get("_name_or_path")):
        raise ManifestError(f"{label}: name the model as vLLM serves it: {naming} (NAME as --served-model-name)")
    try:
        contract = contract_from_config(config, **options)
    except ManifestError as e:
        raise ManifestError(f"{label}: {e}") from None
    longest = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if isinstance(longest, int) and contract.ctx > longest:
        logger.warning("%s: a cache of %d positions, beyond the model's max_position_embeddings %d: rows it never "
                       "fills are counted in the contract's full size", file, contract.ctx, longest)  # fmt: skip
    return contract


def _security(args: argparse.Namespace) -> dict:
    """TLS material and tokens from their files; OSError or ManifestError naming the file when one is amiss."""
    from .auth import TokenTable

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ManifestError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ManifestError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    from .preflight import read_flag_file as read

    files = {flag[2:].replace("-", "_"): read(flag, getattr(args, flag[2:].replace("-", "_")))
             for flag in ("--tls-cert", "--tls-key", "--tls-client-ca")}  # fmt: skip
    if args.tls_cert:
        from .tls import check_tls_files

        named = lambda flag, path, data: (f"{flag} {path}", data)
        check_tls_files(named("--tls-cert", args.tls_cert, files["tls_cert"]),
                        named("--tls-key", args.tls_key, files["tls_key"]),
                        named("--tls-client-ca", args.tls_client_ca, files["tls_client_ca"]) if args.tls_client_ca
                        else None)  # fmt: skip
    return {**files, "tokens": TokenTable.load(Path(args.tokens)) if args.tokens else None}


def _connection(args: argparse.Namespace) -> dict:
    """HandoffClient's keyword arguments from the connection flags; OSError or ManifestError naming what is amiss."""
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise ManifestError("--tls-client-cert and --tls-client-key go together")
    from .preflight import read_flag_file as read

    token = (read("--token-file", args.token_file) or b"").decode(errors="replace").strip() or None
    if args.token_file and not token:
        raise ManifestError(f"--token-file {args.token_file}: no token in the file")
    return {
        "tls_root_certificates": read("--tls-ca", args.tls_ca),
        "tls_certificate_chain": read("--tls-client-cert", args.tls_client_cert),
        "tls_private_key": read("--tls-client-key", args.tls_client_key),
        "tls_server_name": args.tls_server_name,
        "token": token,
    }


def hash_token_command(args: argparse.Namespace) -> int:
    """The sha256 a token file stores for a token read from stdin (so it never sits on a command line)."""
    from .auth import hash_token

    token = sys.stdin.readline().strip()
    if not token:
        print("handoff-broker: no token on stdin", file=sys.stderr)
        return 2
    print(hash_token(token))
    return 0


def serve(args: argparse.Namespace) -> int:
    from .app import BrokerConfig, build_server, default_max_bytes
    from .contracts import default_contracts, load_contracts

    try:
        contracts = load_contracts(Path(args.contracts)) if args.contracts else {}
        for value in args.model_config or []:
            name, _, path = value.rpartition("=")  # NAME=CONFIG.json names the model (vLLM's --served-model-name)
            label = f"--model-config {path}"
            contract = _config_contract(
                Path(path), label=label, naming=f"--model-config NAME={path}", ctx=args.config_ctx,
                dtype=args.config_dtype, state_dtype=args.config_state_dtype, model=name or None,
            )  # fmt: skip
            if contract.model in contracts:
                raise ManifestError(f"{label}: model: `{contract.model}` is already served")
            contracts[contract.model] = contract
        contracts = contracts or default_contracts()
    except ManifestError as e:
        print(f"handoff-broker: cannot start: {e}", file=sys.stderr)
        return 2
    try:
        security = _security(args)
    except (OSError, ManifestError) as e:
        print(f"handoff-broker: cannot start: {e}", file=sys.stderr)
        return 2
    config = BrokerConfig(
        **security,
        max_message_bytes=args.max_message_bytes,
        max_streams_per_connection=args.max_streams_per_connection,
        push_deadline=args.push_deadline,
        etcd=args.etcd,
        advertise=args.advertise,
        etcd_lease=args.etcd_lease,
        host=args.host,
        port=args.port,
        contracts=contracts,
        max_bytes=args.max_bytes if args.max_bytes is not None else default_max_bytes(),
        ttl=args.ttl,
        lease=args.lease,
        idle_timeout=args.idle_timeout,
        resume_window=args.resume_window,
        trim_after=args.trim_after,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        metrics_host=args.metrics_host,
        health_port=None if args.health_port < 0 else args.health_port,
        workers=args.workers,
        lanes=args.lanes,
        lane_port=args.lane_port,
        lane_advertise_host=args.lane_advertise_host,
        shared_memory_lane=args.shared_memory_lane,
        lane_socket=args.lane_socket,
        lane_min_bytes=args.lane_min_bytes,
        shared_memory_lane_min_bytes=args.shared_memory_lane_min_bytes,
        lane_max_connections=args.lane_max_connections,
        keepalive_seconds=args.keepalive,
        keepalive_timeout_seconds=args.keepalive_timeout,
    )
    _warn_if_small(config.max_bytes, contracts)
    if problem := _preflight(args):  # (before anything listens: a lane started, then a library's words, misled)
        print(f"handoff-broker: cannot start: {problem}", file=sys.stderr)
        return 2
    try:
        broker, _ = build_server(config)
    except (OSError, RuntimeError) as e:  # (each names the port it could not listen on)
        print(f"handoff-broker: cannot start: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        broker.start()
    except OSError as e:  # (the registration in etcd, which answered the preflight: it names the flag all the same)
        broker.stop(0)
        if not args.etcd:
            raise
        print(f"handoff-broker: cannot start: --etcd {args.etcd}: etcd refused the registration: "
              f"{getattr(e, 'reason', None) or e}", file=sys.stderr)  # fmt: skip
        return 2
    metrics = f"; metrics on :{broker.metrics_port}/metrics" if broker.metrics_port is not None else ""
    metrics += f"; health on :{broker.health_port}" if broker.health_port is not None else ""
    print(
        f"handoff-broker listening on {broker.address}; max {config.max_bytes} bytes ({human_size(config.max_bytes)}) "
        f"of hand-offs{metrics}",
        flush=True,
    )
    stop.wait()
    logger.info("signal received: draining for up to %ss", args.grace)
    broker.stop(args.grace)
    return 0


def _preflight(args: argparse.Namespace) -> str | None:
    """What stops `serve` before it listens, naming the flag: an address not this machine's, an etcd not answering."""
    from .preflight import etcd_unreachable, unlistenable

    for flag, host in (("--host", args.host), ("--metrics-host", args.metrics_host)):
        if host and (why := unlistenable(host)):
            return f"{flag} {host}: {why}"
    if args.etcd and (why := etcd_unreachable(args.etcd)):
        return f"--etcd {args.etcd}: {why}"
    return None


def _warn_if_small(max_bytes: int, contracts: dict[str, Contract]) -> None:
    """A --max-bytes too small for what the contracts hand off starts, with a warning per contract it cannot hold
    at a short prompt, or at its full context (those pushes will be refused as CAPACITY_EXHAUSTED)."""
    for model, contract in sorted(contracts.items()):
        tokens = min(SHORT_PROMPT, contract.ctx - 1)
        if contract.at(tokens).nbytes > max_bytes:
            logger.warning("--max-bytes %d (%s) holds no hand-off of %s even after %d tokens (%s): every push of it "
                           "will be refused", max_bytes, human_size(max_bytes), model, tokens,
                           human_size(contract.at(tokens).nbytes))  # fmt: skip
        elif contract.nbytes > max_bytes:
            logger.warning("--max-bytes %d (%s) holds no hand-off of %s at its full context of %d (%s): longer "
                           "prompts' pushes will be refused", max_bytes, human_size(max_bytes), model, contract.ctx,
                           human_size(contract.nbytes))  # fmt: skip


def contract_from_config(args: argparse.Namespace) -> int:
    """Write the manifest of the model a Hugging Face config.json describes."""
    try:
        contract = _config_contract(
            Path(args.config), label=f"contract-from-config {args.config}", naming="--model NAME", ctx=args.ctx,
            dtype=args.dtype, model=args.model, state_dtype=args.state_dtype, scale=args.scale,
        )  # fmt: skip
    except ManifestError as e:
        print(f"handoff-broker: {e}", file=sys.stderr)
        return 2
    text = json.dumps(contract.to_json(), indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text)
        print(
            f"{args.output}: {contract.model}, {len(contract.carried)} carried tensors, {contract.nbytes} bytes "
            f"({human_size(contract.nbytes)}) a hand-off at the full ctx {contract.ctx}, {_short_prompt_bytes(contract)}",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(text)
    return 0


def check_contracts(args: argparse.Namespace) -> int:
    from .contracts import load_contracts

    try:
        contracts = load_contracts(Path(args.folder))
    except ManifestError as e:
        print(f"handoff-broker: {e}", file=sys.stderr)
        return 2
    for model, contract in sorted(contracts.items()):
        print(
            f"{model}: ctx {contract.ctx}, hidden {contract.hidden}, {len(contract.carried)} carried tensors, "
            f"{contract.nbytes} bytes per hand-off at the full ctx, {_short_prompt_bytes(contract)}, "
            f"fingerprint {contract.fingerprint}"
        )
        if not contract.rewindable:  # docs/contracts.md, the last-token rule
            print("  not rewindable: its producer pushes the state after N - 1 of a prompt's N tokens (position N - 1)")
        for c in contract.carried:
            split = f"  {c.heads} heads x {c.head_dim}" if c.heads else ""
            rows = "  rows are positions" if c.rows_are_positions else ""
            print(
                f"  layer {c.layer:>3}  {c.name:<40} {c.rows:>7} x {c.cols:<6} {c.dtype:<14} {c.nbytes:>12} bytes"
                f"{split}{rows}"
            )
    return 0


SHORT_PROMPT = 1000
"""The tokens of a typical prompt, at which `status`, `check-contracts` and `contract-from-config` say what a
hand-off holds beside its full-context size (a hand-off carries only the rows its prompt filled)."""


def _short_prompt_bytes(contract: Contract) -> str:
    """What a hand-off after a short prompt carries, for the reader to compare with the full context's bytes."""
    tokens = min(SHORT_PROMPT, contract.ctx - 1)
    return f"{contract.at(tokens).nbytes} after {tokens} tokens"


def human_size(nbytes: int) -> str:
    """A byte count as people read it: 12637986816 -> "11.8 GiB" (binary units, as --max-bytes takes them)."""
    size, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"


TRAFFIC_TRIES = 3  # tries of one id before `traffic` gives it up and moves on


def traffic(args: argparse.Namespace) -> int:
    """A demo prefill or decode worker that moves hand-offs of one model continuously (for compose and dashboards):
    the prefill pushes ids <prefix>-0, -1, ...; the decode pulls the same ids in order. An id is tried at most
    TRAFFIC_TRIES times, and one already gone (delivered before a restart, say) at once, so a worker never sticks on
    an id its peer will not move; with --count the exit status says whether any was given up."""
    import time

    from handoff_client import HandoffClient, HandoffError, HandoffGone

    from .demo import demo_tensors

    moved, given_up = 0, 0
    with HandoffClient(args.target, **_connection(args)) as client:
        n = 0
        while args.count is None or n < args.count:
            handoff_id = f"{args.prefix}-{n}"
            for attempt in range(1, TRAFFIC_TRIES + 1):
                try:
                    contract = client.get_contract(args.model)
                    if args.role == "prefill":
                        client.push(args.model, handoff_id, n % contract.ctx, demo_tensors(contract, n))
                    else:
                        client.pull(args.model, handoff_id, timeout=30)
                    moved += 1
                    break
                except HandoffError as e:
                    logger.warning("%s %s, try %d of %d: %s", args.role, handoff_id, attempt, TRAFFIC_TRIES, e.message)
                    if isinstance(e, HandoffGone) or attempt == TRAFFIC_TRIES:
                        given_up += 1
                        logger.warning("%s: %s given up; moving on", args.role, handoff_id)
                        break
                    time.sleep(1.0)
            n += 1
            time.sleep(args.interval)
    print(f"{args.role}: {moved} hand-offs of {args.model}" + (f", {given_up} given up" if given_up else ""))
    return 1 if given_up and args.count is not None else 0


def demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)
