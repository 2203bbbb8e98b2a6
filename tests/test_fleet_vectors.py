"""docs/fleet.md's vectors are what the Python client computes: rendezvous scores and order, tickets both ways, and
the etcd keys, values and range a broker registers and a client lists (so a client in another language that meets the
vectors shares a fleet with this one)."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

import pytest
from handoff_client import MalformedRequest
from handoff_client.fleet import make_ticket, read_ticket, rendezvous, ticket_for
from handoff_client.protocol.etcd import b64, parse_etcd_url

FLEET = (Path(__file__).resolve().parent.parent / "docs" / "fleet.md").read_text()
BROKERS = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]


def section(title: str) -> str:
    return FLEET.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_placement_vectors_are_the_clients_scores_and_order():
    rows = re.findall(r"^\|\s*(?:`([^`]+)`)?\s*\|\s*(?:`([^`]+)`)?\s*\| `([^`]+)` \| `([0-9a-f]{64})` \|$",
                      section("Placement: rendezvous hashing"), re.MULTILINE)  # fmt: skip
    assert len(rows) == 6
    scores: dict[tuple[str, str], dict[str, str]] = {}
    model = handoff_id = ""
    for row_model, row_id, broker, digest in rows:
        model, handoff_id = row_model or model, row_id or handoff_id
        assert hashlib.sha256(f"{broker}|{model}|{handoff_id}".encode()).hexdigest() == digest
        scores.setdefault((model, handoff_id), {})[broker] = digest
    for (model, handoff_id), by_broker in scores.items():
        order = rendezvous(BROKERS, model, handoff_id)
        assert order == sorted(by_broker, key=by_broker.__getitem__, reverse=True)
        said = re.search(rf"`{re.escape(model)}`/`{re.escape(handoff_id)}`\s+tries `([\d.]+)`, then `([\d.]+)`, then "
                         r"`([\d.]+)`", section("Placement: rendezvous hashing"))  # fmt: skip
        assert [f"{host}:50051" for host in said.groups()] == order


def test_the_ticket_vectors_are_what_a_push_returns_and_a_pull_reads():
    rows = re.findall(r"^\| `([^`]+)`, `([^`]+)`, `([^`]+)`, `(\w+)` (?:then (\d+) `0`s|(\d+) times)(?:, `(\w+)`)?"
                      r"( before its push)? \| `(hb1:[\w-]+)` \|$", section("Tickets"), re.MULTILINE)  # fmt: skip
    assert len(rows) == 4
    for broker, model, handoff_id, start, zeros, times, incarnation, before, ticket in rows:
        fingerprint = start + "0" * int(zeros) if zeros else start * int(times)
        assert make_ticket(broker, model, handoff_id, fingerprint, incarnation, before_push=bool(before)) == ticket
        named = {"b": broker, "m": model, "i": handoff_id, "f": fingerprint} | (
            {"e" if before else "n": incarnation} if incarnation else {}
        )
        assert read_ticket(ticket) == named
        assert "=" not in ticket
        with pytest.raises(MalformedRequest):
            ticket_for(ticket, model, handoff_id + "x")
    # a reader takes any JSON object with the four keys, in any order, with blanks
    other = base64.urlsafe_b64encode(b'{"f": "ab", "i": "r", "m": "m", "b": "h:1"}').decode().rstrip("=")
    assert read_ticket("hb1:" + other) == {"b": "h:1", "m": "m", "i": "r", "f": "ab"}


def test_the_etcd_vectors_are_the_keys_a_broker_puts_and_the_range_a_client_lists():
    rows = dict(re.findall(r"^\| \w[\w ]* \| `([^`]+)` \| `([A-Za-z0-9+/=]+)` \|$", section("etcd: where brokers register"),
                           re.MULTILINE))  # fmt: skip
    assert len(rows) == 4
    assert all(b64(text) == encoded for text, encoded in rows.items())
    endpoint, prefix = parse_etcd_url("etcd://127.0.0.1:2379/handoff")
    assert (endpoint, prefix) == ("http://127.0.0.1:2379", "handoff") == parse_etcd_url("etcd://127.0.0.1:2379")
    assert {f"{prefix}/10.0.0.1:50051", "10.0.0.1:50051", f"{prefix}/", prefix + chr(ord("/") + 1)} == set(rows)
