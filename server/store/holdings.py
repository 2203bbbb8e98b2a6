"""What the store holds, under its one lock: the entries, the tensor-parallel groups, the tombstones, the ledger and
the timers — and the one way anything leaves (`free`, `end_group`), so that leaving always releases its bytes,
leaves its tombstone, wakes its waiters and ends its group the same way.

The store's parts (intake.py for pushes, delivery.py for claims, groups.py for tensor-parallel
hand-offs, store.py for the rest) share one `Holdings`. Every method here runs with `lock` held.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from handoff_client.protocol.contract import Contract
from handoff_client.protocol.errors import MalformedRequest, UnknownModel

from .entries import MAX_HANDOFF_ID, MAX_TOMBSTONES, Entry, HandoffKey, Interrupt, StoreConfig, StoreEvents, Tombstone
from .ledger import Ledger
from .timers import Timers

if TYPE_CHECKING:
    from .groups import Group

GONE_WORDS = {
    "expired": "expired before any decode worker claimed it",
    "cancelled": "was cancelled",
    "confirmed": "was already delivered to a decode worker and confirmed",
    "aborted": "was not pushed: its push failed before it was committed",
}


class Holdings:
    def __init__(
        self,
        contracts: Mapping[str, Contract],
        config: StoreConfig,
        clock: Callable[[], float],
        events: StoreEvents,
    ) -> None:
        self.contracts = dict(contracts)
        self.config = config
        self.clock = clock
        self.events = events
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # an entry appeared, was released or freed; bytes freed
        self.entries: dict[HandoffKey, Entry] = {}
        self.groups: dict[HandoffKey, Group] = {}
        self.tombstones: OrderedDict[HandoffKey, Tombstone] = OrderedDict()
        self.ledger = Ledger(config.max_bytes, config.max_chunks)
        self.timers = Timers()
        self.claim_ids = claim_numbers()
        self.draining = False

    def contract(self, model: str) -> Contract:
        try:
            return self.contracts[model]
        except KeyError:
            raise UnknownModel(model, sorted(self.contracts)) from None

    def add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry
        self.tombstones.pop(entry.key, None)
        self.schedule(entry)
        self.changed.notify_all()  # pullers waiting for this id may claim it now

    def schedule(self, entry: Entry) -> None:
        """Look at the entry again when something of it may lapse (after any transition that may bring it closer)."""
        self.timers.schedule(entry, entry.next_due(self.config))

    def unclaim(self, entry: Entry) -> list[Interrupt]:
        """The entry's claim ends without a confirm: the hand-off is free for the next puller."""
        self.events.lease_returned(entry.key[0])
        interrupts = entry.unclaim(self.clock())
        self.schedule(entry)
        self.changed.notify_all()
        return interrupts

    def free(self, entry: Entry, how: str) -> list[Interrupt]:
        """The entry leaves the store; the streams still on it are returned for interrupting (outside the lock)."""
        del self.entries[entry.key]
        interrupts = entry.end(how)
        if how in ("expired", "cancelled", "confirmed"):
            self.bury(entry.key, how, entry.last_generation, entry.digest, entry.position)
        elif how == "aborted" and entry.group is None:
            self.bury(entry.key, "aborted", 0, "", entry.position)  # a puller waiting for it hears so at once
        self.changed.notify_all()
        group = entry.group
        if group is not None and group.ended is None:
            if how in ("aborted", "expired", "cancelled"):
                interrupts += self.end_group(group, how)
            elif how == "confirmed" and group.pulled.get(entry.rank) is entry:
                group.confirmed.add(entry.rank)
                if len(group.confirmed) == group.pull_size:
                    interrupts += self.end_group(group, "confirmed", entry.last_generation)
        return interrupts

    def end_group(self, group: Group, how: str, generation: int = 0) -> list[Interrupt]:
        """The tensor-parallel hand-off is done with (every rank confirmed) or lost (a part failed, lapsed or was
        cancelled): every part still held goes, and its bytes."""
        group.ended = how
        del self.groups[group.key]
        parts = "abandoned" if how == "aborted" else how  # a sibling's pusher hears why at its next chunk
        interrupts: list[Interrupt] = []
        for entry in [*group.pushed.values(), *group.pulled.values()]:
            if self.entries.get(entry.key) is entry:
                interrupts += self.free(entry, parts)
        group.reservation.release()
        if how in ("expired", "cancelled", "confirmed"):
            self.bury(group.key, how, generation if group.pull_size == 1 else 0, "")
        elif how == "aborted":
            self.bury(group.key, "aborted", 0, "")
        self.changed.notify_all()
        return interrupts

    def bury(self, key: HandoffKey, how: str, generation: int, digest: str, position: int = -1, why: str = "") -> None:
        """Leave a tombstone for `tombstone_ttl` s, so late callers hear how the hand-off went, not *unknown*: a
        puller of a push that failed (`aborted`) hears PUSH_ABORTED at once instead of waiting out its deadline, until
        a new push of the id replaces the tombstone."""
        self.tombstones.pop(key, None)
        until = self.clock() + self.config.tombstone_ttl
        self.tombstones[key] = Tombstone(how, generation, digest, until, position, why)

    def forget_tombstones(self, now: float) -> None:
        """Drop tombstones past their time (and the oldest, past MAX_TOMBSTONES): they are kept in burial order."""
        while self.tombstones:
            key, tomb = next(iter(self.tombstones.items()))
            if tomb.until > now and len(self.tombstones) <= MAX_TOMBSTONES:
                break
            del self.tombstones[key]


def check_id(model: str, handoff_id: str) -> None:
    if not handoff_id or len(handoff_id) > MAX_HANDOFF_ID or not handoff_id.isprintable():
        raise MalformedRequest(
            f"a handoff_id must be 1..{MAX_HANDOFF_ID} printable characters, got {handoff_id[:64]!r}", model
        )


def claim_numbers() -> Iterator[int]:
    """Claim numbers (PullHeader.claim: what a confirm and a retry's `supersedes` name): unique for the store's life,
    across every id and rank (a counter in the high bits), and unguessable (31 random low bits), so that no decoder
    can end or confirm another's claim by naming its number."""
    for n in itertools.count(1):
        yield n << 31 | secrets.randbits(31)
