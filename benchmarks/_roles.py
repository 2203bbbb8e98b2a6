"""The entry point of every role process the comparisons start (`_harness.spawn`): `python _roles.py ROLE ARGS...`
runs `role_<ROLE>` (dashes for underscores) from the role modules, its arguments converted by their names (ports,
sizes, counts and ranks are integers; the rest strings), under the allocator settings the broker sets for itself."""

from __future__ import annotations

import sys
from collections.abc import Callable

import _baselines
import _grpc_relay
import _handoff_roles
import latency

INTEGERS = ("port", "nbytes", "runs", "iterations", "pairs", "rank", "tp")


def roles() -> dict[str, Callable[..., None]]:
    """Every role by its command-line name."""
    found = {}
    for module in (_baselines, _grpc_relay, _handoff_roles, latency):
        for name, fn in vars(module).items():
            if name.startswith("role_") and callable(fn):
                found[name[len("role_") :].replace("_", "-")] = fn
    return found


def main(argv: list[str]) -> int:
    from handoff_client import tune_allocator

    tune_allocator()  # every path's processes run with the allocator settings the broker sets for itself
    fn = roles()[argv[0]]
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    fn(*[int(value) if name in INTEGERS else value for name, value in zip(names, argv[1:], strict=False)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
