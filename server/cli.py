"""The `handoff-broker` command line: its flags, their environment variables and config file, and logging; what each
command does is server/commands.py."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from handoff_client.protocol.errors import ManifestError
from handoff_client.protocol.lane import (
    DEFAULT_LANE_MIN_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_SHM_LANE_MIN_BYTES,
    MAX_CONNECTIONS,
)
from handoff_client.protocol.limits import DEFAULT_PORT

from . import audit_command, commands, status_commands
from .flag_sources import EnvDefaults, apply_config_file, env_variable, file_default
from .flags import (
    connections,
    count,
    etcd_url,
    log_format,
    log_level,
    parse_bytes,
    port,
    port_or_none,
    port_to_ask,
    positive_seconds,
    seconds,
)

_parse_bytes = parse_bytes  # (its old name, which tests and scripts import)

logger = logging.getLogger("handoff_broker")


MAX_WORKERS = 10_000
MAX_LEASE = 7 * 24 * 3600
CONTEXT = count(1, 1 << 24, "a cache length in positions")

SERVE_HELP = """Run the broker until SIGTERM or SIGINT, then drain for up to --grace seconds: new pushes, and pulls of
hand-offs it does not hold, get UNAVAILABLE; streams in flight finish and what it holds can still be pulled; it stops
when empty or at the end of the grace, and the last log line counts what was still held.

Every flag may also be set in the environment (--max-bytes as HANDOFF_MAX_BYTES, and so on) or in a TOML file given
by --config (max-bytes = "16GiB"); the command line wins over the environment, which wins over the file."""


def _add_connection_flags(command: argparse.ArgumentParser) -> None:
    """How a client command reaches a broker: its address, and TLS and a bearer token when the broker asks for them.
    The names differ from `serve`'s --tls-cert/--tls-key so that their environment variables never collide in one
    container (a HEALTHCHECK beside its broker)."""
    command.add_argument("--target", default=f"127.0.0.1:{DEFAULT_PORT}", env=True,
                         help=f"the broker, HOST[:PORT] (port {DEFAULT_PORT} when none is given)")  # fmt: skip
    command.add_argument("--tls-ca", metavar="PEM", env=True, help="connect with TLS, trusting this CA for the broker")
    command.add_argument("--tls-client-cert", metavar="PEM", env=True,
                         help="this client's certificate chain (mutual TLS)")  # fmt: skip
    command.add_argument("--tls-client-key", metavar="PEM", env=True, help="this client's private key (mutual TLS)")
    command.add_argument("--tls-server-name", metavar="NAME", env=True,
                         help="the name the broker's certificate must carry")  # fmt: skip
    command.add_argument("--token-file", metavar="FILE", env=True,
                         help="a file holding the bearer token (never on a command line)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="handoff-broker", description="Hands LLM decode state from prefill to decode."
    )
    parser.add_argument("--version", action=_Version, help="print this release and what it runs on, and exit")
    parser.add_argument("--log-level", type=log_level, metavar="LEVEL",
                        help="DEBUG, INFO, WARNING or ERROR, any case: INFO for serve, WARNING for the other commands "
                        "[env HANDOFF_LOG_LEVEL]")  # fmt: skip
    parser.add_argument("--log-format", type=log_format, metavar="FORMAT",
                        help="one line per event, as text or json [env HANDOFF_LOG_FORMAT]")  # fmt: skip
    subcommands = parser.add_subparsers(dest="command", required=True, parser_class=EnvDefaults, metavar="COMMAND")

    serve = subcommands.add_parser("serve", help="run the broker", description=SERVE_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    serve.every_flag_from_env = True
    serve.add_argument("--config", metavar="FILE.toml", help="settings by flag name; flags and env win over it")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=port, default=50051, help="gRPC port; 0 picks a free one (default: 50051)")
    serve.add_argument("--contracts", metavar="DIR", help="folder of *.json manifests (default: embedded demo-hybrid)")
    serve.add_argument("--model-config", metavar="NAME=CONFIG.json|DIR", action="append",
                       help="serve the contract derived from a Hugging Face config.json, or a model directory's, "
                            "under NAME (as vLLM's --served-model-name; required unless the config has a "
                            "_name_or_path) (repeatable)")  # fmt: skip
    serve.add_argument("--config-ctx", type=CONTEXT, default=4096, help="cache length for --model-config (4096)")
    serve.add_argument("--config-dtype", default="bfloat16", help="cache dtype for --model-config (bfloat16)")
    serve.add_argument("--config-state-dtype", default="float32",
                       help="dtype of recurrent states (hybrids) for --model-config: the one the engine resolves "
                            "(vLLM: the model's dtype, float32 for Nemotron-H) (float32)")  # fmt: skip
    serve.add_argument("--max-bytes", type=parse_bytes, help="bytes of hand-offs held at most (default: half of RAM)")
    serve.add_argument(
        "--ttl", type=positive_seconds, default=300.0, help="seconds an unclaimed hand-off lives (default: 300)"
    )
    serve.add_argument(
        "--lease", type=positive_seconds, default=30.0, help="seconds a streamed claim waits for its confirm (30)"
    )
    serve.add_argument(
        "--idle-timeout", type=positive_seconds, default=30.0, help="seconds a push may send nothing (30)"
    )
    serve.add_argument("--resume-window", type=seconds, default=10.0,
                       help="seconds a broken resumable push is kept for its retry (10)")  # fmt: skip
    serve.add_argument("--trim-after", type=seconds, default=30.0,
                       help="seconds holding nothing before freed memory goes back to the system (30)")  # fmt: skip
    serve.add_argument(
        "--metrics-port", type=port_or_none, default=9464, help="Prometheus /metrics port; -1: none (9464)"
    )
    serve.add_argument("--metrics-host", help="the address /metrics listens on (default: --host's)")
    serve.add_argument("--health-port", type=port_or_none, default=-1,
                       help="a port serving only gRPC health, plaintext, with no thread per call, for probes "
                       "(on --host; 0: any free one); -1: none (-1; the image's is 50053)")  # fmt: skip
    serve.add_argument("--grace", type=seconds, default=10.0, help="seconds streams get to finish on SIGTERM (10)")
    serve.add_argument(
        "--workers",
        type=count(2, MAX_WORKERS, "a number of worker threads"),
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
    serve.add_argument("--max-message-bytes", type=parse_bytes, default=64 << 20,
                       help="largest message (chunk frame) and lane frame accepted (64MiB)")  # fmt: skip
    serve.add_argument("--max-streams-per-connection", type=count(1, 1 << 20, "a number of streams"), default=100,
                       help="concurrent streams one connection may open (100)")  # fmt: skip
    serve.add_argument("--push-deadline", type=positive_seconds, default=600.0,
                       help="seconds a push may take from header to end before it is aborted (600)")  # fmt: skip
    serve.add_argument("--etcd", metavar="URL", type=etcd_url,
                       help="join a fleet: register in etcd://host:port/prefix with a lease")  # fmt: skip
    serve.add_argument("--advertise", metavar="HOST:PORT", help="the address to register (default: --host:--port)")
    serve.add_argument(
        "--etcd-lease",
        type=count(1, int(MAX_LEASE), "a number of seconds"),
        default=5,
        help="seconds the etcd lease outlives a dead broker (5)",
    )
    serve.add_argument("--no-lanes", dest="lanes", action="store_false",
                       help="offer no lane: every byte on the gRPC streams")  # fmt: skip
    serve.add_argument("--no-shared-memory-lane", dest="shared_memory_lane", action="store_false",
                       help="offer no shared-memory lane to clients on this host (they take the TCP lane)")  # fmt: skip
    serve.add_argument("--lane-socket", default="",
                       help="the shared-memory lane's Unix socket (default: one in a new private directory)")  # fmt: skip
    serve.add_argument("--lane-port", type=port, default=0, help="the TCP lane's port (0: any free one)")
    serve.add_argument("--lane-advertise-host", default="",
                       help="the host clients open lanes to (default: the one they reached the broker at)")  # fmt: skip
    serve.add_argument("--lane-min-bytes", type=parse_bytes, default=DEFAULT_LANE_MIN_BYTES,
                       help="the smallest hand-off moved on the TCP lane; smaller ones stay on the streams "
                       "(1MiB)")  # fmt: skip
    serve.add_argument("--shared-memory-lane-min-bytes", type=parse_bytes, default=DEFAULT_SHM_LANE_MIN_BYTES,
                       help="the smallest hand-off moved on the shared-memory lane; a smaller one from this host "
                       "takes the TCP lane (16MiB)")  # fmt: skip
    serve.add_argument("--lane-max-connections", type=connections, default=DEFAULT_MAX_CONNECTIONS,
                       help="the most TCP connections one call's lane may be striped over, "
                       f"1..{MAX_CONNECTIONS} ({DEFAULT_MAX_CONNECTIONS})")  # fmt: skip
    serve.add_argument(
        "--keepalive", type=positive_seconds, default=20.0, help="seconds between HTTP/2 pings on idle links (20)"
    )
    serve.add_argument(
        "--keepalive-timeout", type=positive_seconds, default=10.0, help="seconds a ping may go unanswered (10)"
    )
    serve.set_defaults(run=commands.serve)

    demo = subcommands.add_parser("demo", help="push and pull one hand-off between two processes through a broker")
    from .demo import add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(run=commands.demo)

    derive = subcommands.add_parser(
        "contract-from-config", help="write the manifest a Hugging Face config.json implies"
    )
    derive.add_argument("config", metavar="CONFIG.json|DIR", help="a Hugging Face config.json, or a model directory")
    derive.add_argument("--ctx", type=CONTEXT, default=4096, help="cache length in positions (4096)")
    derive.add_argument("--dtype", default="bfloat16", help="cache dtype; float8_e4m3fn and int8 add scales (bfloat16)")
    derive.add_argument("--state-dtype", default="float32", help="dtype of linear-attention memories (float32)")
    derive.add_argument("--scale", choices=["tensor", "row", "none"], help="scale tensors for quantized caches")
    derive.add_argument("--model", help="the contract's model name, as vLLM's --served-model-name "
                        "(required unless the config has a _name_or_path)")  # fmt: skip
    derive.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    derive.set_defaults(run=commands.contract_from_config)

    check = subcommands.add_parser("check-contracts", help="validate a folder of manifests and print each contract")
    check.add_argument("folder", metavar="DIR", help="a folder of *.json manifests")
    check.set_defaults(run=commands.check_contracts)
    traffic = subcommands.add_parser(
        "traffic", help="a demo worker moving hand-offs continuously (compose, dashboards)"
    )
    traffic.add_argument("role", choices=["prefill", "decode"], help="push hand-offs (prefill) or pull them (decode)")
    _add_connection_flags(traffic)
    traffic.add_argument("--model", default="demo-hybrid", help="the contract to move hand-offs of (demo-hybrid)")
    traffic.add_argument("--prefix", default="traffic", help="hand-off ids are PREFIX-0, PREFIX-1, ... (traffic)")
    traffic.add_argument("--interval", type=seconds, default=0.5, help="seconds between hand-offs (0.5)")
    traffic.add_argument(
        "--count", type=count(1, 1 << 62, "a number of hand-offs"), help="stop after this many (default: never)"
    )
    traffic.set_defaults(run=commands.traffic)

    audit_command.add_parser(subcommands, _add_connection_flags)  # (a client command: the transformers extra)

    hashing = subcommands.add_parser("hash-token", help="print the sha256 a token file stores, for a token on stdin")
    hashing.set_defaults(run=commands.hash_token_command)

    status = subcommands.add_parser("status", help="what a live broker holds: hand-offs, bytes, contracts")
    _add_connection_flags(status)
    status.add_argument("--timeout", type=positive_seconds, default=5.0, help="seconds to wait for the answer (5)")
    status.set_defaults(run=status_commands.status)

    health = subcommands.add_parser("health", help="ask a broker's gRPC health service; exit 0 when SERVING")
    _add_connection_flags(health)
    health.add_argument("--timeout", type=positive_seconds, default=3.0, help="seconds to wait for the answer (3)")
    health.add_argument("--health-port", type=port_to_ask, metavar="PORT",
                        help="ask the broker's health port (serve --health-port) on --target's host instead: "
                        "plaintext, the TLS flags unused; -1: the main port (a broker serving none)")  # fmt: skip
    health.add_argument("--service", default="", type=_health_service,
                        help='the health service to ask: "" (the broker itself: liveness) or handoff.v1.Fleet (in its '
                        "fleet's set: readiness) (\"\")")  # fmt: skip
    health.set_defaults(run=status_commands.health)
    for choice in subcommands._choices_actions:  # each command's --help opens with what it does
        command = subcommands.choices[choice.dest]
        command.description = command.description or choice.help[0].upper() + choice.help[1:] + "."
    for command in subcommands.choices.values():  # the log flags may come after the command too
        command.add_argument("--log-level", default=argparse.SUPPRESS, type=log_level, metavar="LEVEL",
                             help="as before the command")  # fmt: skip
        command.add_argument("--log-format", default=argparse.SUPPRESS, type=log_format, metavar="FORMAT",
                             help="as before the command")  # fmt: skip
    return parser


SERVER_COMMANDS = ("serve", "demo")  # they run a broker; every other command needs only the client library
INSTALL_SERVER = (
    "pip install '.[server]' from a clone of the repository, or "
    "pip install 'handoff-broker[server] @ git+https://<its git URL>' from git"
)
"""What installs the server extra: the package is on no index, so the hint names both ways that work."""


def _health_service(name: str) -> str:
    """A health service name, as the request carries it (at most 127 bytes: one length byte)."""
    if len(name.encode()) > 127 or not name.isprintable():
        raise argparse.ArgumentTypeError(f"`{name[:40]}` is not a health service name (printable, at most 127 bytes)")
    return name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    apply_config_file(parser, argv)
    args = parser.parse_args(argv)
    if getattr(args, "env_errors", None):
        parser.error("; ".join(args.env_errors))
    for flag, parse, default in (("--log-level", log_level, None), ("--log-format", log_format, "text")):
        dest, variable = flag[2:].replace("-", "_"), env_variable(flag)
        if getattr(args, dest) is None:  # not on the command line (argparse checked it there): the environment's
            try:
                from_file = file_default(args, flag)
                setattr(args, dest, parse(os.environ[variable]) if variable in os.environ else from_file or default)
            except argparse.ArgumentTypeError as e:
                parser.error(f"{variable}={os.environ[variable]!r} is not a valid {flag}: {e}")
    if args.command in SERVER_COMMANDS and (missing := _missing_server_extra()):
        print(f"handoff-broker {args.command}: runs a broker, which needs the server extra (missing {missing}): "
              f"{INSTALL_SERVER}", file=sys.stderr)  # fmt: skip
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
    except BrokenPipeError:  # `handoff-broker status | head`: the reader has gone, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush cannot fail again)
        return 0
    except (OSError, ManifestError) as e:  # a file named on the command line that is missing or amiss
        print(f"handoff-broker {args.command}: {e}", file=sys.stderr)
        return 2


class _Version(argparse.Action):
    """`--version`: the version line, read only when asked for (the HEALTHCHECK's `health` never reads metadata)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"handoff-broker {version_line()}")
        parser.exit()


def version_line() -> str:
    """This release, and what it runs on: `0.2.0 (Python 3.11.9, grpcio 1.76.0)`."""
    import platform

    from handoff_client import __version__

    try:
        from importlib.metadata import version

        grpcio = version("grpcio")
    except Exception:  # noqa: BLE001 - a version line never fails over a missing detail
        grpcio = "unknown"
    return f"{__version__} (Python {platform.python_version()}, grpcio {grpcio})"


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
