"""A push whose tensors are still being made: the caller passes an iterable of (name, array) pairs instead of a
mapping, and the push sends each tensor as soon as it is made while the next is being made (the vLLM connector's
producer, copying a prompt out of its pages layer by layer, pushes while it copies: the broker, and a decoder
already pulling, have the first layers while the last are copied).

- The iterable runs on a thread of its own, started with the push, ahead of the sending: it is not held back by the
  broker (a push waiting for room, a slow link), so a caller waiting for the making to end (the connector, before
  vLLM may reuse a preempted request's pages) waits for the making alone. Its first pair is awaited before any call,
  so an iterable of the wrong things is refused (MalformedRequest) before the broker is asked for anything. Tensors
  may come in any order; in the contract's order each is sent as soon as it is made.
- Every array made is kept until the push ends, so a retry (another broker of a fleet, a broken connection) sends
  the same bytes without running the iterable again.
- Each array meets the contract's rules as it is sent (`check_array`), as a mapping's would before the push; a name
  the contract does not carry is ignored, as a mapping's extra entries are; an iterable that ends without a carried
  tensor is MissingTensor. An array that fails, or the iterable raising, ends the push before that tensor is sent,
  so the broker keeps nothing of it; the push raises that error.
- `close()` stops the iterable after the step in progress and waits for it (a generator's `finally` runs on its
  thread): once the push has returned, the iterable is not advanced any more. The arrays it yielded are the push's
  to send until then (gRPC's own thread may still be encoding one as a failed call ends): they must be the
  caller's to give away, not memory it reuses (the connector's are copies out of the pages).
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ._arguments import host_array
from .protocol.contract import Contract, check_array, filled_rows
from .protocol.errors import MalformedRequest, MissingTensor


class Making(enum.Enum):
    """Where the iterable is: still making, exhausted, failed (its error is kept), or stopped by `close`."""

    MAKING = "making"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"


class ProducedTensors:
    """The arrays an iterable of (name, array) pairs yields, made on a thread of its own and kept by name."""

    def __init__(self, model: str, produced: Iterable[tuple[str, Any]]) -> None:
        self.model = model
        self._produced = produced
        self._arrays: dict[str, np.ndarray] = {}
        self._changed = threading.Condition()  # notified at each array made, and when the making ends
        self._state = Making.MAKING
        self._error: Exception | None = None  # what the iterable (or a pair it yielded) raised: Making.FAILED
        self._thread = threading.Thread(target=self._make, name="handoff-produce", daemon=True)
        self._thread.start()

    def _make(self) -> None:
        iterator: Iterator[tuple[str, Any]] | None = None
        ended, error = Making.DONE, None
        try:
            iterator = iter(self._produced)
            for pair in iterator:
                name, array = self._pair(pair)
                with self._changed:
                    if self._state is Making.STOPPED:
                        return
                    self._arrays[name] = array
                    self._changed.notify_all()
        except Exception as e:  # noqa: BLE001 - the push raises it, in the caller's thread
            ended, error = Making.FAILED, e
        finally:
            if iterator is not None and hasattr(iterator, "close"):
                iterator.close()  # a generator's own cleanup runs here, on the thread that ran it
            with self._changed:
                if self._state is Making.MAKING:
                    self._state, self._error = ended, error
                self._changed.notify_all()

    def _pair(self, pair: object) -> tuple[str, Any]:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise MalformedRequest(
                f"tensors is a {type(self._produced).__name__} of {type(pair).__name__}: pass a mapping of tensor name "
                "to array, {name: array, ...}, or (name, array) pairs as they are made",
                self.model,
            )
        return pair[0], host_array(self.model, pair[0], pair[1])

    def check_first(self) -> None:
        """Wait for the first pair (or the end): the iterable's error if it raised before it, or yielded something
        other than a pair."""
        with self._changed:
            self._changed.wait_for(lambda: self._arrays or self._state is not Making.MAKING)
            if not self._arrays and self._state is Making.FAILED:
                raise self._error  # type: ignore[misc]

    def get(self, name: str) -> np.ndarray:
        """`name`'s array, waiting until it is made; the iterable's error, or MissingTensor if it ended without it."""
        with self._changed:
            self._changed.wait_for(lambda: name in self._arrays or self._state is not Making.MAKING)
            if name in self._arrays:
                return self._arrays[name]
            if self._state is Making.FAILED:
                raise self._error  # type: ignore[misc]
            raise MissingTensor(self.model, name)

    def made(self) -> list[str]:
        """The names made so far."""
        with self._changed:
            return list(self._arrays)

    def close(self) -> None:
        """Stop the iterable after the step in progress, wait for that step, and let the arrays go."""
        with self._changed:
            if self._state is Making.MAKING:
                self._state = Making.STOPPED
        self._thread.join()
        with self._changed:
            self._arrays.clear()


class CheckedState(Mapping[str, np.ndarray]):
    """`produced` as a push of `contract` (the pushing rank's view, at the hand-off's position) reads it: each
    carried tensor's array, cut to its filled rows and checked as it is asked for. A hand-off's `state`. A name
    made that the contract does not carry is refused (UnknownTensor) at the next tensor asked for, and before a
    carried one is called missing, unless `drop_extra`."""

    def __init__(self, produced: ProducedTensors, contract: Contract, *, drop_extra: bool = False) -> None:
        self.produced = produced
        self.contract = contract
        self.drop_extra = drop_extra

    def __getitem__(self, name: str) -> np.ndarray:
        carried = self.contract.tensor(name)
        try:
            made = self.produced.get(name)
        except MissingTensor:
            self._check_names()  # a misspelled name: the one made is named, not the one it stands for
            raise
        self._check_names()
        array = filled_rows(carried, made)
        check_array(self.contract.model, carried, array)
        return array

    def _check_names(self) -> None:
        made = [] if self.drop_extra else self.produced.made()
        for name in sorted(made):
            self.contract.index(name, made)

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
