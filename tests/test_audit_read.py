"""Audit reads (PullRequest.audit): a committed hand-off read without a claim, so that its decoder's pull goes on as
if the read had not happened; against a real broker on loopback (server/store/audits.py, client/_audit_read.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import HandoffCancelled, HandoffGone, MalformedRequest, ShardMismatch, WaitTimedOut
from handoff_client._audit_read import read_handoff, read_part
from handoff_client._pulls import PulledTensors
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.shards import WHOLE, Shard, shard_arrays


def test_an_audit_read_claims_nothing_and_the_decoder_pulls_and_confirms_as_before(broker, client, contracts):
    """Read before, during and after the decoder's claim: each read is the hand-off bit for bit, the decoder's
    pull and confirm succeed, and once it has confirmed the hand-off is gone for a read too."""
    contract = contracts["demo-hybrid"]
    tensors = seeded_tensors(contract.at(17))
    client.push(contract.model, "req-1", 17, tensors)
    before = read_handoff(client, contract.model, "req-1")
    assert before.position == 17
    assert_same_bits(dict(before.state), tensors)
    pulled = client.pull_tensors(contract.model, "req-1", lanes=False)
    it = iter(pulled)
    next(it)  # the decoder's claim holds now
    during = read_handoff(client, contract.model, "req-1")
    assert_same_bits(dict(during.state), tensors)
    for _ in it:
        pass
    assert_same_bits(dict(pulled.handoff.state), tensors)  # confirmed
    with pytest.raises(HandoffGone):
        read_handoff(client, contract.model, "req-1")
    assert_holds_nothing(broker)


def test_an_audit_read_waits_for_the_commit_and_ends_when_the_hand_off_goes(client, contracts):
    """A read made before the push waits for its commit; a read of a hand-off cancelled says so; one never pushed
    times out as a pull's wait does."""
    contract = contracts["demo-hybrid"]
    tensors = seeded_tensors(contract.at(5), seed=3)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(read_handoff(client, contract.model, "late", wait_for_push=20)))
    reader.start()
    client.push(contract.model, "late", 5, tensors)
    reader.join(20)
    assert got and got[0].position == 5
    assert_same_bits(dict(got[0].state), tensors)
    client.cancel(contract.model, "late")
    with pytest.raises(HandoffCancelled):
        read_handoff(client, contract.model, "late")
    with pytest.raises(WaitTimedOut):
        read_handoff(client, contract.model, "never", wait_for_push=0.3)


def test_a_sharded_hand_off_is_read_part_by_part_and_joined(client, contracts):
    """A hand-off pushed by TP 2 ranks: a whole read is refused naming the held size, each part reads as pushed, and
    the joined read is the hand-off; the decoder then pulls it at TP 1 as before."""
    contract = contracts["demo-hybrid"]
    tensors = seeded_tensors(contract.at(9), seed=5)
    for rank in range(2):
        client.push(
            contract.model,
            "tp",
            9,
            shard_arrays(contract.at(9), tensors, Shard(rank, 2), pushing=True),
            shard=(rank, 2),
        )
    with pytest.raises(ShardMismatch) as refused:
        read_part(client, contract.model, "tp", WHOLE, 10, None)
    assert refused.value.fields["have"] == "2"
    joined = read_handoff(client, contract.model, "tp")
    assert_same_bits(dict(joined.state), tensors)
    pulled = client.pull(contract.model, "tp")
    assert all(np.array_equal(pulled.state[n].view(np.uint8), tensors[n].view(np.uint8)) for n in tensors)


def test_a_broker_that_answers_an_audit_read_with_a_claim_gets_it_back_at_once(client, contracts):
    """A broker of a release without audit reads ignores the flag and grants a claim (here: the request the broker
    gets carries no flag, the reader's does): the reader refuses the read and cancels it, so the claim goes back at
    once and the decoder's pull is served without waiting out a lease."""
    contract = contracts["demo-hybrid"]
    tensors = seeded_tensors(contract.at(4), seed=7)
    client.push(contract.model, "old", 4, tensors)
    asked = pb.PullRequest(model=contract.model, handoff_id="old", audit=True)
    served = pb.PullRequest(model=contract.model, handoff_id="old")  # what an earlier broker acts on
    stream = client._pull(served, timeout=10, metadata=client._metadata)
    with pytest.raises(MalformedRequest, match="answered an audit read with a claim"):
        for _ in PulledTensors(client, contract, WHOLE, "old", stream, 10, None, asked):
            pass
    pulled = client.pull(contract.model, "old", timeout=5)  # not ALREADY_CLAIMED: the claim was given back
    assert_same_bits(dict(pulled.state), tensors)
