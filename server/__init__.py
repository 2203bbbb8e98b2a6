"""handoff_broker: the broker that holds a prompt's carried decode state between its prefill and its decode.

Modules, each with one job:
    contracts  the contracts served (manifest folder, or the embedded demo)
    store      the hand-off state machine, capacity, expiry, leases; no gRPC
    service    the servicer: proto <-> store, errors -> status, once
    app        build_server(config) -> (broker, port): servicer, health, reflection
    cli        the `handoff-broker` command
    demo       the end-to-end demo behind `handoff-broker demo`
"""

from .app import Broker, BrokerConfig, build_server

__all__ = ["Broker", "BrokerConfig", "build_server"]
