"""The `handoff-broker` command: serve, demo, status, health, check-contracts."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import tomllib
from pathlib import Path

from handoff_client._contract import Contract, ManifestError

logger = logging.getLogger("handoff_broker")


BYTE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,  # binary
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,  # binary, as docker -m and kubectl's Gi mean
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,  # decimal
}  # fmt: skip
SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def _parse_bytes(text: str) -> int:
    """A positive byte count: 1073741824, 1GiB, 512MiB, 64KiB, 16G (binary), 16GB (decimal); any case."""
    match = SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if unit not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"`{text}` is not a size: a number and one of B, KiB, MiB, GiB, TiB (or K, M, G, T: the same, binary) "
            "or KB, MB, GB, TB (decimal), in any case"
        )
    value = int(float(match.group(1)) * BYTE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"`{text}` is not a size above 0")
    return value


SERVE_HELP = """Run the broker until SIGTERM or SIGINT, then drain for up to --grace seconds: new pushes, and pulls of
hand-offs it does not hold, get UNAVAILABLE; streams in flight finish and what it holds can still be pulled; it stops
when empty or at the end of the grace, and the last log line counts what was still held.

Every flag may also be set in the environment (--max-bytes as HANDOFF_MAX_BYTES, and so on) or in a TOML file given
by --config (max-bytes = "16GiB"); the command line wins over the environment, which wins over the file."""


def _config_contract(path: Path, **options: object):  # noqa: ANN202 - a Contract
    """The contract a Hugging Face config.json file describes; ManifestError naming the file when it cannot."""
    from handoff_client._architectures import contract_from_config

    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: not a readable config.json: {e}") from None
    try:
        return contract_from_config(config, **options)
    except ManifestError as e:
        raise ManifestError(f"{path}: {e}") from None


def _security(args: argparse.Namespace) -> dict:
    """TLS material and tokens from their files; OSError or ManifestError naming the file when one is amiss."""
    from .auth import TokenTable

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ManifestError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ManifestError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return {
        "tls_cert": read(args.tls_cert),
        "tls_key": read(args.tls_key),
        "tls_client_ca": read(args.tls_client_ca),
        "tokens": TokenTable.load(Path(args.tokens)) if args.tokens else None,
    }


def _add_connection_flags(command: argparse.ArgumentParser) -> None:
    """How a client command reaches a broker: its address, and TLS and a bearer token when the broker asks for them.
    The names differ from `serve`'s --tls-cert/--tls-key so that their environment variables never collide in one
    container (a HEALTHCHECK beside its broker)."""
    command.add_argument("--target", default="127.0.0.1:50051")
    command.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA for the broker")
    command.add_argument("--tls-client-cert", metavar="PEM", help="this client's certificate chain (mutual TLS)")
    command.add_argument("--tls-client-key", metavar="PEM", help="this client's private key (mutual TLS)")
    command.add_argument("--tls-server-name", metavar="NAME", help="the name the broker's certificate must carry")
    command.add_argument(
        "--token-file", metavar="FILE", help="a file holding the bearer token (never on a command line)"
    )


def _connection(args: argparse.Namespace) -> dict:
    """HandoffClient's keyword arguments from the connection flags; OSError or ManifestError naming what is amiss."""
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise ManifestError("--tls-client-cert and --tls-client-key go together")
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    if args.token_file and not token:
        raise ManifestError(f"{args.token_file}: no token in the file")
    return {
        "tls_root_certificates": read(args.tls_ca),
        "tls_certificate_chain": read(args.tls_client_cert),
        "tls_private_key": read(args.tls_client_key),
        "tls_server_name": args.tls_server_name,
        "token": token,
    }


def _hash_token(args: argparse.Namespace) -> int:
    """The sha256 a token file stores for a token read from stdin (so it never sits on a command line)."""
    from .auth import hash_token

    token = sys.stdin.readline().strip()
    if not token:
        print("handoff-broker: no token on stdin", file=sys.stderr)
        return 2
    print(hash_token(token))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .app import BrokerConfig, build_server, default_max_bytes
    from .contracts import default_contracts, load_contracts

    try:
        contracts = load_contracts(Path(args.contracts)) if args.contracts else {}
        for value in args.model_config or []:
            name, _, path = value.rpartition("=")  # NAME=CONFIG.json names the model (vLLM's --served-model-name)
            contract = _config_contract(Path(path), ctx=args.config_ctx, dtype=args.config_dtype, model=name or None)
            if contract.model in contracts:
                raise ManifestError(f"{path}: model: `{contract.model}` is already served")
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
        workers=args.workers,
        keepalive_seconds=args.keepalive,
        keepalive_timeout_seconds=args.keepalive_timeout,
    )
    try:
        broker, port = build_server(config)
    except (OSError, RuntimeError) as e:
        print(f"handoff-broker: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    broker.start()
    metrics = f"; metrics on :{broker.metrics_port}/metrics" if broker.metrics_port is not None else ""
    print(
        f"handoff-broker listening on {broker.address}; max {config.max_bytes} bytes of hand-offs{metrics}", flush=True
    )
    stop.wait()
    logger.info("signal received: draining for up to %ss", args.grace)
    broker.stop(args.grace)
    return 0


def _contract_from_config(args: argparse.Namespace) -> int:
    """Write the manifest of the model a Hugging Face config.json describes."""
    try:
        contract = _config_contract(
            Path(args.config), ctx=args.ctx, dtype=args.dtype, model=args.model, state_dtype=args.state_dtype,
            scale=args.scale,
        )  # fmt: skip
    except ManifestError as e:
        print(f"handoff-broker: {e}", file=sys.stderr)
        return 2
    text = json.dumps(contract.to_json(), indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text)
        print(
            f"{args.output}: {contract.model}, {len(contract.carried)} carried tensors, {contract.nbytes} bytes "
            f"a hand-off at the full ctx {contract.ctx}, {_short_prompt_bytes(contract)}",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(text)
    return 0


def _check_contracts(args: argparse.Namespace) -> int:
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
        for c in contract.carried:
            split = f"  {c.heads} heads x {c.head_dim}" if c.heads else ""
            rows = "  rows are positions" if c.rows_are_positions else ""
            print(
                f"  layer {c.layer:>3}  {c.name:<40} {c.rows:>7} x {c.cols:<6} {c.dtype:<14} {c.nbytes:>12} bytes"
                f"{split}{rows}"
            )
    return 0


def _short_prompt_bytes(contract: Contract) -> str:
    """What a hand-off after a short prompt carries, for the reader to compare with the full context's bytes."""
    tokens = min(1000, contract.ctx - 1)
    return f"{contract.at(tokens).nbytes} after {tokens} tokens"


def _health(args: argparse.Namespace) -> int:
    """Exit 0 when the broker at --target reports SERVING over the gRPC health service (Docker's HEALTHCHECK)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from handoff_client._client import make_channel

    tls = _connection(args)
    tls.pop("token")  # health needs none
    with make_channel(args.target, **tls) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{args.target}: {e.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{args.target}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


def _status(args: argparse.Namespace) -> int:
    """What a live broker holds, read over its GetStatus RPC."""
    from handoff_client import HandoffClient, HandoffError
    from handoff_client._wire import contract_from_proto

    with HandoffClient(args.target, **_connection(args)) as client:
        try:
            status = client.status(timeout=args.timeout)
        except HandoffError as e:
            print(f"{args.target}: {e.message}", file=sys.stderr)
            return 1
    held = status.receiving + status.ready + status.claimed
    print(f"{args.target}: {'DRAINING' if status.draining else 'serving'}")
    print(
        f"  hand-offs held: {held} ({status.receiving} receiving, {status.ready} ready, {status.claimed} claimed); "
        f"oldest {status.oldest_seconds:.1f} s"
    )
    share = status.resident_bytes / status.max_bytes if status.max_bytes else 0.0
    print(
        f"  bytes: {status.resident_bytes} of {status.max_bytes} ({100 * share:.1f}%); "
        f"{status.tombstones} recently gone remembered"
    )
    for message in status.contracts:
        contract = contract_from_proto(message)
        print(
            f"  contract {contract.model}: ctx {contract.ctx}, {len(contract.carried)} tensors, "
            f"{contract.nbytes} bytes a hand-off, fingerprint {contract.fingerprint[:16]}"
        )
    return 0


def _traffic(args: argparse.Namespace) -> int:
    """A demo prefill or decode worker that moves hand-offs of one model continuously (for compose and dashboards):
    the prefill pushes ids <prefix>-0, -1, ...; the decode pulls the same ids in order."""
    import time

    from handoff_client import HandoffClient, HandoffError

    from .demo import demo_tensors

    with HandoffClient(args.target, **_connection(args)) as client:
        contract = None
        n = 0
        while args.count is None or n < args.count:
            try:
                contract = contract or client.get_contract(args.model)
                handoff_id = f"{args.prefix}-{n}"
                if args.role == "prefill":
                    client.push(args.model, handoff_id, n % contract.ctx, demo_tensors(contract, n))
                else:
                    client.pull(args.model, handoff_id, timeout=30)
                n += 1
            except HandoffError as e:
                logger.warning("%s %s: %s", args.role, args.model, e.message)
                if args.count is not None:
                    return 1
                time.sleep(1.0)
            time.sleep(args.interval)
    print(f"{args.role}: {n} hand-offs of {args.model}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


ENV_PREFIX = "HANDOFF_"


class _EnvDefaults(argparse.ArgumentParser):
    """Every `--some-flag` of `serve` may also come from `HANDOFF_SOME_FLAG`; the command line wins. A value that
    is not valid is one line naming the variable, when that command runs (never a traceback, nor an error in
    another command, such as the `health` a container's HEALTHCHECK runs)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.env_errors: list[str] = []

    def add_argument(self, *names: str, **kwargs: object) -> argparse.Action:
        flag = next((n for n in names if n.startswith("--")), None)
        if flag is not None and flag != "--help":
            variable = ENV_PREFIX + flag[2:].replace("-", "_").upper()
            if variable in os.environ:
                kind = kwargs.get("type", str)
                try:
                    kwargs["default"] = kind(os.environ[variable])  # type: ignore[operator]
                except (ValueError, argparse.ArgumentTypeError) as e:  # said if this command runs, not otherwise
                    self.env_errors.append(f"{variable}={os.environ[variable]!r} is not a valid {flag}: {e}")
                    self.set_defaults(env_errors=self.env_errors)
            kwargs["help"] = f"{kwargs.get('help', '')} [env {variable}]"
        return super().add_argument(*names, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="handoff-broker", description="Hands LLM decode state from prefill to decode."
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("HANDOFF_LOG_LEVEL"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="INFO for serve, WARNING for the other commands [env HANDOFF_LOG_LEVEL]",
    )
    parser.add_argument(
        "--log-format",
        default=os.environ.get("HANDOFF_LOG_FORMAT", "text"),
        choices=["text", "json"],
        help="one line per event, as text or JSON [env HANDOFF_LOG_FORMAT]",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_EnvDefaults)

    serve = commands.add_parser("serve", help="run the broker", description=SERVE_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    serve.add_argument("--config", metavar="FILE.toml", help="settings by flag name; flags and env win over it")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one (default: 50051)")
    serve.add_argument("--contracts", metavar="DIR", help="folder of *.json manifests (default: embedded demo-hybrid)")
    serve.add_argument("--model-config", metavar="[NAME=]CONFIG.json", action="append",
                       help="serve the contract derived from a Hugging Face config.json, under NAME (as vLLM's "
                            "--served-model-name) or the config's own name (repeatable)")  # fmt: skip
    serve.add_argument("--config-ctx", type=int, default=4096, help="cache length for --model-config (4096)")
    serve.add_argument("--config-dtype", default="bfloat16", help="cache dtype for --model-config (bfloat16)")
    serve.add_argument("--max-bytes", type=_parse_bytes, help="bytes of hand-offs held at most (default: half of RAM)")
    serve.add_argument("--ttl", type=float, default=300.0, help="seconds an unclaimed hand-off lives (default: 300)")
    serve.add_argument("--lease", type=float, default=30.0, help="seconds a streamed claim waits for its confirm (30)")
    serve.add_argument("--idle-timeout", type=float, default=30.0, help="seconds a push may send nothing (30)")
    serve.add_argument("--resume-window", type=float, default=10.0,
                       help="seconds a broken resumable push is kept for its retry (10)")  # fmt: skip
    serve.add_argument("--trim-after", type=float, default=30.0,
                       help="seconds holding nothing before freed memory goes back to the system (30)")  # fmt: skip
    serve.add_argument("--metrics-port", type=int, default=9464, help="Prometheus /metrics port; -1: none (9464)")
    serve.add_argument("--metrics-host", help="the address /metrics listens on (default: --host's)")
    serve.add_argument("--grace", type=float, default=10.0, help="seconds streams get to finish on SIGTERM (10)")
    serve.add_argument(
        "--workers",
        type=int,
        default=256,
        help="threads serving calls (256); an eighth kept for health and status, at most half the rest waiting (for a push, or for room)",
    )
    serve.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain (with --tls-key)")
    serve.add_argument("--tls-key", metavar="PEM", help="the TLS private key")
    serve.add_argument("--tls-client-ca", metavar="PEM", help="require client certificates from this CA (mutual TLS)")
    serve.add_argument("--tokens", metavar="FILE", help="bearer tokens (hashed) with roles and models; see auth.py")
    serve.add_argument("--max-message-bytes", type=_parse_bytes, default=64 << 20,
                       help="largest message (chunk frame) accepted (64MiB)")  # fmt: skip
    serve.add_argument("--max-streams-per-connection", type=int, default=100,
                       help="concurrent streams one connection may open (100)")  # fmt: skip
    serve.add_argument("--push-deadline", type=float, default=600.0,
                       help="seconds a push may take from header to end before it is aborted (600)")  # fmt: skip
    serve.add_argument("--etcd", metavar="URL", help="join a fleet: register in etcd://host:port/prefix with a lease")
    serve.add_argument("--advertise", metavar="HOST:PORT", help="the address to register (default: --host:--port)")
    serve.add_argument("--etcd-lease", type=int, default=5, help="seconds the etcd lease outlives a dead broker (5)")
    serve.add_argument("--keepalive", type=float, default=20.0, help="seconds between HTTP/2 pings on idle links (20)")
    serve.add_argument("--keepalive-timeout", type=float, default=10.0, help="seconds a ping may go unanswered (10)")
    serve.set_defaults(run=_serve)

    demo = commands.add_parser("demo", help="push and pull one hand-off between two processes through a broker")
    from .demo import add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(run=_demo)

    derive = commands.add_parser("contract-from-config", help="write the manifest a Hugging Face config.json implies")
    derive.add_argument("config", metavar="CONFIG.json")
    derive.add_argument("--ctx", type=int, default=4096, help="cache length in positions (4096)")
    derive.add_argument("--dtype", default="bfloat16", help="cache dtype; float8_e4m3fn and int8 add scales (bfloat16)")
    derive.add_argument("--state-dtype", default="float32", help="dtype of linear-attention memories (float32)")
    derive.add_argument("--scale", choices=["tensor", "row", "none"], help="scale tensors for quantized caches")
    derive.add_argument("--model", help="the contract's model name (default: the config's _name_or_path)")
    derive.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    derive.set_defaults(run=_contract_from_config)

    check = commands.add_parser("check-contracts", help="validate a folder of manifests and print each contract")
    check.add_argument("folder", metavar="DIR")
    check.set_defaults(run=_check_contracts)
    traffic = commands.add_parser("traffic", help="a demo worker moving hand-offs continuously (compose, dashboards)")
    traffic.add_argument("role", choices=["prefill", "decode"])
    _add_connection_flags(traffic)
    traffic.add_argument("--model", default="demo-hybrid")
    traffic.add_argument("--prefix", default="traffic")
    traffic.add_argument("--interval", type=float, default=0.5, help="seconds between hand-offs (0.5)")
    traffic.add_argument("--count", type=int, help="stop after this many (default: never)")
    traffic.set_defaults(run=_traffic)

    hashing = commands.add_parser("hash-token", help="print the sha256 a token file stores, for a token on stdin")
    hashing.set_defaults(run=_hash_token)

    status = commands.add_parser("status", help="what a live broker holds: hand-offs, bytes, contracts")
    _add_connection_flags(status)
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(run=_status)

    health = commands.add_parser("health", help="ask a broker's gRPC health service; exit 0 when SERVING")
    _add_connection_flags(health)
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(run=_health)
    for command in commands.choices.values():  # the log flags may come after the command too
        command.add_argument("--log-level", default=argparse.SUPPRESS, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                             help="as before the command")  # fmt: skip
        command.add_argument("--log-format", default=argparse.SUPPRESS, choices=["text", "json"],
                             help="as before the command")  # fmt: skip
    return parser


def _apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """`serve --config FILE.toml`: its keys are the flags' names (`max-bytes = "16GiB"`, `ttl = 120`), below the
    environment and the command line in precedence."""
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--config")
    known, _ = peek.parse_known_args(argv)
    path = known.config or os.environ.get(ENV_PREFIX + "CONFIG")
    if not path or "serve" not in argv:
        return
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    try:
        with open(path, "rb") as f:
            settings = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SystemExit(f"handoff-broker: {path}: not a readable TOML config: {e}") from None
    actions = {a.dest: a for a in serve._actions}
    for key, value in settings.items():
        dest = key.replace("-", "_")
        if dest in ("help", "config") or dest not in actions:
            raise SystemExit(f"handoff-broker: {path}: {key}: not a serve flag (see handoff-broker serve --help)")
        if ENV_PREFIX + dest.upper() in os.environ:
            continue  # the environment wins over the file
        kind = actions[dest].type
        if callable(kind) and isinstance(value, str):
            value = kind(value)
        serve.set_defaults(**{dest: value})


def main(argv: list[str] | None = None) -> int:
    try:
        import grpc_health  # noqa: F401
        import grpc_reflection  # noqa: F401
    except ImportError as e:
        print(
            f"handoff-broker: the broker needs its server extra (missing {e.name}): "
            "pip install 'handoff-broker[server]'",
            file=sys.stderr,
        )
        return 2
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    _apply_config_file(parser, argv)
    args = parser.parse_args(argv)
    if getattr(args, "env_errors", None):
        parser.error("; ".join(args.env_errors))
    handler = logging.StreamHandler()
    if args.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    level = args.log_level or ("INFO" if args.command == "serve" else "WARNING")
    logging.basicConfig(level=level, handlers=[handler])
    try:
        return args.run(args)
    except (OSError, ManifestError) as e:  # a file named on the command line that is missing or amiss
        print(f"handoff-broker {args.command}: {e}", file=sys.stderr)
        return 2


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers; the message as written, never tensor bytes."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


if __name__ == "__main__":
    sys.exit(main())
