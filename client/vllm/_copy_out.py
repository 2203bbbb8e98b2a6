"""A saved request's copy out of the pages, made once, by whoever needs it first: its push, as it sends (on a sender
thread, each layer sent as soon as it is copied), or a step that must have the pages read before vLLM writes them
again (`ensure`, on vLLM's thread). Such a step waits for the copy alone: never for a sender thread to come free, nor
for the broker to make room. A copy nobody began is made by neither once its push has ended (`push_ended`).

`copied` is set exactly once, when no copy reads the pages any more: the copy ended (or failed), or it will never
be made.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np

Pair = tuple[str, np.ndarray]
_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class CopyOut:
    """One request's copy: `layers` (a generator copying layer by layer) run once, by `tensors` or by `ensure`."""

    def __init__(self, layers: Iterator[Pair]) -> None:
        self.copied = threading.Event()
        self._layers = layers
        self._claim_lock = threading.Lock()
        self._claimed = False
        self._made: queue.SimpleQueue = queue.SimpleQueue()  # what `ensure` made, for the push to take

    def _claim(self) -> bool:
        """Whether the caller is the first to want the copy (and so makes it)."""
        with self._claim_lock:
            first, self._claimed = not self._claimed, True
        return first

    def ensure(self) -> None:
        """The pages read now: make the copy here unless it is begun, then wait for it to end."""
        if not self._claim():
            self.copied.wait()
            return
        try:
            for pair in self._layers:
                self._made.put(pair)
            self._made.put(_END)
        except BaseException as e:  # noqa: BLE001 - the push raises it, and says why
            self._made.put(_Failed(e))
        finally:
            self.copied.set()

    def tensors(self) -> Iterator[Pair]:
        """For the push: the tensors, each as soon as it is copied, copied here if nobody began the copy; the copy's
        error, raised where it stopped."""
        if self._claim():
            try:
                yield from self._layers
            finally:  # (also when the push stops taking them: the generator is closed, its copy ends)
                self.copied.set()
            return
        while (item := self._made.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def push_ended(self) -> None:
        """The push is over: a copy nobody began will never be made, so nothing reads the pages."""
        if self._claim():
            self.copied.set()
