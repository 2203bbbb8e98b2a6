"""Where `handoff-broker` flags come from besides the command line: `HANDOFF_*` environment variables and
`serve --config FILE.toml`. The command line wins over the environment, which wins over the file; every value from
either is read by its flag's own type (server/flags.py), so it is refused alike, naming the variable or the key.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Callable
from typing import NoReturn

from .flags import log_format, log_level

ENV_PREFIX = "HANDOFF_"


class EnvDefaults(argparse.ArgumentParser):
    """Every `--some-flag` of `serve` may also come from `HANDOFF_SOME_FLAG`, and so may the connection flags of
    the client commands (`HANDOFF_TARGET`, `HANDOFF_TLS_CA`, ...: the same broker for `status`, `health` and
    `traffic`, and no name a `serve` flag has); the command line wins. No other flag reads the environment, so no
    variable means two things (a `--model` of `demo` and one of `traffic`). A value that is not valid is one line
    naming the variable, when that command runs (never a traceback, nor an error in another command, such as the
    `health` a container's HEALTHCHECK runs)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.env_errors: list[str] = []
        self.every_flag_from_env = False  # `serve`: set once made, before its flags are added
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def add_argument(self, *names: str, env: bool = False, **kwargs: object) -> argparse.Action:
        flag = next((n for n in names if n.startswith("--")), None)
        if flag is not None and (env or (self.every_flag_from_env and flag not in TOP_LEVEL_FLAGS)):
            variable = env_variable(flag)
            if variable in os.environ:
                kind = kwargs.get("type", str)
                if kwargs.get("action") in ("store_true", "store_false"):  # a switch: HANDOFF_NO_LANES=1 sets it
                    kind = _switch(kwargs["action"] == "store_true")
                elif kwargs.get("action") == "append":  # a repeatable flag: one value from the environment
                    kind = _one_of_many(kind)
                try:
                    kwargs["default"] = kind(os.environ[variable])  # type: ignore[operator]
                except (ValueError, argparse.ArgumentTypeError) as e:  # said if this command runs, not otherwise
                    self.env_errors.append(f"{variable}={os.environ[variable]!r} is not a valid {flag}: {e}")
                    self.set_defaults(env_errors=self.env_errors)
            kwargs["help"] = f"{kwargs.get('help', '')} [env {variable}]"
        return super().add_argument(*names, **kwargs)


TOP_LEVEL_FLAGS = ("--help", "--log-level", "--log-format")  # read from the environment before any command
FILE_TOP_LEVEL = {"log-level": log_level, "log-format": log_format}
"""The top-level flags `serve --config FILE.toml` may set too, each read by its flag's type."""


def env_variable(flag: str) -> str:
    """The environment variable a flag may come from: `--max-bytes` -> `HANDOFF_MAX_BYTES`."""
    return ENV_PREFIX + flag[2:].replace("-", "_").upper()


def _one_of_many(parse: Callable[[str], object]) -> Callable[[str], list[object]]:
    """How a repeatable flag's environment variable reads: one value, as a list of it."""
    return lambda text: [parse(text)]


def _switch(set_means: bool) -> Callable[[str], bool]:
    """How a switch's environment variable reads: 1/true/yes/on set the switch, 0/false/no/off leave it unset."""

    def parse(text: str) -> bool:
        word = text.strip().lower()
        if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError("a switch is 1/true/yes/on or 0/false/no/off")
        return set_means if word in ("1", "true", "yes", "on") else not set_means

    return parse


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
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
        _refuse(f"handoff-broker: {path}: not a readable TOML config: {e}")
    actions = {option[2:]: a for a in serve._actions for option in a.option_strings if option.startswith("--")}
    for key, value in settings.items():
        if key in FILE_TOP_LEVEL:  # read by main() below the environment: see file_default
            try:
                parser.set_defaults(**{f"file_{key.replace('-', '_')}": FILE_TOP_LEVEL[key](_string(value))})
            except (TypeError, argparse.ArgumentTypeError) as e:
                _refuse(f"handoff-broker: {path}: {key} = {value!r}: {e}")
            continue
        action = actions.get(key)
        if action is None or key in ("help", "config", *(flag[2:] for flag in TOP_LEVEL_FLAGS)):
            _refuse(f"handoff-broker: {path}: {key}: not a serve flag (see handoff-broker serve --help)")
        if env_variable("--" + key) in os.environ:
            continue  # the environment wins over the file
        try:
            serve.set_defaults(**{action.dest: _config_value(action, value)})
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            _refuse(f"handoff-broker: {path}: {key} = {value!r}: {e}")


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError("a string")
    return value


def file_default(args: argparse.Namespace, flag: str) -> object:
    """The value the TOML file gives a top-level flag (`log-level`, `log-format`), or None: below the command line
    and the environment, which main() reads first."""
    return getattr(args, f"file_{flag[2:].replace('-', '_')}", None)


def _config_value(action: argparse.Action, value: object) -> object:
    """A TOML value as its flag would have it, checked by the flag's own type (so `ttl = -5` is refused as
    `--ttl -5` is): a switch takes true or false, a repeatable flag a list of strings, any other a string or a
    number."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise TypeError("a switch: true or false")
        return value == isinstance(action, argparse._StoreTrueAction)
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise TypeError('a list of strings: ["..."]')
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError("a string or a number")
    kind = action.type or str
    return kind(value if isinstance(value, str) else repr(value))  # (repr: 1e-05 stays a number kind can read)


def _refuse(message: str) -> NoReturn:
    """One line on stderr, and exit status 2 as argparse's own refusals have."""
    print(message, file=sys.stderr)
    raise SystemExit(2)
