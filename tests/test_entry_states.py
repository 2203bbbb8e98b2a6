"""An entry's state (server/store/entries.py) changes only through its transitions, which refuse the ones that make no
sense; the store's timers (server/store/timers.py) look only at what is due and stay small however many hand-offs come
and go."""

from __future__ import annotations

import threading

import pytest
from handoff_broker.store.entries import Entry, Stage, StoreConfig
from handoff_broker.store.timers import COMPACT_FLOOR, Timers
from handoff_client.protocol.contract import Carried, Contract

CONFIG = StoreConfig(max_bytes=1 << 20, ttl=300.0, lease=30.0, idle_timeout=30.0, resume_window=10.0)


def _entry() -> Entry:
    """An entry whose transitions this thread may make: it holds the lock they run under, as the store would."""
    contract = Contract("m", 4, 8, (Carried("k", 0, 4, 8, "float32"),))
    changed = threading.Condition()
    changed.acquire()
    return Entry(("m", "id"), contract, 1, CONFIG.ttl, changed, created=0.0)


def test_a_push_is_received_then_committed_then_claimed_leased_and_returned():
    entry = _entry()
    entry.begin(session=object(), interrupt=None, now=0.0)
    assert entry.stage is Stage.RECEIVING and entry.due(29.0, CONFIG) is None
    assert entry.due(30.0, CONFIG) == ("aborted", "push sent nothing for 30.0s: aborted")
    entry.commit("digest", now=5.0)
    assert entry.committed and entry.push is None and entry.expires_at == 305.0
    hold = entry.grant(7, interrupt=None, now=6.0)
    assert entry.holds(7) and not entry.holds(6) and not hold.live  # granted after the commit
    assert entry.next_due(CONFIG) == 36.0  # a streaming claim stalls after the lease
    entry.streamed_whole(lease_until=50.0)
    assert entry.due(50.0, CONFIG) == ("unclaim", "claim 7 lapsed unconfirmed")
    entry.unclaim(now=50.0)
    assert not entry.claimed and entry.last_generation == 7 and entry.expires_at == 350.0  # its ttl runs again


def test_a_broken_resumable_push_is_kept_for_the_window_then_freed():
    entry = _entry()
    entry.begin(session=object(), interrupt=None, now=0.0)
    entry.suspend(until=10.0)
    assert entry.stage is Stage.SUSPENDED and entry.due(9.9, CONFIG) is None
    assert entry.due(10.0, CONFIG) == ("aborted", "broken push not resumed in time: freed")


def test_transitions_that_make_no_sense_are_refused_where_they_happen():
    entry = _entry()
    entry.commit("digest", now=0.0)
    with pytest.raises(AssertionError):
        entry.commit("digest", now=0.0)  # committed twice
    with pytest.raises(AssertionError):
        entry.suspend(until=1.0)  # its push ended: nothing to suspend
    entry.grant(1, interrupt=None, now=0.0)
    with pytest.raises(AssertionError):
        entry.grant(2, interrupt=None, now=0.0)  # two claimants
    entry.end("confirmed")
    with pytest.raises(AssertionError):
        entry.end("expired")  # it left the store once


def test_the_timers_pop_only_what_is_due_and_stay_small_as_hand_offs_come_and_go():
    timers = Timers()
    due_soon, due_later = _entry(), _entry()
    timers.schedule(due_soon, 1.0)
    timers.schedule(due_later, 2.0)
    timers.schedule(due_soon, 1.5)  # scheduled twice: popped once
    assert timers.pop_due(1.7) == [due_soon]
    held = _entry()
    timers.schedule(held, 100.0)
    for _ in range(10 * COMPACT_FLOOR):  # short-lived hand-offs: each scheduled, then gone
        gone = _entry()
        timers.schedule(gone, 50.0)
        gone.end("confirmed")
    timers.compact(held=2)
    assert len(timers) == 2  # the live entries' items only
    assert timers.pop_due(100.0) == [due_later, held]
