"""The `handoff-broker` command line: its flags, their environment variables and config file, and logging; what each
command does is server/commands.py."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tomllib
from collections.abc import Callable

from handoff_client._errors import ManifestError
from handoff_client._lane import (
    DEFAULT_LANE_MIN_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_SHM_LANE_MIN_BYTES,
    MAX_CONNECTIONS,
)

from . import commands

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


def _connections(text: str) -> int:
    """A lane's connection count, 1..MAX_CONNECTIONS."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 0 < value <= MAX_CONNECTIONS:
        raise argparse.ArgumentTypeError(f"`{text}` is not a number of connections in 1..{MAX_CONNECTIONS}")
    return value


SERVE_HELP = """Run the broker until SIGTERM or SIGINT, then drain for up to --grace seconds: new pushes, and pulls of
hand-offs it does not hold, get UNAVAILABLE; streams in flight finish and what it holds can still be pulled; it stops
when empty or at the end of the grace, and the last log line counts what was still held.

Every flag may also be set in the environment (--max-bytes as HANDOFF_MAX_BYTES, and so on) or in a TOML file given
by --config (max-bytes = "16GiB"); the command line wins over the environment, which wins over the file."""


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
                if kwargs.get("action") in ("store_true", "store_false"):  # a switch: HANDOFF_NO_LANES=1 sets it
                    kind = _switch(kwargs["action"] == "store_true")
                try:
                    kwargs["default"] = kind(os.environ[variable])  # type: ignore[operator]
                except (ValueError, argparse.ArgumentTypeError) as e:  # said if this command runs, not otherwise
                    self.env_errors.append(f"{variable}={os.environ[variable]!r} is not a valid {flag}: {e}")
                    self.set_defaults(env_errors=self.env_errors)
            kwargs["help"] = f"{kwargs.get('help', '')} [env {variable}]"
        return super().add_argument(*names, **kwargs)


def _switch(set_means: bool) -> Callable[[str], bool]:
    """How a switch's environment variable reads: 1/true/yes/on set the switch, 0/false/no/off leave it unset."""

    def parse(text: str) -> bool:
        word = text.strip().lower()
        if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError("a switch is 1/true/yes/on or 0/false/no/off")
        return set_means if word in ("1", "true", "yes", "on") else not set_means

    return parse


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
    subcommands = parser.add_subparsers(dest="command", required=True, parser_class=_EnvDefaults)

    serve = subcommands.add_parser("serve", help="run the broker", description=SERVE_HELP,
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
    serve.add_argument(
        "--tokens",
        metavar="FILE",
        help='bearer tokens by sha256, with roles and models: {"tokens": [{"name": "prefill-pool", '
        '"sha256": "<hex>", "roles": ["prefill"], "models": ["demo-hybrid"]}]} (models optional; '
        "roles prefill, decode, admin; `hash-token` prints a sha256)",
    )
    serve.add_argument("--max-message-bytes", type=_parse_bytes, default=64 << 20,
                       help="largest message (chunk frame) and lane frame accepted (64MiB)")  # fmt: skip
    serve.add_argument("--max-streams-per-connection", type=int, default=100,
                       help="concurrent streams one connection may open (100)")  # fmt: skip
    serve.add_argument("--push-deadline", type=float, default=600.0,
                       help="seconds a push may take from header to end before it is aborted (600)")  # fmt: skip
    serve.add_argument("--etcd", metavar="URL", help="join a fleet: register in etcd://host:port/prefix with a lease")
    serve.add_argument("--advertise", metavar="HOST:PORT", help="the address to register (default: --host:--port)")
    serve.add_argument("--etcd-lease", type=int, default=5, help="seconds the etcd lease outlives a dead broker (5)")
    serve.add_argument("--no-lanes", dest="lanes", action="store_false",
                       help="offer no lane: every byte on the gRPC streams")  # fmt: skip
    serve.add_argument("--no-shared-memory-lane", dest="shared_memory_lane", action="store_false",
                       help="offer no shared-memory lane to clients on this host (they take the TCP lane)")  # fmt: skip
    serve.add_argument("--lane-socket", default="",
                       help="the shared-memory lane's Unix socket (default: one in a new private directory)")  # fmt: skip
    serve.add_argument("--lane-port", type=int, default=0, help="the TCP lane's port (0: any free one)")
    serve.add_argument("--lane-advertise-host", default="",
                       help="the host clients open lanes to (default: the one they reached the broker at)")  # fmt: skip
    serve.add_argument("--lane-min-bytes", type=_parse_bytes, default=DEFAULT_LANE_MIN_BYTES,
                       help="the smallest hand-off moved on the TCP lane; smaller ones stay on the streams "
                       "(1MiB)")  # fmt: skip
    serve.add_argument("--shared-memory-lane-min-bytes", type=_parse_bytes, default=DEFAULT_SHM_LANE_MIN_BYTES,
                       help="the smallest hand-off moved on the shared-memory lane; a smaller one from this host "
                       "takes the TCP lane (16MiB)")  # fmt: skip
    serve.add_argument("--lane-max-connections", type=_connections, default=DEFAULT_MAX_CONNECTIONS,
                       help="the most TCP connections one call's lane may be striped over, "
                       f"1..{MAX_CONNECTIONS} ({DEFAULT_MAX_CONNECTIONS})")  # fmt: skip
    serve.add_argument("--keepalive", type=float, default=20.0, help="seconds between HTTP/2 pings on idle links (20)")
    serve.add_argument("--keepalive-timeout", type=float, default=10.0, help="seconds a ping may go unanswered (10)")
    serve.set_defaults(run=commands.serve)

    demo = subcommands.add_parser("demo", help="push and pull one hand-off between two processes through a broker")
    from .demo import add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(run=commands.demo)

    derive = subcommands.add_parser(
        "contract-from-config", help="write the manifest a Hugging Face config.json implies"
    )
    derive.add_argument("config", metavar="CONFIG.json")
    derive.add_argument("--ctx", type=int, default=4096, help="cache length in positions (4096)")
    derive.add_argument("--dtype", default="bfloat16", help="cache dtype; float8_e4m3fn and int8 add scales (bfloat16)")
    derive.add_argument("--state-dtype", default="float32", help="dtype of linear-attention memories (float32)")
    derive.add_argument("--scale", choices=["tensor", "row", "none"], help="scale tensors for quantized caches")
    derive.add_argument("--model", help="the contract's model name (default: the config's _name_or_path)")
    derive.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    derive.set_defaults(run=commands.contract_from_config)

    check = subcommands.add_parser("check-contracts", help="validate a folder of manifests and print each contract")
    check.add_argument("folder", metavar="DIR")
    check.set_defaults(run=commands.check_contracts)
    traffic = subcommands.add_parser(
        "traffic", help="a demo worker moving hand-offs continuously (compose, dashboards)"
    )
    traffic.add_argument("role", choices=["prefill", "decode"])
    _add_connection_flags(traffic)
    traffic.add_argument("--model", default="demo-hybrid")
    traffic.add_argument("--prefix", default="traffic")
    traffic.add_argument("--interval", type=float, default=0.5, help="seconds between hand-offs (0.5)")
    traffic.add_argument("--count", type=int, help="stop after this many (default: never)")
    traffic.set_defaults(run=commands.traffic)

    hashing = subcommands.add_parser("hash-token", help="print the sha256 a token file stores, for a token on stdin")
    hashing.set_defaults(run=commands.hash_token_command)

    status = subcommands.add_parser("status", help="what a live broker holds: hand-offs, bytes, contracts")
    _add_connection_flags(status)
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(run=commands.status)

    health = subcommands.add_parser("health", help="ask a broker's gRPC health service; exit 0 when SERVING")
    _add_connection_flags(health)
    health.add_argument("--timeout", type=float, default=3.0)
    health.set_defaults(run=commands.health)
    for command in subcommands.choices.values():  # the log flags may come after the command too
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


SERVER_COMMANDS = ("serve", "demo")  # they run a broker; every other command needs only the client library


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    _apply_config_file(parser, argv)
    args = parser.parse_args(argv)
    if getattr(args, "env_errors", None):
        parser.error("; ".join(args.env_errors))
    if args.command in SERVER_COMMANDS and (missing := _missing_server_extra()):
        print(f"handoff-broker {args.command}: runs a broker, which needs the server extra (missing {missing}): "
              "pip install 'handoff-broker[server]'", file=sys.stderr)  # fmt: skip
        return 2
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


def _missing_server_extra() -> str | None:
    """The first module of the server extra that is not installed, if any."""
    for module in ("grpc_health", "grpc_reflection", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            return module
    return None


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
