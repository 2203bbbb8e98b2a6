"""What each command-line value may be, checked in one place: the `type` functions every flag of every command uses.

A value passes through one of these however it is given: on the command line (argparse then names the flag), in a
`HANDOFF_*` variable (server/cli.py names the variable) or as a key of `serve --config FILE.toml` (it names the file
and the key). Each refusal is one line; none is a traceback.

Invariants of what passes:
- a port is an integer 0..65535 (0: any free one); `--metrics-port` also takes -1, no endpoint; a port to ask
  (`health --health-port`) is 1..65535 (0 is no port a broker listens on), or -1: the main port;
- a duration is a finite number of seconds, at most MAX_SECONDS; above 0 where 0 would end at once what must last
  (`--ttl`, `--lease`, `--idle-timeout`, `--push-deadline`, keepalives, timeouts), 0 or more where 0 means "none"
  (`--grace`, `--resume-window`, `--trim-after`, `--interval`);
- a count is an integer within the bounds its flag states.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from urllib.parse import urlparse

from handoff_client.protocol.lane import MAX_CONNECTIONS

MAX_PORT = 65535
MAX_SECONDS = 7 * 24 * 3600.0
"""A week: longer than anything a hand-off waits for, and short enough that every timer, and gRPC's keepalive in
milliseconds (a C int), holds it."""


def port(text: str) -> int:
    """A TCP port to listen on, 0..65535 (0: any free one)."""
    value = _integer(text)
    if value is None or not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"`{text}` is not a port: 0..{MAX_PORT} (0: any free one)")
    return value


def port_or_none(text: str) -> int:
    """A port as `port` reads it, or -1: none."""
    value = _integer(text)
    if value is None or not -1 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"`{text}` is not a port: 0..{MAX_PORT} (0: any free one), or -1 for none")
    return value


def port_to_ask(text: str) -> int:
    """A port to connect to, 1..65535, or -1: none (`health --health-port`: the main port then)."""
    value = _integer(text)
    if value is None or not (value == -1 or 1 <= value <= MAX_PORT):
        raise argparse.ArgumentTypeError(f"`{text}` is not a port to ask: 1..{MAX_PORT}, or -1 for the main port")
    return value


def seconds(text: str) -> float:
    """A finite duration of 0 seconds or more (0: none), at most MAX_SECONDS."""
    return _seconds(text, above_zero=False)


def positive_seconds(text: str) -> float:
    """A finite duration above 0 seconds, at most MAX_SECONDS."""
    return _seconds(text, above_zero=True)


def count(low: int, high: int, what: str) -> Callable[[str], int]:
    """An integer in low..high; `what` names it in the refusal ("a number of worker threads")."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"`{text}` is not {what} in {low}..{high}")
        return value

    parse.__name__ = what
    return parse


def log_level(text: str) -> str:
    """A logging level name in any case, as logging spells it (DEBUG, INFO, WARNING, ERROR)."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"`{text}` is not a log level: {', '.join(LOG_LEVELS)}, in any case")
    return level


def etcd_url(text: str) -> str:
    """Where a broker registers in its fleet: `etcd://host:port[/prefix]` (or `http://`), etcd's gateway."""
    parsed = urlparse(text)
    try:
        has_port = parsed.port is not None
    except ValueError:  # a port that is no number, or out of range
        has_port = False
    if parsed.scheme not in ("etcd", "http") or not parsed.hostname or not has_port:
        raise argparse.ArgumentTypeError(f"`{text[:100]}` is not an etcd address: etcd://host:port/prefix, etcd's "
                                         "gateway (port 2379 by default)")  # fmt: skip
    return text


def log_format(text: str) -> str:
    """`text` or `json`, in any case."""
    word = text.strip().lower()
    if word not in LOG_FORMATS:
        raise argparse.ArgumentTypeError(f"`{text}` is not a log format: {' or '.join(LOG_FORMATS)}")
    return word


BYTE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,  # binary
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,  # binary, as docker -m and kubectl's Gi mean
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,  # decimal
}  # fmt: skip
SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
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


def connections(text: str) -> int:
    """A lane's connection count, 1..MAX_CONNECTIONS."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 0 < value <= MAX_CONNECTIONS:
        raise argparse.ArgumentTypeError(f"`{text}` is not a number of connections in 1..{MAX_CONNECTIONS}")
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")


def _seconds(text: str, *, above_zero: bool) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    bound = "above 0" if above_zero else "0 or more"
    if not math.isfinite(value) or value < 0 or (above_zero and value == 0) or value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"`{text}` is not a duration: a finite number of seconds, {bound}, at most {MAX_SECONDS:.0f} (a week)"
        )
    return value


def _integer(text: str) -> int | None:
    """`text` as a whole number; None when it is not one."""
    try:
        return int(str(text).strip())
    except ValueError:
        return None
