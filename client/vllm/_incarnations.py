"""What the producer's scheduler half knows of each broker's incarnation, so that its tickets name it.

The scheduler half hands out a request's `kv_transfer_params` (and its ticket) before the worker's push has begun,
so it cannot take the incarnation from the push's answer, as HandoffClient.push's tickets do (their `n`). It names
instead, as the ticket's `e`, the incarnation it last learned from the broker (GetLanes, which the prefill role may
call; a broker that predates `LanesResponse.incarnation` says none). A decoder whose broker restarted since then
(and lost what it held) hears so at once, BrokerRestarted, and vLLM recomputes the prompt, instead of waiting out
its `timeout` for a push that will never come.

A learned incarnation may be stale: the broker restarted after it was learned, and the push goes to the new one.
The broker serves such a pull as any other once the push has begun, and waits for a push not yet begun while it is
within its restart grace (server/restarts.py, RESTART_GRACE_SECONDS). That holds because of the invariant here: an
incarnation is named only within MAX_AGE_SECONDS of sending the GetLanes call it came from, and a thread asks every
REFRESH_SECONDS for the brokers tickets were made for lately; a broker that does not answer has its incarnation age
out, and the tickets for it name none (their decoders wait for the push, as before).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from handoff_client import HandoffClient

from ._settings import ConnectorSettings

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 0.5
"""How often each broker's incarnation is asked for again (one GetLanes call, a few hundred bytes)."""
MAX_AGE_SECONDS = 1.0
"""The longest an incarnation is named after the call that learned it was sent (server/restarts.py counts on it)."""
ASK_SECONDS = 0.4
"""The deadline of each GetLanes call."""
FORGET_SECONDS = 60.0
"""A broker no ticket was made for in this long is no longer asked (a fleet's brokers come and go)."""


@dataclass
class _Known:
    client: HandoffClient
    incarnation: str = ""
    learned: float = float("-inf")  # (when the call that said it was sent)
    wanted: float = 0.0  # (when a ticket last asked for it)


class Incarnations:
    """Each broker's incarnation, by address, as a ticket may name it; refreshed by a daemon thread."""

    def __init__(self, settings: ConnectorSettings, model: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._options = {**settings.client_options(), "timeout": ASK_SECONDS}
        self._model = model
        self._clock = clock
        self._known: dict[str, _Known] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._refresh_forever, name="handoff-incarnations", daemon=True)
        self._thread.start()

    def of(self, broker: str) -> str:
        """`broker`'s incarnation if learned within MAX_AGE_SECONDS, else "" (the ticket names none). A broker not
        asked for before is learned from now on (its first tickets name none)."""
        now = self._clock()
        with self._lock:
            known = self._known.get(broker)
            if known is None:
                known = self._known[broker] = _Known(HandoffClient(broker, **self._options))
                self._wake.set()
            known.wanted = now
            return known.incarnation if now - known.learned <= MAX_AGE_SECONDS else ""

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=2 * ASK_SECONDS)
        with self._lock:
            for known in self._known.values():
                known.client.close()
            self._known.clear()

    def _refresh_forever(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                now = self._clock()
                for broker in [b for b, k in self._known.items() if now - k.wanted > FORGET_SECONDS]:
                    self._known.pop(broker).client.close()
                brokers = list(self._known.items())
            for broker, known in brokers:
                self._ask(broker, known)
            self._wake.wait(REFRESH_SECONDS)
            self._wake.clear()

    def _ask(self, broker: str, known: _Known) -> None:
        sent = self._clock()
        try:
            incarnation = known.client.lane_offers.ask(self._model).incarnation
        except grpc.RpcError as e:  # (it ages out: tickets for this broker name none until it answers again)
            logger.debug("the incarnation of broker %s is not known now: %s", broker, e.code())
            return
        except ValueError:  # (its client was closed meanwhile)
            return
        with self._lock:
            if incarnation != known.incarnation and known.incarnation:
                logger.info("broker %s is a new incarnation (%s, was %s): it restarted", broker, incarnation,
                            known.incarnation)  # fmt: skip
            known.incarnation, known.learned = incarnation, sent
