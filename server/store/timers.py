"""The store's timers: when each entry next needs looking at, in a heap, so a sweep looks only at what is due.

An entry is scheduled at `Entry.next_due` whenever a transition may have brought that moment closer (a push began,
a claim was granted, a stream ended, a commit). Activity only moves it later, so nothing is scheduled per chunk:
an entry popped early is looked at, found not due, and scheduled again at its new moment. Entries that left the
store are dropped as they come up, and the heap is rebuilt from the live entries when the dropped ones outnumber
them, so its size stays within a small multiple of what the store holds.
"""

from __future__ import annotations

import heapq
import itertools
import math

from .entries import Entry

COMPACT_FLOOR = 1024


class Timers:
    """A heap of (when, entry); used under the store's lock."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Entry]] = []
        self._order = itertools.count()  # ties broken by scheduling order, never by comparing entries

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, entry: Entry, when: float) -> None:
        if math.isfinite(when):
            heapq.heappush(self._heap, (when, next(self._order), entry))

    def pop_due(self, now: float) -> list[Entry]:
        """The entries scheduled at or before `now`, each once, still in the store."""
        due: dict[int, Entry] = {}
        while self._heap and self._heap[0][0] <= now:
            entry = heapq.heappop(self._heap)[2]
            if entry.ended is None:
                due[id(entry)] = entry
        return list(due.values())

    def compact(self, held: int) -> None:
        """Rebuild from the live entries when the heap holds over twice as many items as the store `held`."""
        if len(self._heap) > max(COMPACT_FLOOR, 2 * held):
            keep: dict[int, tuple[float, int, Entry]] = {}
            for item in self._heap:
                if item[2].ended is None and (id(item[2]) not in keep or item[0] < keep[id(item[2])][0]):
                    keep[id(item[2])] = item
            self._heap = list(keep.values())
            heapq.heapify(self._heap)
