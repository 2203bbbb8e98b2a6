"""A pull that names another incarnation of this broker (its ticket's, docs/fleet.md "Tickets"): what the broker
does with it.

- A ticket's `n` is the incarnation that committed the push: another incarnation holds nothing of it, so the pull is
  refused at once, BROKER_RESTARTED, before it may wait.
- A ticket's `e` (`PullRequest.incarnation_before_push`) is the incarnation the producer knew when it made the
  ticket, before its push began (the vLLM connector's tickets): the push may have gone to this incarnation after
  all, or may be about to. So the pull is a pull as any other while the hand-off is held here or its push is under
  way (nothing was lost: the ticket's incarnation was stale); only a hand-off not known here is refused, and only
  once the broker is RESTART_GRACE_SECONDS past its own start: a producer refreshes what it knows of the broker's
  incarnation at least that often (client/vllm/_incarnations.py: MAX_AGE_SECONDS), so every push its stale tickets
  name has begun by then. Before that the pull waits for the push to begin (within its own wait), then is refused.
  (A push still waiting for room has not begun: a broker 2 s past its restart is rarely that full.)

Invariant: a hand-off that is here, or whose push begins within the grace, is never refused for its incarnation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from handoff_client.protocol.errors import BrokerRestarted
from handoff_client.protocol.messages import handoff_pb2 as pb

RESTART_GRACE_SECONDS = 2.0
"""How long after its start a broker lets a pull naming another incarnation before its push (a ticket's `e`) wait
for a push not yet begun: the longest a producer may go on naming the incarnation it knew (its refresh's
MAX_AGE_SECONDS, 1 s) plus the time from its ticket to its push's header (a step's end: milliseconds, allowed 1 s)."""


class Incarnation:
    """This broker process's incarnation, drawn when it starts, and the rule for pulls naming another."""

    def __init__(self, value: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.value = value
        self.clock = clock
        self.born = clock()

    def refuse_now(self, request: pb.PullRequest) -> None:
        """A pull following a ticket's `n` of another incarnation: refused at once (BrokerRestarted)."""
        if request.incarnation and request.incarnation != self.value and not request.incarnation_before_push:
            raise self.restarted(request)

    def wait_for(self, request: pb.PullRequest, wait: float) -> tuple[float, bool]:
        """How long the pull may wait for its push to begin (it asked for `wait`), and whether the end of that wait
        means the broker restarted (BrokerRestarted, not WaitTimedOut): a pull following a ticket's `e` of another
        incarnation waits at most what is left of the grace (0 once it is over), and is refused when that ends it."""
        if not (request.incarnation and request.incarnation != self.value and request.incarnation_before_push):
            return wait, False
        grace = max(0.0, self.born + RESTART_GRACE_SECONDS - self.clock())
        return (grace, True) if grace <= wait else (wait, False)

    def restarted(self, request: pb.PullRequest) -> BrokerRestarted:
        return BrokerRestarted(request.model, request.handoff_id, request.incarnation[:64], self.value)
