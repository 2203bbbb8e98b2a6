"""What pushes waiting for room hold outside --max-bytes is bounded (docs/lifecycle.md, "Memory"): a push stream's
bytes in flight before the broker reads them are at most its HTTP/2 window, STREAM_WINDOW_BYTES, however long it
waits. Measured on a broker in its own process, as its monitor and the OOM killer see it."""

from __future__ import annotations

import threading
import time

import numpy as np
from broker_process import BrokerProcess
from handoff_broker.app import STREAM_WINDOW_BYTES
from handoff_client import HandoffClient, HandoffError, RetryPolicy
from handoff_client.protocol.contract import Carried, Contract

MiB = 1 << 20
BIG = Contract("big", 2, 64, (Carried("b", 0, 2048, 4096, "float32"),))  # 32 MiB
WAITING = 24


def test_pushes_waiting_for_room_hold_at_most_their_stream_window_each(tmp_path):
    """24 pushes of 32 MiB wait for room on a full broker, streaming as fast as the broker lets them. Once, the
    transport took in up to the whole hand-off of each (BDP-grown windows): 40 such pushes held 1.28 GiB beside a
    64 MiB --max-bytes; now each holds at most its window."""
    tensors = {"b": np.ones((2048, 4096), np.float32)}
    args = ("--max-bytes", "64MiB", "--no-lanes", "--idle-timeout", "30")
    with BrokerProcess(tmp_path, [BIG], *args) as broker:
        with HandoffClient(broker.address, lanes=False) as client:
            client.push("big", "held-1", 1, tensors)
            client.push("big", "held-2", 1, tensors)  # full: every later push waits for room
        time.sleep(0.5)
        before = broker.rss()
        refusals: list[str] = []

        def wait_for_room(n: int) -> None:
            try:
                with HandoffClient(broker.address, lanes=False, timeout=8, retry=RetryPolicy(attempts=1)) as c:
                    c.push("big", f"waiting-{n}", 1, tensors)
            except HandoffError as e:
                refusals.append(e.reason)

        threads = [threading.Thread(target=wait_for_room, args=(n,)) for n in range(WAITING)]
        for t in threads:
            t.start()
        time.sleep(4)  # (each streams what its window lets it, then waits)
        grown = broker.rss() - before
        with HandoffClient(broker.address) as client:
            assert client.status().receiving == 0  # none was admitted
        for t in threads:
            t.join(20)
    assert sorted(set(refusals)) == ["CAPACITY_EXHAUSTED"] and len(refusals) == WAITING
    bound = WAITING * STREAM_WINDOW_BYTES + 32 * MiB
    assert grown <= bound, f"{WAITING} waiting pushes grew the broker {grown / MiB:.0f} MiB (bound {bound / MiB:.0f})"


TWO = Contract("two", 2, 64, (Carried("b", 0, 512, 1024, "float32"),))  # 2 MiB


def test_many_pushes_waiting_on_a_full_small_broker_hold_a_bounded_sum_of_windows(tmp_path):
    """Each waiting push's window is bounded, and so is their sum: the waiting pushes' windows are counted against
    a budget (an eighth of --max-bytes, at least 16 MiB), and a push past it is refused at once. Before, 60 pushes
    waiting on a full 2 MiB broker grew it 120 MiB, 200 as much as the waiting budget let wait (the issue saw 270)."""
    tensors = {"b": np.ones((512, 1024), np.float32)}
    with BrokerProcess(tmp_path, [TWO], "--max-bytes", "2MiB", "--no-lanes", "--grace", "0") as broker:
        with HandoffClient(broker.address, lanes=False) as client:
            client.push("two", "held", 1, tensors)  # full
        time.sleep(0.5)
        before = broker.rss()
        clients = [
            HandoffClient(broker.address, lanes=False, timeout=4, retry=RetryPolicy(attempts=1)) for _ in range(8)
        ]  # fmt: skip (at most 100 streams a connection)
        refusals: list[str] = []

        def wait_for_room(n: int) -> None:
            try:
                clients[n % len(clients)].push("two", f"waiting-{n}", 1, tensors)
            except HandoffError as e:
                refusals.append(e.reason)

        for pushes, bound in ((60, 20 * MiB), (200, 40 * MiB)):
            refusals.clear()
            threads = [threading.Thread(target=wait_for_room, args=(n,)) for n in range(pushes)]
            for t in threads:
                t.start()
            time.sleep(2.5)  # (each streams what its window lets it, then waits, or is refused)
            grown = broker.rss() - before
            for t in threads:
                t.join(15)
            assert len(refusals) == pushes and "CAPACITY_EXHAUSTED" in refusals
            assert grown < bound, f"{pushes} waiting pushes grew the broker {grown / MiB:.0f} MiB"
        for client in clients:
            client.close()
