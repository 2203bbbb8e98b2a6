"""Many brokers as one: the fleet client and what it is made of. It uses the one-broker client (handoff_client's
BrokerClient, one for each broker it talks to) and nothing of the one-broker client uses it.

    _client.py    FleetClient: placement by rendezvous hashing, pushes in score order or to a placed broker, pulls
                  by ticket or by score order; `rendezvous` (`is_fleet` is protocol/targets.py's)
    _members.py   which brokers are in the set (a list, DNS, an etcd prefix), and those that left it
    _clients.py   each broker's connection: made when a call needs it, closed once nothing needs it
    _order.py     a call's way through a hand-off's brokers (the first that answers; a pull's probes); errors named
    _pulls.py     pull_tensors over a fleet

Tickets (what a push returns and a pull follows) are the wire's, handoff_client.protocol.tickets: the one-broker
client makes them too. docs/fleet.md is the specification for a client in another language.
"""

from __future__ import annotations

from ..protocol.targets import is_fleet
from ..protocol.tickets import TICKET_PREFIX, make_ticket, read_ticket, ticket_for
from ._client import FLEET_CHANNEL_OPTIONS, FleetClient, rendezvous
from ._members import LEFT_RECENTLY, BrokerSet
from ._pulls import FleetPulledTensors

__all__ = [
    "FLEET_CHANNEL_OPTIONS",
    "LEFT_RECENTLY",
    "TICKET_PREFIX",
    "BrokerSet",
    "FleetClient",
    "FleetPulledTensors",
    "is_fleet",
    "make_ticket",
    "read_ticket",
    "rendezvous",
    "ticket_for",
]
