"""A push whose tensors are still being made: the caller passes an iterable of (name, array) pairs instead of a
mapping, and the push sends each tensor as soon as it is made, before the next is made (a vLLM producer copying a
prompt out of its pages layer by layer pushes while it copies, rather than copying the whole prompt first: the
broker has, and streams to a decoder already pulling, the first layers while the last are being copied).

- The iterable is advanced by the push as it needs the next tensor, in the thread that sends (for a push on the
  gRPC stream, gRPC's own): no thread of its own. Made on a thread ahead of the sending, it was slower on CPU
  (0.6x, benchmarks/connector.py's figures in docs/performance.md): the copy and the sending contend for the cores.
  Tensors may come in any order; in the contract's order none waits in memory for its turn.
- Every array made is kept until the push ends, so a retry (another broker of a fleet, a broken connection) sends
  the same bytes without running the iterable again.
- Each array meets the contract's rules as it is sent (`check_array`), as a mapping's would before the push; a name
  the contract does not carry is ignored, as a mapping's extra entries are; an iterable that ends without a carried
  tensor is MissingTensor. An array that fails, or the iterable raising, ends the push before that tensor is sent,
  so the broker keeps nothing of it; the push raises that error.
- `close()` waits for a step in progress and closes the iterable (a generator's `finally` runs): once the push has
  returned, nothing reads the caller's memory any more (vLLM may reuse the pages).
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
    """The arrays an iterable of (name, array) pairs yields, made as they are asked for and kept by name."""

    def __init__(self, model: str, produced: Iterable[tuple[str, Any]]) -> None:
        self.model = model
        self._produced = produced
        self._iterator: Iterator[tuple[str, Any]] | None = None  # (started by the first `get`)
        self._arrays: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()  # one step at a time, whichever thread asks (a retry's may be another)
        self._ended = False  # the iterable is exhausted, failed or closed: no more arrays come
        self._error: Exception | None = None  # what the iterable (or a pair it yielded) raised

    def get(self, name: str) -> np.ndarray:
        """`name`'s array, making the iterable's next ones until it is made; the iterable's error, or MissingTensor
        if it ended without it."""
        with self._lock:
            while name not in self._arrays and not self._ended:
                self._step()
            if name in self._arrays:
                return self._arrays[name]
            if self._error is not None:
                raise self._error
            raise MissingTensor(self.model, name)

    def _step(self) -> None:
        try:
            if self._iterator is None:
                self._iterator = iter(self._produced)
            name, array = self._pair(next(self._iterator))
        except StopIteration:
            self._ended = True
        except Exception as e:  # noqa: BLE001 - the push raises it, in the caller's thread
            self._ended, self._error = True, e
        else:
            self._arrays[name] = array

    def _pair(self, pair: object) -> tuple[str, Any]:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise MalformedRequest(
                f"tensors is a {type(self._produced).__name__} of {type(pair).__name__}: pass a mapping of tensor name "
                "to array, {name: array, ...}, or (name, array) pairs as they are made",
                self.model,
            )
        return pair[0], host_array(self.model, pair[0], pair[1])

    def close(self) -> None:
        """Wait for a step in progress, close the iterable (its cleanup runs now) and let the arrays go."""
        with self._lock:
            self._ended = True
            if self._iterator is not None and hasattr(self._iterator, "close"):
                self._iterator.close()
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
