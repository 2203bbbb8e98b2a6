"""handoff_broker: the broker that holds a prompt's carried decode state between its prefill and its decode.

Modules, each with one job:
    contracts  the contracts served (manifest folder, or the embedded demo)
    store      the hand-off state machine, capacity, expiry, leases, claims; no gRPC
    pushes     a push's checks chunk by chunk, and its commit or its byte-for-byte repeat
    service    the servicer: proto <-> store, errors -> status, once
    auth       bearer tokens, roles and model scopes, as a server interceptor
    metrics    every metric, on an injected registry
    memory     allocator settings, so RSS follows the bytes held
    app        build_server(config) -> (broker, port): servicer, health, reflection, metrics, TLS, drain
    cli        the `handoff-broker` command
    demo       the end-to-end demo behind `handoff-broker demo`
"""

from .app import Broker, BrokerConfig, build_server

__all__ = ["Broker", "BrokerConfig", "build_server"]
