"""The store as the service sees it: a hand-off's life, cancel, the sweep and status, over the parts this
package's docstring maps (`handoff_broker.store`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from handoff_client.protocol.contract import Contract

from .audits import AuditReads
from .delivery import Delivery
from .entries import (
    WAIT_SLICE,
    Claim,
    HandoffKey,
    Interrupt,
    StoreConfig,
    StoreEvents,
    StoreStats,
    Unobserved,
    run_interrupts,
)
from .groups import TensorParallel
from .holdings import Holdings, check_id
from .intake import Intake

__all__ = ["Claim", "HandoffKey", "Store", "StoreConfig", "StoreEvents", "StoreStats"]

logger = logging.getLogger(__name__)


class Store:
    """Every hand-off the broker holds, by (model, handoff_id)."""

    def __init__(
        self,
        contracts: Mapping[str, Contract],
        config: StoreConfig,
        clock: Callable[[], float] = time.monotonic,
        events: StoreEvents | None = None,
    ) -> None:
        self.config = config
        self._h = Holdings(contracts, config, clock, events or Unobserved())
        self.contracts = self._h.contracts
        self._closed = threading.Event()
        tp = TensorParallel(self._h)
        self._intake = Intake(self._h, tp)
        self._delivery = Delivery(self._h, tp, self._closed)
        # The two sides, as the service calls them (intake.py and delivery.py say what each checks and decides).
        self.begin_push = self._intake.begin_push
        self.progress = self._intake.progress
        self.claim = self._delivery.claim
        self.feed = self._delivery.feed
        self.note_streamed = self._delivery.note_streamed
        self.release = self._delivery.release
        self.confirm = self._delivery.confirm
        audits = AuditReads(self._h, self._closed)  # reads that claim nothing (audits.py)
        self.audit_read, self.audit_feed = audits.read, audits.feed
        self._sweeper: threading.Thread | None = None
        self.on_idle: Callable[[], None] | None = None
        """Called by the sweeper once the store has held nothing for `trim_after` seconds since it last held
        something: the broker then hands back the memory it kept for the next hand-offs. Not at once on emptying,
        which under steady traffic happens between every two hand-offs and would fault every page in again."""

    # -- life of the store --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the sweeper that expires, returns lapsed leases, aborts idle pushes and forgets old tombstones."""
        self._sweeper = threading.Thread(target=self._sweep_forever, name="handoff-sweeper", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        self._closed.set()
        with self._h.lock:
            self._h.changed.notify_all()
        if self._sweeper is not None:
            self._sweeper.join()

    def drain(self) -> None:
        """Take no new pushes, and no pulls of hand-offs not held; what is in flight, and pulls of what is held,
        go on (so a draining broker of a fleet hands over what it holds before it exits)."""
        with self._h.lock:
            self._h.draining = True
            self._h.changed.notify_all()

    def settled(self, timeout: float) -> bool:
        """Wait up to `timeout` s until the store is empty: pushes under way finished, hand-offs held pulled."""
        h = self._h
        deadline = h.clock() + timeout
        with h.lock:
            while h.entries:
                remaining = deadline - h.clock()
                if remaining <= 0:
                    return False
                h.changed.wait(min(remaining, WAIT_SLICE))
            return True

    def contract(self, model: str) -> Contract:
        return self._h.contract(model)

    def stats(self) -> StoreStats:
        h = self._h
        with h.lock:
            entries = [e for e in h.entries.values() if e.group is None]
            groups = list(h.groups.values())
            claimed = [not g.receiving and any(e.claimed for e in g.pulled.values()) for g in groups]
            return StoreStats(
                receiving=sum(not e.committed for e in entries) + sum(g.receiving for g in groups),
                ready=sum(e.committed and not e.claimed for e in entries)
                + sum(not g.receiving and not c for g, c in zip(groups, claimed)),
                claimed=sum(e.committed and e.claimed for e in entries) + sum(claimed),
                resident_bytes=h.ledger.bytes,
                max_bytes=self.config.max_bytes,
                tombstones=len(h.tombstones),
                oldest_seconds=max((h.clock() - e.created for e in h.entries.values()), default=0.0),
                draining=h.draining,
            )

    def cancel(self, model: str, handoff_id: str) -> bool:
        """Free the hand-off in whatever phase it is; its pusher and puller in flight are interrupted."""
        h = self._h
        h.contract(model)
        check_id(model, handoff_id)
        key = (model, handoff_id)
        with h.lock:
            entry, group = h.entries.get(key), h.groups.get(key)
            if entry is None and group is None:
                if key not in h.tombstones or h.tombstones[key].how == "aborted":
                    h.bury(key, "cancelled", 0, "")  # a push that comes later is refused too
                return False
            interrupts = h.end_group(group, "cancelled") if group is not None else []
            if entry is not None and h.entries.get(key) is entry:
                interrupts += h.free(entry, "cancelled")
            h.events.cancelled(model)
        run_interrupts(interrupts)
        return True

    # -- housekeeping -------------------------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Expire unclaimed hand-offs, return lapsed claims, abort idle pushes, forget old tombstones: only the
        entries whose timers are due are looked at (`Entry.due`), each scheduled again for its next moment."""
        h = self._h
        interrupts: list[Interrupt] = []
        with h.lock:
            now = h.clock()
            for entry in h.timers.pop_due(now):
                if h.entries.get(entry.key) is not entry:
                    continue  # freed with its group earlier in this sweep
                lapsed = entry.due(now, self.config)
                if lapsed is None:  # activity moved its moment on (or a rank's part waits for its group)
                    h.timers.schedule(entry, max(entry.next_due(self.config), now + self.config.sweep_interval))
                    continue
                how, why = lapsed
                model, handoff_id = entry.group.key if entry.group is not None else entry.key
                logger.info("%s/%s: %s", model, handoff_id, why)
                if how == "unclaim":
                    interrupts += h.unclaim(entry)
                else:
                    interrupts += h.free(entry, how)
                    if how == "expired":
                        h.events.expired(model)
            h.timers.compact(len(h.entries))
            h.forget_tombstones(now)
        run_interrupts(interrupts)

    def _sweep_forever(self) -> None:
        empty_since: float | None = None  # when the store was last seen holding nothing, with no push since
        idle_done = True  # nothing held since start (or since the last on_idle): nothing to hand back
        pushes_seen = 0
        while not self._closed.wait(self.config.sweep_interval):
            try:
                self.sweep()
                if self._h.entries or self._intake.begun != pushes_seen:
                    pushes_seen = self._intake.begun
                    empty_since, idle_done = None, False
                elif not idle_done:
                    now = self._h.clock()
                    empty_since = now if empty_since is None else empty_since
                    if now - empty_since >= self.config.trim_after:
                        idle_done = True
                        if self.on_idle is not None:
                            self.on_idle()
            except Exception:  # a sweeper that dies would let memory grow unbounded: log and go on
                logger.exception("sweep failed")
