"""A hand-off goes to exactly one decode worker, and a worker that dies does not lose it or leave half of it.

The deaths here are real: worker processes killed with SIGKILL in the middle of their streams.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import AlreadyClaimed, HandoffClient, HandoffError, HandoffGone, PushAborted
from support import open_channel, raw_pull

EVERY_PATH = True  # each test on the gRPC streams, the TCP lane and the shared-memory lane (conftest.PATHS)

WORKERS = Path(__file__).parent / "workers.py"


def start_worker(*args: str) -> subprocess.Popen:
    worker = subprocess.Popen([sys.executable, str(WORKERS), *args], stdout=subprocess.PIPE, text=True)
    line = worker.stdout.readline()
    assert line.strip() == "stalled", f"worker did not reach its stall: {line!r}"
    return worker


def kill(worker: subprocess.Popen) -> None:
    worker.kill()
    worker.wait(timeout=10)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_two_pullers_racing_for_one_hand_off_exactly_one_gets_it(broker, client):
    contract = client.get_contract("demo-hybrid")
    tensors = seeded_tensors(contract)
    outcomes: list[object] = []
    go = threading.Barrier(3)

    def decode() -> None:
        with HandoffClient(broker.address) as decoder:
            go.wait()
            try:
                outcomes.append(decoder.pull("demo-hybrid", "contested", timeout=20))
            except HandoffError as e:
                outcomes.append(e)

    threads = [threading.Thread(target=decode) for _ in range(2)]
    for t in threads:
        t.start()
    go.wait()
    time.sleep(0.2)  # both are waiting for the push
    client.push("demo-hybrid", "contested", 3, tensors)
    for t in threads:
        t.join(timeout=30)
    winners = [o for o in outcomes if not isinstance(o, HandoffError)]
    losers = [o for o in outcomes if isinstance(o, HandoffError)]
    assert len(winners) == 1 and len(losers) == 1
    assert_same_bits(winners[0].state, tensors)
    assert isinstance(losers[0], (AlreadyClaimed, HandoffGone))  # the claim is held, or already confirmed
    assert_holds_nothing(broker)


def test_a_puller_killed_mid_stream_leaves_the_hand_off_whole_for_the_next(start_broker):
    broker = start_broker(lease=60.0)  # the hand-off must come back because the stream broke, not by a lease
    with HandoffClient(broker.address) as client:
        contract = client.get_contract("wide-attention")  # 64 MiB: more than the connection buffers
        tensors = seeded_tensors(contract)
        client.push("wide-attention", "req", 100, tensors)
        worker = start_worker("pull-and-stall", broker.address, "wide-attention", "req")
        assert broker.store.stats().claimed == 1
        kill(worker)
        wait_until(lambda: broker.store.stats().ready == 1)
        handoff = client.pull("wide-attention", "req", timeout=10)
        assert handoff.position == 100
        assert_same_bits(handoff.state, tensors)
        assert_holds_nothing(broker)


def test_a_pull_cancelled_mid_stream_returns_the_claim_at_once(broker, client):
    contract = client.get_contract("wide-attention")
    tensors = seeded_tensors(contract, seed=5)
    client.push("wide-attention", "req", 1, tensors)
    with open_channel(broker.address) as channel:
        stream = raw_pull(channel, "wide-attention", "req")
        next(stream)
        stream.cancel()
    wait_until(lambda: broker.store.stats().ready == 1)
    assert_same_bits(client.pull("wide-attention", "req").state, tensors)


def test_a_claim_streamed_whole_but_never_confirmed_returns_after_its_lease(start_broker):
    broker = start_broker(lease=0.3)
    with HandoffClient(broker.address) as client:
        contract = client.get_contract("every-dtype")
        tensors = seeded_tensors(contract)
        client.push("every-dtype", "req", 1, tensors)
        with open_channel(broker.address) as channel:
            messages = list(raw_pull(channel, "every-dtype", "req"))  # the whole stream, and no confirm
        first_claim = messages[0].claim
        with pytest.raises(AlreadyClaimed):
            client.pull("every-dtype", "req", timeout=0.1)
        wait_until(lambda: broker.store.stats().ready == 1)
        assert_same_bits(client.pull("every-dtype", "req").state, tensors)
        assert broker.store.stats().tombstones == 1 and first_claim > 0


def test_a_pusher_killed_mid_stream_leaves_nothing_visible_and_frees_its_memory(broker, client):
    worker = start_worker("push-and-stall", broker.address, "wide-attention", "req")
    stats = broker.store.stats()
    assert (stats.receiving, stats.resident_bytes) == (1, client.get_contract("wide-attention").nbytes)
    kill(worker)
    wait_until(lambda: broker.store.stats().resident_bytes == 0)
    assert_holds_nothing(broker)
    with pytest.raises(PushAborted):  # a late puller hears at once that the push failed
        client.pull("wide-attention", "req", timeout=0.3)
    tensors = seeded_tensors(client.get_contract("wide-attention"), seed=8)
    client.push("wide-attention", "req", 2, tensors)  # the prefill's retry goes through
    assert_same_bits(client.pull("wide-attention", "req").state, tensors)
