"""An audit read (PullRequest.audit): a committed hand-off read from one broker without claiming it, so that its
decoder's pull is untouched (docs/engines.md, "Audit"; the broker's side: server/store/audits.py).

    handoff = read_handoff(client, model, handoff_id)      # the whole hand-off, checked as a pull checks it

The read is checked exactly as a pull is (every chunk's CRC32C and bounds, every tensor whole, the digest the push was
committed under: _pulls.PulledTensors), and nothing is confirmed. A hand-off pushed by tensor-parallel ranks is held
in parts: the broker refuses a whole read naming the TP size its parts are held at (SHARD_MISMATCH, `have`), and
this reads each part and joins them (protocol.shards.join_shards). Always on the gRPC stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._pulls import PulledTensors
from .protocol.contract import Handoff
from .protocol.errors import ShardMismatch
from .protocol.messages import handoff_pb2 as pb
from .protocol.shards import Shard, as_shard, join_shards, view
from .protocol.wire import shard_to_proto

if TYPE_CHECKING:
    from ._client import BrokerClient


def read_part(client: BrokerClient, model: str, handoff_id: str, shard: Shard, timeout: float,
              wait_for_push: float | None, pushed: bool = False) -> Handoff:  # fmt: skip
    """One audit read: the hand-off, or the part `shard` names, as the broker holds it (`pushed`: as its rank pushed
    it, the tensors not split on rank 0 alone; else as a pulling rank receives it)."""
    declared = client.get_contract(model)
    request = pb.PullRequest(model=model, handoff_id=handoff_id, shard=shard_to_proto(shard),
                             wait_seconds=wait_for_push or 0.0, audit=True)  # fmt: skip
    view(declared, shard, pushing=pushed)  # (a shard that cannot be cut is refused before the stream is opened)
    stream = client._pull(request, timeout=timeout, metadata=client._metadata)
    tensors = PulledTensors(client, declared, shard, handoff_id, stream, timeout, None, request, pushing=pushed)
    for _ in tensors:
        pass
    return tensors.handoff


def read_handoff(client: BrokerClient, model: str, handoff_id: str, *, timeout: float | None = None,
                 wait_for_push: float | None = None) -> Handoff:  # fmt: skip
    """The whole hand-off `handoff_id`, read without a claim (its decoder may pull it before, during or after):
    checked as a pull is, joined from its parts where tensor-parallel ranks pushed it. Raises what a pull would
    (HandoffGone once it has been confirmed, WaitTimedOut when it was not committed within `wait_for_push` or the
    timeout)."""
    deadline = client.timeout if timeout is None else timeout
    try:
        return read_part(client, model, handoff_id, as_shard(model, None), deadline, wait_for_push)
    except ShardMismatch as e:
        size, pushed = int(e.fields.get("have", "0")), e.fields.get("side") == "pushed"
        if size < 2:
            raise
    parts = [read_part(client, model, handoff_id, Shard(rank, size), deadline, wait_for_push, pushed)
             for rank in range(size)]  # fmt: skip
    contract = client.get_contract(model).at(parts[0].position)
    if pushed:  # rank 0 alone holds the tensors not split: every part gets them, as a pulling rank would
        parts = [Handoff(p.position, {**parts[0].state, **p.state}) for p in parts]
    return join_shards(contract, parts, size)
