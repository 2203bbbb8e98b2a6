"""Three brokers serving as one: rendezvous placement spreads hand-offs and both sides agree without talking;
tickets lead a decoder straight to the broker; a broker that dies loses only what it held, and says so; a broker
that drains takes no new work."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from conftest import assert_same_bits, seeded_tensors
from handoff_client import (
    BrokerUnavailable,
    FleetClient,
    HandoffClient,
    MalformedRequest,
    Shard,
    WaitTimedOut,
    join_shards,
    shard_arrays,
)
from handoff_client.fleet import make_ticket, read_ticket, rendezvous
from support import chunk_frames, header_frame, raw_push
from test_claims import wait_until
from test_tensor_parallel import MODELS as TP_MODELS

MODEL = "every-dtype"


@pytest.fixture
def fleet(start_broker):
    return [start_broker() for _ in range(3)]


def target(brokers) -> str:
    return ",".join(b.address for b in brokers)


def test_hand_offs_spread_over_every_broker_and_are_pulled_without_tickets(fleet, contracts):
    tensors = seeded_tensors(contracts[MODEL])
    with HandoffClient(target(fleet)) as prefill, HandoffClient(target(fleet)) as decode:
        assert isinstance(prefill, FleetClient)
        for i in range(30):
            prefill.push(MODEL, f"r{i}", 1, tensors)
        held = Counter({b.address: b.store.stats().ready for b in fleet})
        print("hand-offs per broker:", dict(held))
        assert sum(held.values()) == 30 and all(n > 0 for n in held.values())
        for i in range(30):
            assert_same_bits(decode.pull(MODEL, f"r{i}").state, tensors)
    assert all(b.store.stats().resident_bytes == 0 for b in fleet)


def test_both_sides_agree_on_the_broker_from_the_set_alone(fleet):
    addresses = [b.address for b in fleet]
    assert rendezvous(addresses, MODEL, "r") == rendezvous(list(reversed(addresses)), MODEL, "r")
    first = {rendezvous(addresses, MODEL, f"r{i}")[0] for i in range(50)}
    assert first == set(addresses)


def test_a_ticket_leads_the_decoder_straight_to_its_broker(fleet, contracts):
    tensors = seeded_tensors(contracts[MODEL])
    with HandoffClient(target(fleet)) as prefill, HandoffClient(target(fleet)) as decode:
        result = prefill.push(MODEL, "t", 1, tensors)
        holder = rendezvous([b.address for b in fleet], MODEL, "t")[0]
        assert read_ticket(result.ticket) == {
            "b": holder,
            "m": MODEL,
            "i": "t",
            "f": contracts[MODEL].fingerprint,
            "n": next(b for b in fleet if b.address == holder).incarnation,
        }
        assert_same_bits(decode.pull(MODEL, "t", ticket=result.ticket).state, tensors)
        with pytest.raises(MalformedRequest, match="is not a hand-off ticket"):
            decode.pull(MODEL, "t", ticket="garbage")
        with pytest.raises(MalformedRequest, match="the ticket is for every-dtype/t, not every-dtype/u"):
            decode.pull(MODEL, "u", ticket=result.ticket)


def test_a_dead_broker_loses_only_what_it_held_and_pullers_hear_which(fleet, contracts):
    tensors = seeded_tensors(contracts[MODEL])
    with HandoffClient(target(fleet)) as prefill, HandoffClient(target(fleet), timeout=3) as decode:
        tickets = {f"r{i}": prefill.push(MODEL, f"r{i}", 1, tensors).ticket for i in range(12)}
        victim = fleet[0]
        lost = {i for i in tickets if rendezvous([b.address for b in fleet], MODEL, i)[0] == victim.address}
        victim.stop(grace=0)
        for handoff_id, ticket in tickets.items():
            if handoff_id in lost:
                with pytest.raises(BrokerUnavailable, match=f"broker {victim.address}"):
                    decode.pull(MODEL, handoff_id, ticket=ticket, timeout=2)
            else:
                assert_same_bits(decode.pull(MODEL, handoff_id, timeout=3).state, tensors)
        # New work goes around the dead broker, and is found there by the same hashing.
        for i in range(6):
            prefill.push(MODEL, f"after{i}", 1, tensors)
            assert_same_bits(decode.pull(MODEL, f"after{i}", timeout=3).state, tensors)


def test_a_draining_broker_gets_no_new_work_and_its_hand_offs_are_pulled_before_it_exits(fleet, contracts):
    import threading

    tensors = seeded_tensors(contracts[MODEL])
    draining = fleet[1]
    with HandoffClient(target(fleet)) as prefill, HandoffClient(target(fleet)) as decode:
        for i in range(12):
            prefill.push(MODEL, f"held{i}", 1, tensors)
        held = draining.store.stats().ready
        assert held > 0
        stopping = threading.Thread(target=lambda: outcome.update(stats=draining.stop(grace=20)))
        outcome: dict = {}
        stopping.start()
        wait_until(lambda: draining.store.stats().draining)
        for i in range(12):
            prefill.push(MODEL, f"new{i}", 1, tensors)
        assert draining.store.stats().ready == held  # no new work
        for i in range(12):
            assert_same_bits(decode.pull(MODEL, f"held{i}", timeout=3).state, tensors)
            assert_same_bits(decode.pull(MODEL, f"new{i}", timeout=3).state, tensors)
        stopping.join(20)
    assert outcome["stats"].resident_bytes == 0  # everything it held was pulled before it exited


def test_a_pull_for_a_hand_off_nobody_pushed_times_out(fleet):
    with HandoffClient(target(fleet)) as decode, pytest.raises(WaitTimedOut):
        decode.pull(MODEL, "never", timeout=1)


def test_a_single_broker_client_checks_its_ticket_too(broker, contracts):
    with HandoffClient(broker.address) as client:
        result = client.push(MODEL, "r", 1, seeded_tensors(contracts[MODEL]))
        assert result.ticket == make_ticket(
            broker.address, MODEL, "r", contracts[MODEL].fingerprint, broker.incarnation
        )
        client.pull(MODEL, "r", ticket=result.ticket)


def test_a_dns_name_is_resolved_to_the_broker_set(broker, contracts):
    tensors = seeded_tensors(contracts[MODEL])
    with HandoffClient(f"dns:///localhost:{broker.port}") as client:
        assert isinstance(client, FleetClient)
        assert f"127.0.0.1:{broker.port}" in client._set.brokers()
        client.push(MODEL, "via-dns", 1, tensors)
        assert_same_bits(client.pull(MODEL, "via-dns", timeout=5).state, tensors)


def test_every_rank_of_a_tensor_parallel_hand_off_meets_at_one_broker(start_broker):
    brokers = [start_broker(contracts=TP_MODELS) for _ in range(3)]
    contract = TP_MODELS["qwen2-7b"]
    full = seeded_tensors(contract)
    with HandoffClient(target(brokers)) as prefill, HandoffClient(target(brokers)) as decode:
        for i in range(6):  # ranks place by (model, id) alone, so all of one hand-off's ranks land together
            for rank in range(2):
                mine = shard_arrays(contract, full, Shard(rank, 2), pushing=True)
                prefill.push(contract.model, f"r{i}", 3, mine, shard=(rank, 2))
        for i in range(6):
            pulled = [decode.pull(contract.model, f"r{i}", shard=(rank, 4)) for rank in range(4)]
            assert_same_bits(join_shards(contract, pulled, 4).state, full)
    assert all(b.store.stats().resident_bytes == 0 for b in brokers)


def test_a_pull_without_a_ticket_finds_a_hand_off_that_takes_longer_than_the_probe_to_stream(fleet, contracts):
    """Defect 9 (issue "Nothing a client sends can wedge the broker"): the fleet's 0.2 s probe was the whole pull's
    deadline, so a probe that found and claimed a hand-off that takes longer to stream died with DEADLINE_EXCEEDED.
    The probe now waits 0.2 s for the push to begin (PullRequest.wait_seconds) and streams for the whole timeout."""
    contract = contracts["demo-hybrid"]
    tensors = seeded_tensors(contract)
    holder = rendezvous([b.address for b in fleet], contract.model, "slow")[0]
    raw_push(holder, [header_frame(contract, "slow"), *chunk_frames(contract, tensors, 1024)], timeout=60)
    with HandoffClient(target(fleet), timeout=20) as decode:
        started = time.monotonic()
        assert_same_bits(decode.pull(contract.model, "slow").state, tensors)
    print(f"4,233 chunks streamed in {time.monotonic() - started:.2f} s")  # (past the probe's 0.2 s)


def test_a_ticket_naming_a_broker_outside_the_set_is_not_followed(fleet, contracts, caplog):
    """Defect 11: a ticket is unsigned, and `pull(ticket=)` connected to whatever address it named, with the
    decoder's token and TLS keys. A ticket only chooses among the client's brokers; another is pulled by hashing."""
    tensors = seeded_tensors(contracts[MODEL])
    with HandoffClient(target(fleet)) as prefill, HandoffClient(target(fleet), timeout=5) as decode:
        prefill.push(MODEL, "t", 1, tensors)
        forged = make_ticket("203.0.113.9:50051", MODEL, "t", contracts[MODEL].fingerprint)  # a host of its choosing
        assert_same_bits(decode.pull(MODEL, "t", ticket=forged).state, tensors)
    assert "203.0.113.9:50051, which has never been in this client's broker set" in caplog.text


def test_a_cancel_given_the_broker_a_push_was_placed_on_goes_there_and_nowhere_else(fleet, contracts):
    """The vLLM producer cancels a failed push where it placed it: that broker frees it, the others are not asked
    (no tombstone there), and a broker never in the set is refused by name."""
    tensors = seeded_tensors(contracts[MODEL])
    addresses = [b.address for b in fleet]
    placed = rendezvous(addresses, MODEL, "p")[-1]  # not where rendezvous would look first
    with HandoffClient(target(fleet)) as client:
        client.push(MODEL, "p", 1, tensors, broker=placed)
        assert client.cancel(MODEL, "p", broker=placed)
        assert {b.address: b.store.stats().tombstones for b in fleet} == {a: int(a == placed) for a in addresses}
        assert {b.address: b.store.stats().resident_bytes for b in fleet} == dict.fromkeys(addresses, 0)
        with pytest.raises(MalformedRequest, match="has never been in this client's broker set"):
            client.cancel(MODEL, "p", broker="127.0.0.1:1")
