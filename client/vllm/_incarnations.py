"""What the producer's scheduler half knows of each broker's incarnation, so that its tickets name it.

The scheduler half hands out a request's `kv_transfer_params` (and its ticket) before the worker's push has begun,
so it cannot take the incarnation from the push's answer, as HandoffClient.push's tickets do (their `n`). It names
instead, as the ticket's `e`, the incarnation it learned from the broker (GetLanes, which the prefill role may call;
a broker that predates `LanesResponse.incarnation` says none). A decoder whose broker restarted since then (and lost
what it held) hears so at once, BrokerRestarted, and vLLM recomputes the prompt, instead of waiting out its `timeout`
for a push that will never come.

How it is learned, per broker: one channel of its own, watched (`grpc.Channel.subscribe`). The incarnation is asked
for when the channel becomes READY, and forgotten the moment its connectivity changes: a broker that exits (a crash,
a kill, a restart) closes its connections as it dies, and the channel sees that within milliseconds, before a new
broker can listen at the address. So the broker is asked once per connection, plus a slow safety refresh (every
REFRESH_SECONDS, all brokers' asks at once: a frozen one delays no other); an idle producer costs each broker one
GetLanes call per REFRESH_SECONDS (1 ms of its CPU), where a 0.5 s poll cost it 2 a second.

Invariant (server/restarts.py counts on it): an incarnation is named only while the channel that learned it has
shown no change of connectivity since the ask that said it was sent, and within MAX_AGE_SECONDS of that ask. Its
bound on staleness: milliseconds after a broker's process exits. A change the channel does not see (the broker's
host vanished, its packets dropped, on a connection idle so not pinged) is learned by the next refresh, whose ask
fails within ASK_SECONDS or answers the new incarnation: within REFRESH_SECONDS + ASK_SECONDS. Past the broker's
grace that costs a needless recompute at worst (a pull refused BROKER_RESTARTED whose push came later), never a
wrong load. A broker that does not answer is forgotten: the tickets for it name none (their decoders wait for the
push, as before).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from handoff_client._calls import CHANNEL_OPTIONS, make_channel
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import method_path

from ._settings import ConnectorSettings

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 10.0
"""The safety refresh: each broker is asked again this often even while its channel shows no change."""
ASK_SECONDS = 2.0
"""The deadline of each GetLanes call."""
MAX_AGE_SECONDS = 2 * REFRESH_SECONDS
"""The longest an incarnation is named after the ask that learned it was sent (a refresh late by a busy machine does
not age a live broker out; one that fails forgets it at once)."""
WATCH_POLL_SECONDS = 0.3
"""Longer than gRPC's connectivity watch polls (0.2 s)."""
FORGET_SECONDS = 60.0
"""A broker no ticket was made for in this long is no longer watched (a fleet's brokers come and go)."""


def _connect(state: grpc.ChannelConnectivity) -> None:
    """A watch that only makes its channel connect."""


class _Broker:
    """One broker's channel, watched, and what it said last."""

    def __init__(self, address: str, options: dict[str, Any], wanted: float) -> None:
        self.address = address
        self.channel = make_channel(
            address, CHANNEL_OPTIONS + (("grpc.use_local_subchannel_pool", 1),),  # (no other channel reconnects it)
            tls_root_certificates=options["tls_root_certificates"],
            tls_certificate_chain=options["tls_certificate_chain"], tls_private_key=options["tls_private_key"],
        )  # fmt: skip
        self.get_lanes = self.channel.unary_unary(
            method_path("GetLanes"),
            request_serializer=pb.LanesRequest.SerializeToString,
            response_deserializer=pb.LanesResponse.FromString,
        )
        self.metadata = (("authorization", f"Bearer {options['token']}"),) if options["token"] else None
        self.generation = 0  # (one more at each change of the channel's connectivity)
        self.incarnation = ""
        self.said = ""  # (the last incarnation it said, to log a restart)
        self.learned = float("-inf")  # (when the ask that said it was sent)
        self.wanted = wanted  # (when a ticket last asked for it)
        self.watch: Callable[[grpc.ChannelConnectivity], None] | None = None


class Incarnations:
    """Each broker's incarnation, by address, as a ticket may name it (see the module's invariant)."""

    def __init__(self, settings: ConnectorSettings, model: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._options = settings.client_options()
        self._model = model
        self._clock = clock
        self._known: dict[str, _Broker] = {}
        self._lock = threading.RLock()  # (a future's callback may run at once, in the thread that holds it)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._refresh_forever, name="handoff-incarnations", daemon=True)
        self._thread.start()

    def of(self, broker: str) -> str:
        """`broker`'s incarnation if known now (the module's invariant), else "" (the ticket names none). A broker not
        asked for before is watched from now on (its first tickets name none)."""
        now = self._clock()
        with self._lock:
            known = self._known.get(broker)
            if known is None and not self._closed.is_set():
                known = self._known[broker] = _Broker(broker, self._options, now)
                known.watch = lambda state: self._changed(known, state)
                known.channel.subscribe(known.watch, try_to_connect=True)
            if known is None:
                return ""
            known.wanted = now
            return known.incarnation if now - known.learned <= MAX_AGE_SECONDS else ""

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=1.0)
        with self._lock:
            known = list(self._known.values())
            self._known.clear()
        self._drop(*known)

    def _changed(self, known: _Broker, state: grpc.ChannelConnectivity) -> None:
        """The channel's connectivity changed: what it said is forgotten; asked again once it is READY. IDLE (its
        connection closed): told to connect again, with no call (a watch's `try_to_connect`)."""
        with self._lock:
            known.generation += 1
            known.incarnation = ""
            if state == grpc.ChannelConnectivity.READY:
                self._ask(known)
            elif state == grpc.ChannelConnectivity.IDLE and not self._closed.is_set():
                known.channel.subscribe(_connect, try_to_connect=True)
                known.channel.unsubscribe(_connect)

    def _ask(self, known: _Broker) -> None:
        if self._closed.is_set():
            return
        sent, generation = self._clock(), known.generation
        try:
            future = known.get_lanes.future(
                pb.LanesRequest(model=self._model), timeout=ASK_SECONDS, metadata=known.metadata
            )
        except ValueError:  # (its channel was closed meanwhile)
            return
        future.add_done_callback(lambda done: self._answered(known, generation, sent, done))

    def _answered(self, known: _Broker, generation: int, sent: float, done: grpc.Future) -> None:
        try:
            incarnation = done.result().incarnation
        except grpc.RpcError as e:  # (forgotten: tickets for this broker name none until it answers again)
            incarnation = ""
            logger.debug("the incarnation of broker %s is not known now: %s", known.address, e.code())
        except Exception:  # noqa: BLE001 (cancelled by a close)
            return
        with self._lock:
            if generation != known.generation:  # (its connectivity changed since: a new connection asks again)
                return
            if incarnation and known.said and incarnation != known.said:
                logger.info("broker %s is a new incarnation (%s, was %s): it restarted", known.address, incarnation,
                            known.said)  # fmt: skip
            known.incarnation, known.learned = incarnation, sent
            known.said = incarnation or known.said

    def _refresh_forever(self) -> None:
        while not self._closed.wait(REFRESH_SECONDS):
            with self._lock:
                now = self._clock()
                gone = [self._known.pop(b) for b, k in list(self._known.items()) if now - k.wanted > FORGET_SECONDS]
                for known in self._known.values():  # (each ask a future: all at once)
                    self._ask(known)
            self._drop(*gone)

    @staticmethod
    def _drop(*brokers: _Broker) -> None:
        """Unwatched, then closed once gRPC's watching thread has seen it (it polls every 0.2 s, and raises on a
        channel closed under it)."""
        for known in brokers:
            if known.watch is not None:
                known.channel.unsubscribe(known.watch)
        if brokers:
            time.sleep(WATCH_POLL_SECONDS)
        for known in brokers:
            known.channel.close()
