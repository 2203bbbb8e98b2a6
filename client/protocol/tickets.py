"""Tickets: the text a push returns and a pull follows, naming where a hand-off lives (docs/fleet.md, "Tickets", is
the specification for another language; tests/test_fleet_vectors.py holds its vectors).

A ticket is `hb1:` and the URL-safe base64, unpadded, of a JSON object: `b` the broker's address, `m` the model, `i`
the hand-off id, `f` the contract fingerprint, and `n`, when the push knew it, the broker's incarnation (a random
value each broker process draws when it starts: a broker restarted at the same address is another incarnation, and
holds nothing of the former one's hand-offs). A pull that follows a ticket with `n` sends it, and a broker of
another incarnation refuses the pull at once (BROKER_RESTARTED) instead of letting it wait for a push that will
never come. A ticket made before its push (the vLLM connector's) may name instead, as `e`, the incarnation its
producer knew then: the push may still reach a broker restarted since, so a broker of another incarnation serves
the hand-off if it holds it or its push is under way, and refuses only one it does not know, once its restart grace
is over (server/restarts.py). A ticket with neither (or from an older client) is followed as before.

Tickets are not signed: a client follows one only to a broker it was given (handoff_client.fleet).
"""

from __future__ import annotations

import base64
import json

from .errors import MalformedRequest

TICKET_PREFIX = "hb1:"
"""Every ticket begins with it; increment the digit when a reader of the old form could not read the new one."""

_NAMED = "bmif"  # the keys every ticket has (`n` and `e` are optional)


def make_ticket(
    broker: str, model: str, handoff_id: str, fingerprint: str, incarnation: str = "", *, before_push: bool = False
) -> str:
    """The ticket naming `broker` (and, if given, its `incarnation`: as `n`, the one that committed the push, or
    with `before_push` as `e`, the one the producer knew when it made the ticket, before its push) for this
    hand-off."""
    fields = {"b": broker, "m": model, "i": handoff_id, "f": fingerprint}
    if incarnation:
        fields["e" if before_push else "n"] = incarnation
    body = json.dumps(fields, separators=(",", ":"))
    return TICKET_PREFIX + base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def ticket_for(ticket: str, model: str, handoff_id: str) -> dict[str, str]:
    """What a ticket names, refused unless it is this hand-off's."""
    fields = read_ticket(ticket)
    if (fields["m"], fields["i"]) != (model, handoff_id):
        raise MalformedRequest(f"the ticket is for {fields['m']}/{fields['i']}, not {model}/{handoff_id}")
    return fields


def read_ticket(ticket: str) -> dict[str, str]:
    """The broker, model, id, fingerprint (and incarnation, `n` or `e`, where it has one) a ticket names;
    MalformedRequest for anything else."""
    try:
        if not ticket.startswith(TICKET_PREFIX):
            raise ValueError("no prefix")
        raw = ticket[len(TICKET_PREFIX) :]
        fields = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        named = isinstance(fields, dict) and all(isinstance(fields.get(k), str) for k in _NAMED)
        if not named or not all(isinstance(fields.get(k, ""), str) for k in "ne"):
            raise ValueError("fields")
        return fields
    except (ValueError, UnicodeDecodeError):
        raise MalformedRequest(f"`{ticket[:40]}` is not a hand-off ticket (a push returns one)") from None


def pulled_incarnation(fields: dict[str, str]) -> dict[str, str | bool]:
    """The PullRequest fields a ticket's incarnation makes (`fields` as read_ticket returns them; {} for none): its `n`
    as `incarnation`, or else its `e` with `incarnation_before_push`."""
    if fields.get("n"):
        return {"incarnation": fields["n"]}
    if fields.get("e"):
        return {"incarnation": fields["e"], "incarnation_before_push": True}
    return {}
