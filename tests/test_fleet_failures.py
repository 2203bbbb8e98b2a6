"""A fleet client never waits out its timeout for a broker that restarted or froze, against real broker processes
(tests/broker_process.py): a ticket names its broker's incarnation, so a pull by ticket after a restart is refused
at once, by name (BrokerRestarted); and the client's keepalive (handoff_client._calls.KEEPALIVE_MS, which the broker
permits) finds a frozen broker (SIGSTOP: its sockets stay open, as a hung process's or one behind a partition that
drops packets) within seconds, so a push goes to the next broker and a ticket pull ends BrokerUnavailable naming it.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest
from broker_process import BrokerProcess
from conftest import assert_same_bits, seeded_tensors
from handoff_broker import BrokerConfig, build_server
from handoff_broker.restarts import GRACE_ENV, RESTART_GRACE_SECONDS
from handoff_client import BrokerRestarted, BrokerUnavailable, HandoffClient, HandoffError, HandoffGone
from handoff_client.fleet import make_ticket, read_ticket, rendezvous
from handoff_client.protocol.contract import Carried, Contract

SMALL = Contract("small", 64, 64, (Carried("k", 0, 64, 256, "float32"),))
TENSORS = seeded_tensors(SMALL)
FAST = ("--grace", "0")  # (a broker stopped with hand-offs held stops at once)


def _brokers(stack: ExitStack, *folders: Path) -> list[BrokerProcess]:
    """A broker process in each folder, started at once (each takes seconds to import and bind), stopped by
    `stack`."""
    for folder in folders:
        folder.mkdir()
    with ThreadPoolExecutor(len(folders)) as pool:
        brokers = list(pool.map(lambda folder: BrokerProcess(folder, [SMALL], *FAST), folders))
    for broker in brokers:
        stack.callback(broker.stop)
    return brokers


def _raises(call, *args, **kwargs) -> tuple[HandoffError, float]:
    started = time.monotonic()
    with pytest.raises(HandoffError) as raised:
        call(*args, **kwargs)
    return raised.value, time.monotonic() - started


def _first_on(broker: str, brokers: list[str], prefix: str) -> str:
    """A hand-off id whose first broker in rendezvous order is `broker`."""
    return next(f"{prefix}-{n}" for n in range(1000) if rendezvous(brokers, SMALL.model, f"{prefix}-{n}")[0] == broker)


def test_a_pull_by_ticket_after_its_broker_restarted_is_refused_at_once_by_name(tmp_path):
    """The ticket named only the address: the broker restarted there had no record of the hand-off, and a pull by
    ticket waited 8 s of 8 and then said it "was not pushed"."""
    with ExitStack() as stack:
        other, first = _brokers(stack, tmp_path / "a", tmp_path / "b")
        address, port = first.address, first.address.rsplit(":", 1)[1]
        with HandoffClient(address) as client:
            ticket = client.push(SMALL.model, "lost", 1, TENSORS).ticket
        assert read_ticket(ticket)["n"]  # (the broker's incarnation)
        first.stop()
        with BrokerProcess(tmp_path / "b", [SMALL], *FAST, "--port", port) as again:
            assert again.address == address
            with HandoffClient(address, timeout=8) as client:
                error, took = _raises(client.pull, SMALL.model, "lost", ticket=ticket)
                assert isinstance(error, BrokerRestarted) and took < 1.0, (error, took)
                error, took = _raises(lambda: list(client.pull_tensors(SMALL.model, "lost", ticket=ticket)))
                assert isinstance(error, BrokerRestarted) and took < 1.0, (error, took)
            with HandoffClient(f"{other.address},{address}", timeout=8) as fleet:
                error, took = _raises(fleet.pull, SMALL.model, "lost", ticket=ticket)
                assert isinstance(error, BrokerRestarted) and took < 1.0, (error, took)
                assert error.fields["broker"] == address and address in error.message
                # A ticket from this incarnation is followed as ever.
                ticket = fleet.push(SMALL.model, _first_on(address, [other.address, address], "kept"), 1,
                                    TENSORS).ticket  # fmt: skip
                fields = read_ticket(ticket)
                assert_same_bits(fleet.pull(SMALL.model, fields["i"], ticket=ticket).state, TENSORS)


def test_a_ticket_made_before_its_push_is_refused_after_a_restart_only_if_its_hand_off_is_not_there(
    tmp_path, monkeypatch
):
    """A ticket's `e` (made before its push, as the vLLM connector's are: the incarnation its producer last knew,
    which may be stale) after its broker restarted: a hand-off the new incarnation does not know is refused,
    BrokerRestarted, within the broker's restart grace, and at once after it; one pushed to the new incarnation is
    served, even when the pull began waiting before the push (pull-before-push is normal for vLLM). Before `e`, such
    a ticket named no incarnation and the lost hand-off's pull waited 8 s of 8."""
    with ExitStack() as stack:
        (broker,) = _brokers(stack, tmp_path / "a")
        address, port = broker.address, broker.address.rsplit(":", 1)[1]
        with HandoffClient(address) as client:
            old = read_ticket(client.push(SMALL.model, "lost", 1, TENSORS).ticket)["n"]
        broker.stop()

        def made_before_push(handoff_id: str) -> str:
            return make_ticket(address, SMALL.model, handoff_id, SMALL.fingerprint, old, before_push=True)

        monkeypatch.setenv(GRACE_ENV, "10")  # (a grace the late push begins within however loaded the machine is)
        with (
            BrokerProcess(tmp_path / "a", [SMALL], *FAST, "--port", port),
            HandoffClient(address, timeout=8) as client,
            ThreadPoolExecutor(1) as pool,
        ):
            pulling = pool.submit(client.pull, SMALL.model, "late", ticket=made_before_push("late"))
            time.sleep(0.2)
            client.push(SMALL.model, "late", 1, TENSORS)
            assert_same_bits(pulling.result(timeout=8).state, TENSORS)
        monkeypatch.delenv(GRACE_ENV)  # (the default grace: the lost hand-off is refused within it, at once after)
        with BrokerProcess(tmp_path / "a", [SMALL], *FAST, "--port", port), HandoffClient(address, timeout=8) as client:
            error, took = _raises(client.pull, SMALL.model, "lost", ticket=made_before_push("lost"))
            assert isinstance(error, BrokerRestarted) and took < RESTART_GRACE_SECONDS + 0.5, (error, took)
            assert error.fields["expected"] == old and old in error.message
            client.push(SMALL.model, "held", 1, TENSORS)
            time.sleep(max(0.0, RESTART_GRACE_SECONDS - took))  # (the grace is over)
            error, took = _raises(
                lambda: list(client.pull_tensors(SMALL.model, "lost", ticket=made_before_push("lost")))
            )
            assert isinstance(error, BrokerRestarted) and took < 0.5, (error, took)
            assert_same_bits(client.pull(SMALL.model, "held", ticket=made_before_push("held")).state, TENSORS)
            # A push of the refused hand-off that comes late (its decoder has recomputed) is refused, not held.
            error, took = _raises(client.push, SMALL.model, "lost", 1, TENSORS)
            assert isinstance(error, HandoffGone) and took < 1.0, (error, took)


def test_a_restarted_brokers_grace_runs_from_when_its_port_serves(monkeypatch):
    """The grace ran from when the servicer was built: a broker slow to start (here 2.5 s between build_server and
    start) had spent it before serving, and refused a pull naming its former incarnation at once, although the
    hand-off's push came 0.3 s after the pull began."""
    monkeypatch.setenv(GRACE_ENV, "2.5")
    broker, _ = build_server(BrokerConfig(host="127.0.0.1", port=0, contracts={SMALL.model: SMALL}, lanes=False))
    time.sleep(2.5)
    broker.start()
    ticket = make_ticket(broker.address, SMALL.model, "late", SMALL.fingerprint, "0123456789abcdef", before_push=True)
    try:
        with HandoffClient(broker.address, timeout=8) as client, ThreadPoolExecutor(1) as pool:
            pulling = pool.submit(client.pull, SMALL.model, "late", ticket=ticket)
            time.sleep(0.3)
            client.push(SMALL.model, "late", 1, TENSORS)
            assert_same_bits(pulling.result(timeout=8).state, TENSORS)
    finally:
        broker.stop(grace=0)


def test_a_frozen_broker_is_left_within_seconds_and_named(tmp_path):
    """One of two brokers frozen: a push placed on it took 20.0 s of 20 and never tried the other; a ticket pull
    took 20 s and ended DeadlineExceeded, not naming the broker."""
    with ExitStack() as stack:
        live, frozen = _brokers(stack, tmp_path / "a", tmp_path / "b")
        brokers = [live.address, frozen.address]
        with HandoffClient(",".join(brokers), timeout=20) as fleet:
            held = _first_on(frozen.address, brokers, "held")
            ticket = fleet.push(SMALL.model, held, 1, TENSORS).ticket  # (the fleet's connection to it is up)
            assert read_ticket(ticket)["b"] == frozen.address
            os.kill(frozen.pid, signal.SIGSTOP)
            try:
                placed = _first_on(frozen.address, brokers, "placed")
                started = time.monotonic()
                result = fleet.push(SMALL.model, placed, 1, TENSORS)
                took = time.monotonic() - started
                assert read_ticket(result.ticket)["b"] == live.address and took < 10, took
                error, took = _raises(fleet.pull, SMALL.model, held, ticket=ticket)
                assert type(error) is BrokerUnavailable and took < 10, (error, took)
                assert error.fields["broker"] == frozen.address and frozen.address in error.message
            finally:
                os.kill(frozen.pid, signal.SIGCONT)
