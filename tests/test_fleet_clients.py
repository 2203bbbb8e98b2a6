"""The fleet client's pulls as a decoder streams them (`pull_tensors`, the vLLM connector's path) and its connections
to each broker (client/fleet/_pulls.py, client/fleet/_clients.py), against real brokers on loopback.

- `pull_tensors` over two brokers finds each hand-off where it is, by ticket or by rendezvous order, yields every
  tensor and confirms; a broker whose lane cannot be reached is pulled from on the stream within the same iteration;
  a ticket naming the wrong broker is that broker's answer (the ticket is followed), and errors name their broker.
- A push pinned to a broker (`place`, then `push(broker=)`: the connector's ticket is minted before the push) goes
  there alone, and its failure is reported, naming it, not sent elsewhere.
- A broker that leaves the set has its connection closed once the last call on it ends, never under that call.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from conftest import assert_same_bits, seeded_tensors
from handoff_client import BrokerUnavailable, FleetClient, HandoffClient, MalformedRequest, WaitTimedOut
from handoff_client.fleet import make_ticket, read_ticket, rendezvous
from test_claims import wait_until
from test_fleet_etcd import running_etcd

MODEL = "every-dtype"


def ids_for(broker: str, brokers: list[str], prefix: str, count: int) -> list[str]:
    """`count` hand-off ids whose first broker in rendezvous order is `broker`."""
    found = (f"{prefix}{i}" for i in range(10_000))
    return [i for i in found if rendezvous(brokers, MODEL, i)[0] == broker][:count]


def streamed(pulled) -> dict:
    """Iterate a pull to its end as the connector does, keeping each tensor's last yield; the confirmed hand-off's
    arrays must be the ones yielded."""
    arrived = {carried.name: array for carried, array in pulled}
    assert_same_bits(arrived, pulled.handoff.state)
    return arrived


def test_pull_tensors_over_two_brokers_finds_each_hand_off_by_ticket_or_by_placement(start_broker, contracts):
    a, b = start_broker(), start_broker(lane_min_bytes=1, shared_memory_lane=False, lane_advertise_host="127.0.0.2")
    brokers = sorted([a.address, b.address])
    tensors = seeded_tensors(contracts[MODEL])
    with HandoffClient(",".join(brokers), timeout=10) as prefill, HandoffClient(",".join(brokers), timeout=10) as dec:
        assert isinstance(dec, FleetClient)
        on_a, on_b = ids_for(a.address, brokers, "a", 2), ids_for(b.address, brokers, "b", 2)
        tickets = {i: prefill.push(MODEL, i, 1, tensors).ticket for i in on_a + on_b}
        assert {read_ticket(tickets[i])["b"] for i in on_b} == {b.address}
        for handoff_id in (on_a[0], on_b[0]):  # by ticket
            pulled = dec.pull_tensors(MODEL, handoff_id, ticket=tickets[handoff_id])
            assert_same_bits(streamed(pulled), tensors)
            assert pulled.position == 1 and pulled.broker == read_ticket(tickets[handoff_id])["b"]
            # b's TCP lane is advertised where nothing listens: the pull left it for the stream, within the call.
            assert pulled.left_its_lane == (handoff_id in on_b)
        for handoff_id in (on_a[1], on_b[1]):  # without one: by rendezvous order
            pulled = dec.pull_tensors(MODEL, handoff_id)
            assert_same_bits(streamed(pulled), tensors)
            assert pulled.broker == (a.address if handoff_id in on_a else b.address)
    assert a.store.stats().ready == b.store.stats().ready == 0


def test_a_fleet_pull_tensors_follows_its_ticket_and_names_the_broker_that_answered(start_broker, contracts):
    a, b = start_broker(), start_broker()
    brokers = sorted([a.address, b.address])
    tensors = seeded_tensors(contracts[MODEL])
    fingerprint = contracts[MODEL].fingerprint
    with HandoffClient(",".join(brokers), timeout=10) as fleet:
        handoff_id = ids_for(a.address, brokers, "t", 1)[0]
        fleet.push(MODEL, handoff_id, 1, tensors)
        wrong = make_ticket(b.address, MODEL, handoff_id, fingerprint)  # names the broker that does not hold it
        started = time.monotonic()
        with pytest.raises(WaitTimedOut, match=f"broker {b.address}"):
            list(fleet.pull_tensors(MODEL, handoff_id, ticket=wrong, timeout=0.5))
        assert time.monotonic() - started < 3
        with pytest.raises(MalformedRequest, match="the ticket is for"):
            fleet.pull_tensors(MODEL, "other", ticket=wrong)
        assert a.store.stats().ready == 1  # untouched: the pull went to the ticket's broker only
        b.stop(grace=0)
        with pytest.raises(BrokerUnavailable, match=f"broker {b.address}"):
            list(fleet.pull_tensors(MODEL, handoff_id, ticket=wrong, timeout=5))
        ticket = make_ticket(a.address, MODEL, handoff_id, fingerprint)
        assert_same_bits(streamed(fleet.pull_tensors(MODEL, handoff_id, ticket=ticket)), tensors)


def test_a_push_pinned_to_its_placed_broker_goes_there_alone_and_fails_there_by_name(start_broker, contracts):
    a, b = start_broker(), start_broker()
    brokers = sorted([a.address, b.address])
    tensors = seeded_tensors(contracts[MODEL])
    with HandoffClient(",".join(brokers), timeout=5) as fleet:
        handoff_id = ids_for(a.address, brokers, "p", 1)[0]
        assert fleet.place(MODEL, handoff_id) == a.address
        result = fleet.push(MODEL, handoff_id, 1, tensors, broker=a.address)
        assert read_ticket(result.ticket)["b"] == a.address and a.store.stats().ready == 1
        with pytest.raises(MalformedRequest, match="never been in this client's broker set"):
            fleet.push(MODEL, "x", 1, tensors, broker="127.0.0.1:1")
        a.stop(grace=0)
        with pytest.raises(BrokerUnavailable, match=f"broker {a.address}"):
            fleet.push(MODEL, handoff_id + "-again", 1, tensors, broker=a.address)
    assert b.store.stats().ready == 0  # not placed elsewhere behind the ticket's back


def connections_to(port: int) -> int:
    """This host's established TCP connections whose remote end is `port` on loopback (the clients' side)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def test_a_broker_that_left_the_set_has_its_connection_closed_once_its_last_call_ends(
    tmp_path, start_broker, contracts, monkeypatch
):
    import handoff_client.fleet._client as fleet_module

    monkeypatch.setattr(fleet_module, "LEFT_RECENTLY", 0.5)  # (60 s in service: how long a pull may look there)
    tensors = seeded_tensors(contracts[MODEL])
    with running_etcd(tmp_path) as (etcd, _):
        staying, leaving = start_broker(etcd=etcd, etcd_lease=2), start_broker(etcd=etcd, etcd_lease=2)
        brokers = sorted([staying.address, leaving.address])
        port = int(leaving.address.rsplit(":", 1)[1])
        with HandoffClient(etcd, refresh=0.2, timeout=20) as fleet:
            wait_until(lambda: sorted(fleet._set.brokers()) == brokers, 5)
            for i in ids_for(staying.address, brokers, "s", 1) + ids_for(leaving.address, brokers, "l", 1):
                fleet.push(MODEL, i, 1, tensors)
            assert connections_to(port) == 1  # the fleet client's one connection to it
            # A pull under way on the leaving broker, waiting for its push, across its departure.
            late = ids_for(leaving.address, brokers, "late", 1)[0]
            got: dict = {}
            pulling = threading.Thread(target=lambda: got.update(fleet.pull(MODEL, late, timeout=15).state))
            pulling.start()
            wait_until(lambda: leaving.admission.waiting.taken == 1, 5)
            leaving.registration.stop(revoke=True)  # out of the set, still serving what it holds
            wait_until(lambda: leaving.address not in fleet._set.brokers(), 5)
            time.sleep(1.2)  # past LEFT_RECENTLY, and the clients' sweep interval
            fleet.pull(MODEL, ids_for(staying.address, brokers, "s", 1)[0])  # a call that sweeps
            assert connections_to(port) == 1, "closed under the pull still using it"
            with HandoffClient(leaving.address) as direct:
                direct.push(MODEL, late, 1, tensors)
            pulling.join(10)
            assert_same_bits(got, tensors)
            wait_until(lambda: connections_to(port) == 0, 5)  # the pull's end closed it
            # A ticket naming it is still followed, on a connection of its own, closed when its call has ended.
            ticket = make_ticket(leaving.address, MODEL, ids_for(leaving.address, brokers, "l", 1)[0],
                                 contracts[MODEL].fingerprint)  # fmt: skip
            assert_same_bits(fleet.pull(MODEL, read_ticket(ticket)["i"], ticket=ticket).state, tensors)
            time.sleep(1.1)  # the clients' sweep interval
            fleet.list_contracts()  # a call that sweeps
            wait_until(lambda: connections_to(port) == 0, 5)


def test_closing_the_fleet_client_under_a_pull_on_a_departed_broker_ends_that_pull_with_its_own_error(
    tmp_path, start_broker, contracts, monkeypatch
):
    """close() ends every call at once, a pull on a retired client (its broker left the set) too: that pull ends
    with its own error, not one from the bookkeeping of a client close() has already taken."""
    import handoff_client.fleet._client as fleet_module
    from handoff_client import HandoffError

    monkeypatch.setattr(fleet_module, "LEFT_RECENTLY", 0.5)
    with running_etcd(tmp_path) as (etcd, _):
        staying, leaving = start_broker(etcd=etcd, etcd_lease=2), start_broker(etcd=etcd, etcd_lease=2)
        brokers = sorted([staying.address, leaving.address])
        fleet = HandoffClient(etcd, refresh=0.2, timeout=20)
        wait_until(lambda: sorted(fleet._set.brokers()) == brokers, 5)
        late = ids_for(leaving.address, brokers, "late", 1)[0]
        ended: list[BaseException] = []

        def pull() -> None:
            try:
                fleet.pull(MODEL, late, timeout=15)
            except BaseException as e:  # noqa: BLE001 - what the pull ends with is what the test reads
                ended.append(e)

        pulling = threading.Thread(target=pull)
        pulling.start()
        wait_until(lambda: leaving.admission.waiting.taken == 1, 5)
        leaving.registration.stop(revoke=True)
        wait_until(lambda: leaving.address not in fleet._set.brokers(), 5)
        time.sleep(1.2)  # past LEFT_RECENTLY and the sweep interval
        fleet.list_contracts()  # a call that sweeps: the pull's client is retired, still held
        fleet.close()
        pulling.join(10)
        assert not pulling.is_alive() and len(ended) == 1
        assert isinstance(ended[0], HandoffError), repr(ended[0])
