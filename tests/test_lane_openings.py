"""What a lane's opening may make the broker hold (docs/lanes.md, "What a call may hold"): a worker thread waiting for
a lane is let go the moment its call ends, and its admission slot with it, not before; an idle connection to the
lane port holds one of the openings only for a while and never starves a call's own; a lane that cannot open is given
up by both sides within the opening deadline, the call going on the stream.

Each test runs a real broker on loopback, with a long --idle-timeout (30 s), so that a call waiting it out shows.
"""

from __future__ import annotations

import sys
import time

from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from grpc_health.v1 import health_pb2, health_pb2_grpc
from handoff_client import HandoffClient
from handoff_client._lane import new_capability
from lane_wire import LARGE, TCP_ONLY, pull_call
from support import open_channel

IDLE = 30.0  # the brokers' --idle-timeout: what a call that waits it out would take
PROMPT = 1.0  # what health and status must answer within


def health_answers(address: str) -> bool:
    with open_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=PROMPT)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def threads_waiting_on_a_lane() -> list[str]:
    """The threads of this process (the broker's among them) asleep in a call's wait for its lane."""
    waiting = []
    for ident, frame in sys._current_frames().items():
        stack = frame
        while stack is not None:
            if stack.f_code.co_name == "open" and stack.f_code.co_filename.endswith("lane_calls.py"):
                waiting.append(str(ident))
                break
            stack = stack.f_back
    return waiting


def settles(condition, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_pull_cancelled_while_its_broker_waits_for_its_lane_lets_the_thread_go_at_once(start_broker):
    """A decoder that reads a pull's header, which offers a lane, then cancels, again and again: each pull's handler
    is woken as its call ends, so the broker's few worker threads are never all asleep on lanes nobody will open.
    Health, status and a push on the stream answer promptly throughout, and nothing is left held. (Each handler
    once slept --idle-timeout, its admission slot given back meanwhile: with 8 workers, health stopped answering.)"""
    broker = start_broker(contracts={"large": LARGE}, workers=8, idle_timeout=IDLE, max_bytes=64 << 20, **TCP_ONLY)
    tensors = seeded_tensors(LARGE)
    with HandoffClient(broker.address, timeout=10) as client:
        client.push("large", "r", 1, tensors)
        for cycle in range(3 * broker.config.workers):
            started = time.monotonic()
            stream = pull_call(broker.address, "r", new_capability())
            assert next(stream).HasField("lane")
            stream.close()  # the decoder is gone: its call is cancelled, its lane never opened
            assert health_answers(broker.address)
            client.status(timeout=PROMPT)
            assert time.monotonic() - started < 3 * PROMPT, f"cycle {cycle} took {time.monotonic() - started:.1f} s"
        started = time.monotonic()
        client.push("large", "other", 1, tensors, timeout=5)
        assert time.monotonic() - started < 3 * PROMPT
        assert settles(lambda: not threads_waiting_on_a_lane()), threads_waiting_on_a_lane()
        assert settles(lambda: broker.admission.streams.taken == 0)
        assert broker.registry.get_sample_value("handoff_streams_in_flight", {"kind": "pull"}) == 0
        assert_same_bits(client.pull("large", "r").state, tensors)
        assert_same_bits(client.pull("large", "other").state, tensors)
    assert_holds_nothing(broker)
