"""handoff_broker: the broker that holds a prompt's carried decode state between its prefill and its decode.

Modules, each with one job:
    contracts  the contracts served (manifest folder, or the embedded demo)
    store      the hand-off state machine, capacity, expiry, leases, claims; no gRPC (its parts: entries, holdings,
               intake, delivery, groups, reshard, timers, ledger)
    pushes     a push's checks chunk by chunk, and its commit or its byte-for-byte repeat
    admission  the limits a client can push against, checked at the edge
    service    the servicer: proto <-> store, errors -> status, once
    auth       bearer tokens, roles and model scopes, as a server interceptor
    metrics    every metric, on an injected registry
    memory     allocator settings, so RSS follows the bytes held
    app        build_server(config) -> (broker, port): servicer, health, reflection, metrics, TLS, drain
    cli        the `handoff-broker` command line; commands, what each command does
    demo       the end-to-end demo behind `handoff-broker demo`
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import Broker, BrokerConfig, build_server

__all__ = ["Broker", "BrokerConfig", "build_server"]


def __getattr__(name: str) -> Any:
    """The broker's entry points, imported when first used: the command line imports this package, and its
    client-only commands must run where the server extra is not installed."""
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
