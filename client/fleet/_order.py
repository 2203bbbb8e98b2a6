"""How a fleet call goes through a hand-off's brokers in order (rendezvous order, _client.py): `in_order` takes the
first that answers; `probe_then_wait` (a pull without a ticket, FleetClient.pull and FleetPulledTensors) asks the
first few briefly, then waits at the first that answers, and reports at once a hand-off whose own broker cannot be
reached and that the next brokers do not hold. Every error names the broker it came from (`named`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from ..protocol.errors import BrokerUnavailable, HandoffError, WaitTimedOut

T = TypeVar("T")

PROBE_SECONDS = 0.2
"""How long a pull waits at each of the next brokers in score order before settling at the first."""
PROBED = 3


def named(broker: str, error: HandoffError) -> HandoffError:
    """The error, with the broker it came from in its message and fields."""
    if error.fields.get("broker") != broker:
        error.fields["broker"] = broker
        error.message = f"broker {broker}: {error.message}"
        error.args = (error.message,)
    return error


def in_order(brokers: list[str], attempt: Callable[[str], T]) -> T:
    """The first broker in order that answers; the next on UNAVAILABLE (down, draining, or silent past the
    client's keepalive: handoff_client._calls.KEEPALIVE_MS). Any error names the broker it came from."""
    last: HandoffError | None = None
    for broker in brokers:
        try:
            return attempt(broker)
        except BrokerUnavailable as e:
            last = named(broker, e)
        except HandoffError as e:
            raise named(broker, e) from None
    raise last or BrokerUnavailable._rebuild("no broker in the set", {})


def probe_then_wait(
    brokers: list[str],
    pull: Callable[[str, float, float | None], T],
    timeout: float,
    departed: Mapping[str, float] | None = None,
) -> T:
    """Ask the first few brokers briefly (the push may have gone to the next one while the first was down), then
    wait at the first that answers for what is left of `timeout`. `pull(broker, timeout, wait_for_push)`: a probe
    waits PROBE_SECONDS for the push to begin, but a hand-off it finds streams for the whole of what is left.

    `departed`: brokers in `brokers` that have left the set (with how long ago): probed, since a hand-off pushed
    there before it left may still be there, but never waited at, since no new push goes there. When the first
    broker, the hand-off's own, cannot be reached and no probed broker holds the hand-off, that is the answer:
    BrokerUnavailable naming it, at once."""
    departed = departed or {}
    deadline = time.monotonic() + timeout
    answering: list[str] = []
    unreachable: dict[str, HandoffError] = {}
    last: HandoffError | None = None
    for broker in brokers[:PROBED]:
        try:
            return pull(broker, max(deadline - time.monotonic(), 0.0), PROBE_SECONDS)
        except WaitTimedOut:
            if broker not in departed:
                answering.append(broker)
        except BrokerUnavailable as e:
            last = named(broker, e)
            if type(e) is BrokerUnavailable:  # (not draining, not a lane that broke: the broker is not there)
                unreachable[broker] = last
        except HandoffError as e:  # (it had the hand-off, and something else went wrong: that is the answer)
            raise named(broker, e) from None
    if brokers and brokers[0] in unreachable:
        raise owner_gone(brokers[0], unreachable[brokers[0]], departed.get(brokers[0]))
    for broker in answering[:1] or [b for b in brokers[PROBED:] if b not in departed][:1]:
        try:
            return pull(broker, max(deadline - time.monotonic(), 0.0), None)
        except HandoffError as e:
            raise named(broker, e) from None
    raise last or WaitTimedOut._rebuild("no broker in the set holds the hand-off", {})


def owner_gone(broker: str, error: HandoffError, left_ago: float | None) -> HandoffError:
    """The error of a pull whose hand-off's own broker cannot be reached, saying what that means."""
    where = "it is in the set" if left_ago is None else f"it left the set {left_ago:.1f} s ago"
    error.message += (f" (the first broker in this hand-off's rendezvous order; {where}; the next brokers do not "
                      "hold it: a hand-off pushed there is lost with it)")  # fmt: skip
    error.args = (error.message,)
    return error
