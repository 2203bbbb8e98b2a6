"""Position 0, as the .proto states it (PushHeader.position): a tensor whose rows are positions has 0 filled rows and
0 bytes, so no chunk names it; it is complete as it is (not MISSING_TENSOR), keeps its index in the filled contract
(the digest's entries of later tensors use it), and adds no digest entry; PullHeader.bytes is the hand-off's bytes.
Through a real broker on loopback, as a client written from the .proto would speak to it."""

from __future__ import annotations

from conftest import seeded_tensors
from handoff_broker.contracts import default_contracts
from handoff_client import HandoffClient
from handoff_client.protocol.frames import crc32c, handoff_digest
from handoff_client.protocol.messages import handoff_pb2 as pb
from support import chunk_frames, header_frame, open_channel, raw_pull, raw_push

DEMO = default_contracts()["demo-hybrid"]


def test_a_hand_off_at_position_0_sends_no_chunk_for_the_caches_and_keeps_every_index(start_broker):
    broker = start_broker(contracts={DEMO.model: DEMO})
    tensors = seeded_tensors(DEMO)
    state = {c.name: tensors[c.name] for c in DEMO.carried if not c.rows_are_positions}
    assert len(state) < len(DEMO.carried)  # the caches are left out, not sent empty
    pushed = raw_push(broker.address, [header_frame(DEMO, "zero", position=0), *chunk_frames(DEMO, state, 1 << 20)])
    nbytes = sum(array.nbytes for array in state.values())
    entries = [(DEMO.index(name), 0, array.nbytes, crc32c(array.reshape(-1).view("uint8"))) for name, array in
               state.items()]  # fmt: skip
    assert (pushed.bytes, pushed.digest) == (nbytes, handoff_digest(entries))

    with open_channel(broker.address) as channel:
        header, *chunks, end = list(raw_pull(channel, DEMO.model, "zero"))
    assert isinstance(header, pb.PullHeader) and isinstance(end, pb.PullEnd)
    assert (header.position, header.bytes, len(chunks), end.digest) == (0, nbytes, len(state), pushed.digest)

    with HandoffClient(broker.address, timeout=20) as client:  # the client, given whole caches, sends the same
        assert client.push(DEMO.model, "zero-2", 0, tensors).digest == pushed.digest
        pulled = client.pull(DEMO.model, "zero-2", timeout=10)
    for c in DEMO.carried:
        assert pulled.state[c.name].shape == ((0, c.cols) if c.rows_are_positions else c.shape)
