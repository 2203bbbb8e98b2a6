"""Where each request's transfer stands on a worker, under one lock: a producer's push from its save to the release of
its pages, a consumer's load from its start to its report. The background threads that copy, push and pull tell it;
vLLM's step asks it (`get_finished`, `handle_preemptions`) through the worker half (_worker.py).

A push: saved, then copied (no copy reads its pages any more: _copy_out.py) and ended (committed or failed), in
either order (a step may have made the copy before the push began; a push may fail while a step makes it). vLLM may
finish the request at any point; its pages are released once all three have happened, exactly once. A load: under
way -> ended, loaded or failed -> reported to vLLM, exactly once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from ._copy_out import CopyOut


@dataclass
class _Push:
    copy: CopyOut  # its `copied` set once no copy reads the pages
    finished: bool = False  # vLLM finished the request: its pages wait for the push
    ended: bool = False  # the push ended, committed or failed


class Transfers:
    """Each request's push and load, as the module docstring lays them out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._load_ended = threading.Condition(self._lock)  # notified whenever a load ends
        self._pushes: dict[str, _Push] = {}  # until their pages are released
        self._finished_unsaved: set[str] = set()  # the last release's finished ids without a push (push_saved)
        self._ended_loads: dict[str, bool] = {}  # request -> whether its load failed, until reported
        self._loading = 0  # loads under way

    # -- pushes -------------------------------------------------------------------------------------------------------

    def push_saved(self, request_id: str, copy: CopyOut) -> bool:
        """A push begins, of `copy` (the request's copy out of its pages): True. False, and nothing changes, if the
        request's first push is still here (its pages not released): that push is the hand-off, and a second one
        under its id would be refused by the broker or replace what a decoder may be pulling. Never raises: this
        runs inside vLLM's execute_model, where an exception ends the engine with every request in flight.

        vLLM may tell of the request's end before its save within one step (its V2 model runner calls
        get_transfer_results before wait_for_save when it runs a speculator): the last `release` call's finished
        ids that had no push are remembered, so such a push is finished from its start."""
        with self._lock:
            if request_id in self._pushes:
                return False
            self._pushes[request_id] = _Push(copy, finished=request_id in self._finished_unsaved)
            return True

    def push_ended(self, request_id: str) -> None:
        """The push ended (committed or failed): its copy, if nobody began it, will never be made."""
        with self._lock:
            push = self._pushes[request_id]
            push.ended = True
            push.copy.push_ended()

    def copies(self, request_ids: Iterable[str] | None = None) -> list[CopyOut]:
        """The copies of the pushes of `request_ids` (None: of every push not yet released)."""
        with self._lock:
            if request_ids is None:
                return [push.copy for push in self._pushes.values()]
            return [self._pushes[r].copy for r in request_ids if r in self._pushes]

    def release(self, finished: Iterable[str]) -> set[str]:
        """vLLM finished `finished` (of which the pushes are noted): the requests whose pages are released now, each
        once, those finished, copied and pushed."""
        with self._lock:
            self._finished_unsaved = set()
            for request_id in finished:
                if request_id in self._pushes:
                    self._pushes[request_id].finished = True
                else:
                    self._finished_unsaved.add(request_id)
            released = {r for r, p in self._pushes.items() if p.finished and p.ended and p.copy.copied.is_set()}
            for request_id in released:
                del self._pushes[request_id]
        return released

    # -- loads --------------------------------------------------------------------------------------------------------

    def loads_started(self, count: int) -> None:
        with self._lock:
            self._loading += count

    def load_ended(self, request_id: str, failed: bool) -> None:
        with self._lock:
            self._ended_loads[request_id] = failed
            self._loading -= 1
            self._load_ended.notify_all()

    def wait_for_a_load(self, timeout: float) -> None:
        """If loads are under way and none has ended unreported, wait up to `timeout` s for one to end."""
        with self._lock:
            if self._loading and not self._ended_loads:
                self._load_ended.wait(timeout)  # (the lock is let go meanwhile: a load can end)

    def take_ended_loads(self) -> tuple[set[str], set[str]]:
        """The loads ended since the last call, and those of them that failed; each reported once."""
        with self._lock:
            ended, self._ended_loads = self._ended_loads, {}
        return set(ended), {r for r, failed in ended.items() if failed}

    @property
    def loading(self) -> bool:
        return self._loading > 0
