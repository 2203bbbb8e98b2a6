"""A pull that names another incarnation of this broker (its ticket's, docs/fleet.md "Tickets"): what the broker
does with it.

- A ticket's `n` is the incarnation that committed the push: another incarnation holds nothing of it, so the pull is
  refused at once, BROKER_RESTARTED, before it may wait.
- A ticket's `e` (`PullRequest.incarnation_before_push`) is the incarnation the producer knew when it made the
  ticket, before its push began (the vLLM connector's tickets): the push may have gone to this incarnation after
  all, or may be about to. So the pull is a pull as any other while the hand-off is held here or its push is under
  way (nothing was lost: the ticket's incarnation was stale); only a hand-off not known here is refused, and only
  once the broker is its grace (RESTART_GRACE_SECONDS) past its own start, counted from when its port serves. A
  producer names an incarnation only while the connection that learned it is unchanged
  (client/vllm/_incarnations.py): a broker that exits closes its connections as it dies, so its producers stop
  naming it milliseconds later, before this broker could serve; what remains is the time from a ticket made just
  before the restart to its push's header here (a step's end and the push's reconnect). Before the grace ends the
  pull waits for the push to begin (within its own wait), then is refused. (A push still waiting for room has not
  begun: a broker 2 s past its restart is rarely that full.) A push that begins after its pull was refused (a host
  gone silent, unseen by the producer's idle connection for up to 12 s) is refused (the hand-off was cancelled
  with the refusal: `forget`): the decoder recomputed; nothing wrong is loaded.

Invariant: a hand-off that is here, or whose push begins within the grace, is never refused for its incarnation.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from handoff_client.protocol.errors import BrokerRestarted
from handoff_client.protocol.messages import handoff_pb2 as pb

RESTART_GRACE_SECONDS = 2.0
"""How long after its start a broker lets a pull naming another incarnation before its push (a ticket's `e`) wait
for a push not yet begun: the time its producers take to see the old broker's connections close (milliseconds,
allowed 1 s) plus the time from a ticket to its push's header (a step's end: milliseconds, allowed 1 s)."""
REFUSED_KEPT = 4096
"""How many hand-offs refused for a ticket's `e` the broker remembers, to refuse their pulls again by that name."""
GRACE_ENV = "HANDOFF_RESTART_GRACE"
"""The environment variable that sets another grace, in seconds (advanced: tests on a loaded machine; a producer that
takes longer from its ticket to its push). BrokerConfig.restart_grace takes it as its default."""


def restart_grace() -> float:
    """The grace this process's brokers are given: $HANDOFF_RESTART_GRACE seconds, else RESTART_GRACE_SECONDS."""
    value = os.environ.get(GRACE_ENV, "")
    if not value:
        return RESTART_GRACE_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= 3600:
        raise ValueError(f"{GRACE_ENV} is {value[:40]!r}: seconds from 0 to 3600 (default {RESTART_GRACE_SECONDS})")
    return seconds


class Incarnation:
    """This broker process's incarnation, drawn when it starts, and the rule for pulls naming another."""

    def __init__(
        self, value: str, clock: Callable[[], float] = time.monotonic, grace: float = RESTART_GRACE_SECONDS
    ) -> None:
        self.value = value
        self.clock = clock
        self.grace = grace
        self.born = clock()  # (again by start(): when the port serves)
        self.forget: Callable[[str, str], object] | None = None
        """Set by the broker (its store's cancel): a hand-off refused for a ticket's `e` is forgotten for good (a
        cancelled tombstone, kept as long as any), so a push of it that comes later is refused at once (HANDOFF_GONE)
        instead of held until its TTL against --max-bytes: its decoder has recomputed."""
        self.refused: OrderedDict[tuple[str, str], None] = OrderedDict()  # (the last REFUSED_KEPT, for refuse_now)
        self._lock = threading.Lock()

    def start(self) -> None:
        """The broker's port serves from now: its grace runs from here, not from when it was built."""
        self.born = self.clock()

    def refuse_now(self, request: pb.PullRequest) -> None:
        """A pull following a ticket's `n` of another incarnation, or a ticket's `e` whose hand-off was refused
        already: refused at once (BrokerRestarted)."""
        if request.incarnation and request.incarnation != self.value and not request.incarnation_before_push:
            raise self.restarted(request)
        if request.incarnation_before_push and request.incarnation != self.value:
            with self._lock:
                again = (request.model, request.handoff_id) in self.refused
            if again:  # (a ticket's `e` refused before: so again, not HandoffCancelled by the tombstone `forget` left)
                raise self.restarted(request)

    def wait_for(self, request: pb.PullRequest, wait: float) -> tuple[float, bool]:
        """How long the pull may wait for its push to begin (it asked for `wait`), and whether the end of that wait
        means the broker restarted (BrokerRestarted, not WaitTimedOut): a pull following a ticket's `e` of another
        incarnation waits at most what is left of the grace (0 once it is over), and is refused when that ends it."""
        if not (request.incarnation and request.incarnation != self.value and request.incarnation_before_push):
            return wait, False
        grace = max(0.0, self.born + self.grace - self.clock())
        return (grace, True) if grace <= wait else (wait, False)

    def restarted(self, request: pb.PullRequest) -> BrokerRestarted:
        """The refusal of a pull naming another incarnation; a ticket's `e` also has its hand-off forgotten."""
        if request.incarnation_before_push:
            with self._lock:
                self.refused[(request.model, request.handoff_id)] = None
                while len(self.refused) > REFUSED_KEPT:
                    self.refused.popitem(last=False)
            if self.forget is not None:
                self.forget(request.model, request.handoff_id)
        return BrokerRestarted(request.model, request.handoff_id, request.incarnation[:64], self.value)
