"""One thread that ends calls gone silent: each watched call has a deadline, kept in a heap, not a timer apiece.

A call arms its watch before it waits for the client's next message and disarms it when the message came; if the
deadline passes while armed, the watch's action runs (the servicer cancels the RPC, which wakes the handler's read
with an error). Each watch has at most one entry in the heap: re-arming only moves the watch's deadline, and an
entry that surfaces before it is pushed again at the new one (or dropped, if the watch was disarmed).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator


class Watch:
    """One call's deadline; `arm(seconds)` before a wait on the client, `disarm()` after it, `close()` at the end."""

    __slots__ = ("_watchdog", "action", "deadline", "queued")

    def __init__(self, watchdog: Watchdog, action: Callable[[], object]) -> None:
        self._watchdog = watchdog
        self.action: Callable[[], object] | None = action
        self.deadline: float | None = None
        self.queued = False  # whether the heap holds an entry for this watch

    def arm(self, seconds: float) -> None:
        self._watchdog._arm(self, seconds)

    def disarm(self) -> None:
        self._watchdog._disarm(self)

    def close(self) -> None:
        """The call has ended: disarmed for good, and the call it would end is no longer referenced (a heap entry
        may outlive the call by up to its deadline; it must not keep the call's state alive that long)."""
        self._watchdog._disarm(self)
        self.action = None

    def messages(self, requests: Iterator[object], idle: float) -> Iterator[object]:
        """A call's messages, the watch armed for `idle` seconds while each is awaited."""
        while True:
            self.arm(idle)
            try:
                message = next(requests)
            except StopIteration:
                return
            finally:
                self.disarm()
            yield message


class Watchdog:
    """Runs a watch's action once its armed deadline passes; `stop` ends its thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, Watch]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="handoff-watchdog", daemon=True)
        self._thread.start()

    def watch(self, action: Callable[[], object]) -> Watch:
        return Watch(self, action)

    def _arm(self, watch: Watch, seconds: float) -> None:
        with self._wake:
            watch.deadline = self._clock() + seconds
            if not watch.queued:
                self._push(watch)

    def _disarm(self, watch: Watch) -> None:
        with self._wake:
            watch.deadline = None

    def _push(self, watch: Watch) -> None:
        """Under the lock: queue the watch at its deadline, waking the thread if it is now the earliest."""
        earliest = self._heap[0][0] if self._heap else None
        heapq.heappush(self._heap, (watch.deadline, next(self._order), watch))
        watch.queued = True
        if earliest is None or watch.deadline < earliest:
            self._wake.notify()

    def _run(self) -> None:
        while True:
            due: list[Callable[[], object]] = []
            with self._wake:
                if self._stopped:
                    return
                now = self._clock()
                while self._heap and self._heap[0][0] <= now:
                    _, _, watch = heapq.heappop(self._heap)
                    watch.queued = False
                    if watch.deadline is None:
                        continue  # disarmed
                    if watch.deadline > now:
                        self._push(watch)  # re-armed since: wait for its new deadline
                        continue
                    watch.deadline = None
                    if watch.action is not None:
                        due.append(watch.action)
                if not due:
                    self._wake.wait(self._heap[0][0] - now if self._heap else None)
                    continue
            for action in due:
                action()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=5)
