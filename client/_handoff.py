"""`HandoffClient(target)`: the one name a worker needs, for one broker or a fleet of them.

It sits above both clients, so that neither imports the other's way: the one-broker client (_client.py) knows
nothing of fleets, and the fleet (handoff_client.fleet) uses the one-broker client, never the reverse.
"""

from __future__ import annotations

from ._client import BrokerClient
from .fleet import FleetClient, is_fleet


class HandoffClient(BrokerClient):
    """A connection to one broker (BrokerClient: push, pull, cancel, status). Thread-safe.

    A target that names several brokers — `"host1:50051,host2:50051"`, `"dns:///brokers.ns.svc:50051"` or
    `"etcd://host:2379/prefix"` — makes a FleetClient instead (handoff_client.fleet), with the same methods: worker
    code does not change between one broker and fifty.
    """

    def __new__(cls, target: str, **options: object) -> HandoffClient:  # noqa: PYI034 - a FleetClient for a fleet
        if cls is HandoffClient and is_fleet(target):
            return FleetClient(target, **options)  # type: ignore[return-value]
        return super().__new__(cls)
