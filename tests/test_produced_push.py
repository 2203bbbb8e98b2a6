"""A push of tensors still being made (an iterable of (name, array) pairs, handoff_client._produced): each tensor is
sent while the next is made, the pull gets the same bits a mapping's push gives, and an iterable that fails or
falls short ends the push with its own error, the broker keeping nothing. When `push` returns or raises, the
iterable has stopped: nothing reads the caller's memory (a vLLM producer's pages) after it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from logging import ERROR

import numpy as np
import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import FleetClient, HandoffClient
from handoff_client.fleet import rendezvous, ticket_for
from handoff_client.protocol.errors import CapacityExhausted, MalformedRequest, MissingTensor, WrongLength
from proxy import Proxy
from support import broker_holds, raises_handoff_error

EVERY_PATH = True  # each test on the gRPC streams, the TCP lane and the shared-memory lane (conftest.PATHS)
DEMO = "demo-hybrid"
POSITION = 700  # its attention tensors carry 700 rows of 4,096


class Maker:
    """An iterable that yields `tensors` one at a time (in `order`), running `between(name)` after each, and records
    what it made and whether it was closed."""

    def __init__(self, tensors: dict[str, np.ndarray], order: list[str] | None = None, between=None) -> None:
        self.tensors = tensors
        self.order = order or list(tensors)
        self.between = between or (lambda name: None)
        self.made: list[str] = []
        self.runs = 0
        self.closed = threading.Event()

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        self.runs += 1
        try:
            for name in self.order:
                self.made.append(name)
                yield name, self.tensors[name]
                self.between(name)
        finally:
            self.closed.set()


def filled(client: HandoffClient, seed: int = 3) -> dict[str, np.ndarray]:
    return seeded_tensors(client.get_contract(DEMO).at(POSITION), seed=seed)


@pytest.mark.parametrize("order", ["contract", "reversed"])
def test_tensors_still_being_made_are_pulled_bit_for_bit(client: HandoffClient, broker, order):
    tensors = filled(client)
    maker = Maker(tensors, list(tensors) if order == "contract" else list(reversed(tensors)))
    result = client.push(DEMO, "r", POSITION, maker)
    assert result.bytes == sum(a.nbytes for a in tensors.values()) and maker.closed.is_set()
    assert_same_bits(client.pull(DEMO, "r", timeout=10).state, tensors)
    assert (maker.runs, sorted(maker.made)) == (1, sorted(tensors))
    assert_holds_nothing(broker)


def test_each_tensor_is_sent_while_the_next_is_still_being_made(client: HandoffClient, broker):
    """The maker holds back every tensor after the first until the broker holds the first's bytes: a push that
    made everything before sending would never get there."""
    tensors = filled(client)
    first = next(iter(tensors))
    arrived = broker_holds(broker.address, DEMO, "r", tensors[first].nbytes)

    def wait_for_the_first(name: str) -> None:
        if name != first:
            return
        deadline = time.monotonic() + 10
        while not arrived():
            if time.monotonic() > deadline:
                raise TimeoutError(f"`{first}` was not sent while the rest were being made")
            time.sleep(0.02)

    client.push(DEMO, "r", POSITION, Maker(tensors, between=wait_for_the_first))
    assert_same_bits(client.pull(DEMO, "r", timeout=10).state, tensors)


@pytest.mark.parametrize("resumable", [False, True])
def test_an_iterable_that_raises_ends_the_push_with_its_error_and_the_broker_keeps_nothing(
    client: HandoffClient, broker, caplog, resumable
):
    """Even a resumable push, which the broker keeps when its stream breaks, for a retry: there is none to come."""
    tensors = filled(client)
    names = list(tensors)
    gone = RuntimeError("the pages were freed")

    def fail_after_three(name: str) -> None:
        if name == names[2]:
            raise gone

    maker = Maker(tensors, between=fail_after_three)
    with pytest.raises(RuntimeError) as raised:
        client.push(DEMO, "r", POSITION, maker, resumable=resumable)
    assert raised.value is gone and maker.closed.is_set()
    assert maker.made == names[:3]
    assert_holds_nothing(broker, within=5)
    faults = [r.getMessage() for r in caplog.records if r.name.startswith("handoff_broker") and r.levelno >= ERROR]
    assert not faults, f"the broker took the ended push for a fault of its own: {faults}"
    again = "r-again" if resumable else "r"  # (a resumable one is cancelled, and its id with it: docs/lifecycle.md)
    client.push(DEMO, again, POSITION, tensors)  # nothing of the failed push was kept
    assert_same_bits(client.pull(DEMO, again, timeout=10).state, tensors)


def test_a_tensor_the_iterable_leaves_out_or_makes_at_the_wrong_size_is_refused_by_name(client: HandoffClient, broker):
    tensors = filled(client)
    last = list(tensors)[-1]
    left_out = Maker(tensors, order=list(tensors)[:-1])
    error = raises_handoff_error(client.push, DEMO, "r", POSITION, left_out)
    assert isinstance(error, MissingTensor) and last in error.message
    wrong = {**tensors, last: tensors[last][:-1]}
    error = raises_handoff_error(client.push, DEMO, "r", POSITION, Maker(wrong))
    assert isinstance(error, WrongLength) and last in error.message
    assert_holds_nothing(broker, within=5)


def test_an_iterable_of_the_wrong_things_is_refused_before_the_broker_is_asked(client: HandoffClient, broker):
    """A list of arrays (names left out) is refused at once, naming both forms a push takes, and the id is still
    free: the broker was never asked to take (or, for a resumable push, keep) anything."""
    tensors = filled(client)
    error = raises_handoff_error(client.push, DEMO, "r", POSITION, list(tensors.values()), resumable=True)
    assert isinstance(error, MalformedRequest) and "(name, array) pairs" in error.message
    assert_holds_nothing(broker)
    client.push(DEMO, "r", POSITION, tensors, resumable=True)
    assert_same_bits(client.pull(DEMO, "r", timeout=10).state, tensors)


def test_an_os_error_of_the_iterable_is_its_own_not_a_broken_lane(client: HandoffClient, broker, caplog):
    """(On a lane's path, conftest's stays_on_its_lane fails the test if the push took it for a broken lane and
    went on the stream.)"""
    tensors = filled(client)
    names = list(tensors)

    def time_out(name: str) -> None:
        if name == names[1]:
            raise TimeoutError("the copy out of the pages timed out")

    with pytest.raises(TimeoutError, match="timed out"):
        client.push(DEMO, "r", POSITION, Maker(tensors, between=time_out))
    assert_holds_nothing(broker, within=5)


def test_a_push_refused_before_its_bytes_has_stopped_its_iterable_when_it_raises(start_broker):
    broker = start_broker(max_bytes=1 << 20)  # less than the hand-off
    with HandoffClient(broker.address) as client:
        tensors = filled(client)
        maker = Maker(tensors, between=lambda name: time.sleep(0.05))  # (slower to make than to be refused)
        error = raises_handoff_error(client.push, DEMO, "r", POSITION, maker, wait_for_room=False)
        assert isinstance(error, CapacityExhausted)
        assert maker.closed.is_set()  # at once, not after making the rest
        assert len(maker.made) < len(tensors)
    assert_holds_nothing(broker, within=5)


def test_a_push_retried_after_its_connection_broke_sends_what_was_made_without_making_it_again(broker, path):
    if path != "stream":
        pytest.skip("a connection cut midway is the stream's retry (a lane's break: test_lanes.py)")
    proxy = Proxy(broker.port)
    try:
        proxy.cut_after(1_000_000)  # the first connection dies partway through the push
        with HandoffClient(proxy.address, lanes=False) as client:
            tensors = filled(client)
            maker = Maker(tensors)
            client.push(DEMO, "r", POSITION, maker)
            assert proxy.connections == 2 and maker.runs == 1
            assert_same_bits(client.pull(DEMO, "r", timeout=10).state, tensors)
    finally:
        proxy.close()
    assert_holds_nothing(broker)


def test_a_fleet_makes_the_tensors_once_whichever_broker_takes_them(start_broker):
    brokers = {b.address: b for b in (start_broker(), start_broker())}
    first, second = rendezvous(list(brokers), DEMO, "r")
    with FleetClient(",".join(brokers)) as fleet:
        tensors = seeded_tensors(fleet.get_contract(DEMO).at(POSITION), seed=5)
        brokers[first].store.drain()  # the push tries it first (making begins), is refused, and goes to the second
        maker = Maker(tensors)
        result = fleet.push(DEMO, "r", POSITION, maker)
        assert maker.runs == 1 and sorted(maker.made) == sorted(tensors) and maker.closed.is_set()
        assert ticket_for(result.ticket, DEMO, "r")["b"] == second
        assert_same_bits(fleet.pull(DEMO, "r", ticket=result.ticket, timeout=10).state, tensors)
