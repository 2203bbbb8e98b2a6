"""A push whose tensors are still being made: the caller passes an iterable of (name, array) pairs instead of a
mapping, and the push sends each tensor while the iterable makes the next (a vLLM producer copying a prompt out of
its pages layer by layer pushes while it copies, rather than copying the whole prompt first).

- The iterable runs on a thread of its own, started with the push, ahead of the sending: the pages' copy and the
  socket's writes (which both let the GIL go) overlap. Tensors may come in any order; in the contract's order each
  is sent as soon as it is made.
- Every array produced is kept until the push ends, so a retry (another broker of a fleet, a broken lane) sends the
  same bytes without running the iterable again.
- Each array meets the contract's rules as it is sent (`check_array`), as a mapping's would before the push; a name
  the contract does not carry is ignored, as a mapping's extra entries are; an iterable that ends without a carried
  tensor is MissingTensor. An array that fails, or the iterable raising, ends the push before that tensor is sent,
  so the broker holds nothing of it; the push raises that error.
- `close()` stops the iterable and waits for a step in progress: once the push has returned, nothing reads the
  caller's memory any more (vLLM may reuse the pages).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ._arguments import host_array
from .protocol.contract import Contract, check_array, cut_to_filled
from .protocol.errors import MalformedRequest, MissingTensor


class ProducedTensors:
    """The arrays an iterable of (name, array) pairs yields, made on a thread of its own and kept by name."""

    def __init__(self, model: str, produced: Iterable[tuple[str, Any]]) -> None:
        self.model = model
        self._produced = produced
        self._arrays: dict[str, np.ndarray] = {}
        self._changed = threading.Condition()
        self._ended = False  # the iterable is exhausted, failed or closed: no more arrays come
        self._error: BaseException | None = None  # what the iterable (or a pair it yielded) raised
        self._closing = False
        self._thread = threading.Thread(target=self._produce, name="handoff-produce", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        iterator: Iterator[tuple[str, Any]] | None = None
        try:
            iterator = iter(self._produced)
            for pair in iterator:
                name, array = self._pair(pair)
                with self._changed:
                    if self._closing:
                        return
                    self._arrays[name] = array
                    self._changed.notify_all()
        except Exception as e:  # noqa: BLE001 - the push raises it, in the caller's thread
            with self._changed:
                self._error = e
        finally:
            if iterator is not None and hasattr(iterator, "close"):
                iterator.close()  # a generator's own cleanup runs here, on the thread that ran it
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def _pair(self, pair: object) -> tuple[str, Any]:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise MalformedRequest(
                f"the tensors' iterable yielded a {type(pair).__name__}: it yields (name, array) pairs", self.model
            )
        return pair[0], host_array(self.model, pair[0], pair[1])

    def get(self, name: str) -> np.ndarray:
        """`name`'s array, waiting until it is made; the iterable's error, or MissingTensor if it ended without it."""
        with self._changed:
            while name not in self._arrays and not self._ended:
                self._changed.wait()
            if name in self._arrays:
                return self._arrays[name]
            if self._error is not None:
                raise self._error
            raise MissingTensor(self.model, name)

    def close(self) -> None:
        """Stop the iterable after the step in progress, and wait for that step; the arrays are let go."""
        with self._changed:
            self._closing = True
        self._thread.join()
        with self._changed:
            self._arrays.clear()


class CheckedState(Mapping[str, np.ndarray]):
    """`produced` as a push of `contract` (the pushing rank's view, at the hand-off's position) reads it: each
    carried tensor's array, cut to its filled rows and checked as it is asked for. A hand-off's `state`."""

    def __init__(self, produced: ProducedTensors, contract: Contract) -> None:
        self.produced = produced
        self.contract = contract

    def __getitem__(self, name: str) -> np.ndarray:
        carried = self.contract.tensor(name)
        array = cut_to_filled(self.contract, {name: self.produced.get(name)})[name]
        check_array(self.contract.model, carried, array)
        return array

    def __iter__(self) -> Iterator[str]:
        return (c.name for c in self.contract.carried)

    def __len__(self) -> int:
        return len(self.contract.carried)


def is_produced(tensors: object) -> bool:
    """Whether a push's `tensors` are an iterable of pairs still to be made (not a mapping, nor a string)."""
    return isinstance(tensors, ProducedTensors) or (
        isinstance(tensors, Iterable) and not isinstance(tensors, (Mapping, str, bytes))
    )


@contextlib.contextmanager
def producing(model: str, tensors: Iterable[tuple[str, Any]]) -> Iterator[ProducedTensors]:
    """`tensors` being made for a push, and closed when it ends (unless they were already: their maker closes)."""
    if isinstance(tensors, ProducedTensors):
        yield tensors
        return
    produced = ProducedTensors(model, tensors)
    try:
        yield produced
    finally:
        produced.close()
