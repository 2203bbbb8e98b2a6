"""What `HandoffClient.status()` returns: the broker's GetStatus answer as a frozen value, not a protobuf.

Its fields keep the wire's names (`receiving`, `ready`, `claimed`, `resident_bytes`, `max_bytes`, `oldest_seconds`,
`tombstones`, `draining`, `contracts`), so code written against the protobuf reads it unchanged; `contracts` are
`Contract`s (each `.model`, `.ctx`, `.nbytes`, `.fingerprint`, ...), as `list_contracts()` gives them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol.contract import Contract
from .protocol.messages import handoff_pb2 as pb
from .protocol.wire import contract_from_proto


@dataclass(frozen=True)
class BrokerStatus:
    """What a broker holds at one moment: hand-offs by state, the bytes they reserve against its maximum, the oldest's
    age, the recently gone it remembers, whether it drains, and the contracts this caller may use."""

    receiving: int
    ready: int
    claimed: int
    resident_bytes: int
    max_bytes: int
    oldest_seconds: float
    tombstones: int
    draining: bool
    contracts: tuple[Contract, ...]

    @property
    def held(self) -> int:
        """Hand-offs held, in every state."""
        return self.receiving + self.ready + self.claimed

    @classmethod
    def from_proto(cls, message: pb.StatusResponse) -> BrokerStatus:
        return cls(
            receiving=message.receiving,
            ready=message.ready,
            claimed=message.claimed,
            resident_bytes=message.resident_bytes,
            max_bytes=message.max_bytes,
            oldest_seconds=message.oldest_seconds,
            tombstones=message.tombstones,
            draining=message.draining,
            contracts=tuple(contract_from_proto(c) for c in message.contracts),
        )
