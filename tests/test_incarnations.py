"""The vLLM producer's knowledge of each broker's incarnation (client/vllm/_incarnations.py), against real brokers on
loopback: learned once per connection and forgotten the moment the connection breaks, not polled."""

from __future__ import annotations

import threading
import time

import pytest
from handoff_broker import BrokerConfig, build_server
from handoff_broker.service import HandoffBrokerServicer
from handoff_client.protocol.contract import Carried, Contract
from handoff_client.vllm._incarnations import REFRESH_SECONDS, Incarnations
from handoff_client.vllm._settings import ConnectorSettings
from test_claims import wait_until

SMALL = Contract("small", 64, 64, (Carried("k", 0, 64, 256, "float32"),))


def broker_at(port: int = 0):
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=port, contracts={SMALL.model: SMALL}, lanes=False))
    return broker.start()


@pytest.fixture
def get_lanes_calls(monkeypatch) -> list[float]:
    """When each GetLanes call reached a broker of this process (the real method, counted)."""
    calls: list[float] = []
    real = HandoffBrokerServicer.GetLanes

    def counted(self, request, context):
        calls.append(time.monotonic())
        return real(self, request, context)

    monkeypatch.setattr(HandoffBrokerServicer, "GetLanes", counted)
    return calls


def test_a_restarted_brokers_incarnation_is_forgotten_at_once_and_the_new_one_learned(get_lanes_calls):
    """Polled every 0.5 s, each producer cost each broker 2 GetLanes calls a second, idle or not, and went on naming a
    restarted broker's old incarnation for up to 1 s. Now: one call per connection (plus a refresh every 10 s), the
    old incarnation forgotten as the connection breaks, the new one learned as the next one is made."""
    broker = broker_at()
    port = broker.port
    incarnations = Incarnations(ConnectorSettings(target=broker.address), SMALL.model)
    try:
        assert incarnations.of(broker.address) == ""  # (not asked for before: learned from now on)
        wait_until(lambda: incarnations.of(broker.address) == broker.incarnation, timeout=5)
        time.sleep(2.0)
        assert len(get_lanes_calls) == 1, get_lanes_calls  # (0.5 s polling: 5)
        assert incarnations.of(broker.address) == broker.incarnation
        old = broker.incarnation
        broker.stop(grace=0)
        stopped = time.monotonic()
        wait_until(lambda: incarnations.of(broker.address) == "", timeout=1.0)
        print(f"forgotten {time.monotonic() - stopped:.3f} s after the stop")
        broker = broker_at(port)
        assert broker.incarnation != old
        wait_until(lambda: incarnations.of(broker.address) == broker.incarnation, timeout=REFRESH_SECONDS / 2)
        print(f"the new incarnation learned {time.monotonic() - stopped:.3f} s after the stop")
    finally:
        incarnations.close()
        broker.stop(grace=0)


def test_a_frozen_broker_costs_no_other_its_incarnation(get_lanes_calls):
    """Asked one after another with a 0.4 s deadline, three brokers that did not answer made a round longer than the
    1 s age bound, and every broker's incarnation aged out. Now each broker's ask is its own: one whose answer does
    not come (held here past the ask's deadline) leaves the others named."""
    release = threading.Event()
    real = HandoffBrokerServicer.GetLanes
    frozen: list[str] = []

    def held(self, request, context):  # (the first broker answers nothing until released)
        if self.incarnation.value in frozen:
            release.wait(5)
        return real(self, request, context)

    HandoffBrokerServicer.GetLanes = held  # (before the brokers are built: their handlers bind it)
    brokers = [broker_at() for _ in range(3)]
    frozen.append(brokers[0].incarnation)
    incarnations = Incarnations(ConnectorSettings(target=brokers[1].address), SMALL.model)
    try:
        for broker in brokers:
            incarnations.of(broker.address)
        others = brokers[1:]
        wait_until(lambda: all(incarnations.of(b.address) == b.incarnation for b in others), timeout=3)
        assert incarnations.of(brokers[0].address) == ""
    finally:
        HandoffBrokerServicer.GetLanes = real
        release.set()
        incarnations.close()
        for broker in brokers:
            broker.stop(grace=0)
