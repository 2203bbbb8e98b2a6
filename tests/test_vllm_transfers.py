"""The connector worker's bookkeeping of each request's transfer (client/vllm/_transfers.py): a push's pages are
released exactly once, when vLLM has finished the request and its copy and push have ended, in whichever order those
come; a load is reported exactly once, with its failure. And a request's copy out of the pages (_copy_out.py) is
made once, by whoever wants it first."""

from __future__ import annotations

import threading
import time

import numpy as np
from handoff_client.vllm._copy_out import CopyOut
from handoff_client.vllm._transfers import Transfers


def saved(transfers: Transfers, request_id: str) -> CopyOut:
    """A push saved for `request_id`, its copy out of (no) pages not yet made."""
    copy = CopyOut(iter(()))
    transfers.push_saved(request_id, copy)
    return copy


def test_a_push_s_pages_are_released_once_vllm_finished_it_and_its_copy_and_push_ended_in_any_order():
    transfers = Transfers()
    copies = {r: saved(transfers, r) for r in ("finished-first", "ended-first")}
    for copy in copies.values():
        copy.ensure()  # (their copies made)
    assert transfers.release({"finished-first"}) == set()  # its push still under way: the pages wait
    transfers.push_ended("ended-first")
    assert transfers.release(set()) == set()  # vLLM has not finished it: nothing to release yet
    transfers.push_ended("finished-first")
    assert transfers.release(set()) == {"finished-first"}  # (vLLM told once; remembered)
    assert transfers.release({"ended-first"}) == {"ended-first"}
    assert transfers.release({"finished-first", "ended-first"}) == set()  # each released once

    reading = threading.Event()
    go_on = threading.Event()

    def slow_layers():
        reading.set()
        go_on.wait()
        yield "k", np.zeros(2)

    slow = CopyOut(slow_layers())
    transfers.push_saved("failed-while-copying", slow)
    step = threading.Thread(target=slow.ensure)  # a step makes its copy...
    step.start()
    assert reading.wait(30)
    transfers.push_ended("failed-while-copying")  # ...while its push fails
    assert transfers.release({"failed-while-copying"}) == set()  # the copy still reads the pages
    go_on.set()
    step.join(30)
    assert transfers.release(set()) == {"failed-while-copying"}


def test_only_requests_being_pushed_are_remembered_as_finished_and_none_is_saved_twice_at_once():
    transfers = Transfers()
    assert transfers.release({"never-saved"}) == set()
    assert transfers.release(set()) == set()  # (a finished id without a push is kept for one call only)
    never = saved(transfers, "never-saved")  # (a later request under the same id)
    transfers.push_ended("never-saved")  # its push ended before anybody began its copy: it will never be made
    assert never.copied.is_set() and transfers.release(set()) == set()
    second = CopyOut(iter(()))
    assert not transfers.push_saved("never-saved", second)  # saved again: refused, never raised
    assert transfers.copies(["never-saved"]) == [never]  # the first push is kept


def test_a_request_finished_before_its_save_within_a_step_is_released_once_its_push_ends():
    """vLLM's V2 model runner with a speculator calls get_transfer_results (finished ids) before wait_for_save in
    one step: the finished id comes before the push it finishes, and is not lost."""
    transfers = Transfers()
    assert transfers.release({"req"}) == set()  # finished, no push yet
    copy = saved(transfers, "req")  # the same step's save
    copy.ensure()
    transfers.push_ended("req")
    assert transfers.release(set()) == {"req"}  # vLLM does not tell it again: released all the same, once
    assert transfers.release({"req"}) == set()


def test_the_copies_a_step_has_made_are_those_of_the_requests_named_or_of_every_push_not_released():
    transfers = Transfers()
    copies = {r: saved(transfers, r) for r in ("a", "b")}
    assert transfers.copies(["b", "unknown"]) == [copies["b"]]
    assert transfers.copies() == [copies["a"], copies["b"]]
    copies["a"].ensure()
    transfers.push_ended("a")
    transfers.release({"a"})
    assert transfers.copies() == [copies["b"]]


def test_a_copy_is_made_once_by_whoever_wants_it_first_and_never_once_its_push_ended_without_it():
    made = []

    def layers():
        made.append("copied")
        yield "k", np.zeros(2)

    by_step = CopyOut(layers())
    by_step.ensure()  # a step wants the pages read: it makes the copy
    assert [name for name, _ in by_step.tensors()] == ["k"] and made == ["copied"]  # the push takes what it made
    by_push = CopyOut(layers())
    assert [name for name, _ in by_push.tensors()] == ["k"] and by_push.copied.is_set()
    by_push.ensure()  # made already: nothing made again
    assert made == ["copied", "copied"]
    never = CopyOut(layers())
    never.push_ended()  # the push ended before anybody began the copy: nothing reads the pages
    assert never.copied.is_set()
    never.ensure()
    assert made == ["copied", "copied"]


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
