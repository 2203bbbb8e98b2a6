"""The connector worker's bookkeeping of each request's transfer (client/vllm/_transfers.py): a push's pages are
released exactly once, when vLLM has finished the request and the push has ended, in whichever order those come; a
load is reported exactly once, with its failure."""

from __future__ import annotations

import threading
import time

from handoff_client.vllm._transfers import Transfers


def test_a_push_s_pages_are_released_once_vllm_finished_it_and_the_push_ended_in_either_order():
    transfers = Transfers()
    transfers.push_saved("finished-first")
    transfers.push_saved("ended-first")
    assert transfers.release({"finished-first"}) == set()  # its push still under way: the pages wait
    transfers.push_ended("ended-first")
    assert transfers.release(set()) == set()  # vLLM has not finished it: nothing to release yet
    transfers.push_ended("finished-first")
    assert transfers.release(set()) == {"finished-first"}  # (vLLM told once; remembered)
    assert transfers.release({"ended-first"}) == {"ended-first"}
    assert transfers.release({"finished-first", "ended-first"}) == set()  # each released once


def test_only_requests_being_pushed_are_remembered_as_finished():
    transfers = Transfers()
    assert transfers.release({"never-saved"}) == set()
    transfers.push_saved("never-saved")  # (a later request under the same id)
    transfers.push_ended("never-saved")
    assert transfers.release(set()) == set()


def test_the_copies_a_step_waits_for_are_those_of_the_requests_named_or_of_every_push_not_released():
    transfers = Transfers()
    copied = {r: transfers.push_saved(r) for r in ("a", "b")}
    assert transfers.copies_reading(["b", "unknown"]) == [copied["b"]]
    assert transfers.copies_reading() == [copied["a"], copied["b"]]
    transfers.push_ended("a")
    assert copied["a"].is_set() and not copied["b"].is_set()  # a push that ended reads no page
    transfers.release({"a"})
    assert transfers.copies_reading() == [copied["b"]]


def test_each_load_is_reported_once_with_its_failure():
    transfers = Transfers()
    transfers.loads_started(3)
    assert transfers.loading
    transfers.load_ended("ok", failed=False)
    transfers.load_ended("bad", failed=True)
    assert transfers.take_ended_loads() == ({"ok", "bad"}, {"bad"})
    assert transfers.take_ended_loads() == (set(), set())
    transfers.load_ended("last", failed=False)
    assert not transfers.loading and transfers.take_ended_loads() == ({"last"}, set())


def test_waiting_for_a_load_returns_when_one_ends_or_at_once_when_none_is_under_way():
    transfers = Transfers()
    started = time.monotonic()
    transfers.wait_for_a_load(60)
    assert time.monotonic() - started < 30  # none under way: no wait at all
    transfers.loads_started(1)
    ending = threading.Timer(0.2, transfers.load_ended, args=("req",), kwargs={"failed": False})
    ending.start()
    started = time.monotonic()
    transfers.wait_for_a_load(60)
    assert time.monotonic() - started < 30  # woken by the load's end, not by the timeout
    ending.join()
    assert transfers.take_ended_loads() == ({"req"}, set())
