"""What the broker and every client share: one implementation of each rule of the wire (the `.proto`,
proto/handoff/v1/handoff.proto, is its source of truth; docs/protocol.md and docs/lanes.md its specification).

    contract.py  a model's contract and a hand-off's checks (`check`, `take`), manifests
    spans.py     what of each tensor has arrived, checked chunk by chunk (TensorSpans)
    dtypes.py    the element types a contract may declare
    errors.py    the error model: one exception per reason, to and from google.rpc.Status
    frames.py    chunk frames, CRC32C and the hand-off digest
    wire.py      RPC paths from the descriptor; proto <-> contract; stream messages decoded
    limits.py    the wire's sizes and the default port
    prompts.py   the prompt digest every engine adapter computes (which prompt a hand-off belongs to)
    shards.py    tensor-parallel shards: which heads a rank holds
    lane.py      the lanes' wire: opening, frames, end marker (TCP, striped or not)
    seal.py      the sealed TCP lane of a TLS broker: HKDF keys, AES-256-GCM frames
    ring.py      the shared-memory lane's ring
    etcd.py      a fleet's etcd keys and etcd's HTTP/JSON gateway
    messages/    the message classes protoc generates from the .proto (scripts/generate_proto.py)

Public and stable within a minor version: the broker imports these modules and nothing private of the client's,
and another Python implementation of either side may import them too. Importing this package loads nothing; each
module loads what it needs.
"""
