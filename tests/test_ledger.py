"""The ledger (server/store/ledger.py): every byte and chunk the store holds is charged to one reservation, released
exactly once, and the totals never go negative nor past their bounds."""

from __future__ import annotations

import pytest
from handoff_broker.store.ledger import Ledger


def test_a_reservation_gives_back_exactly_what_it_holds_once():
    ledger = Ledger(max_bytes=100, max_chunks=3)
    first, second = ledger.reservation(), ledger.reservation()
    first.charge(60)
    assert first.take_chunk() and first.take_chunk()
    second.charge(40)
    assert second.take_chunk()
    assert (ledger.bytes, ledger.chunks, ledger.free_bytes) == (100, 3, 0)
    assert not second.take_chunk() and not ledger.fits(1)  # at both bounds
    first.release()
    first.release()  # every path that ends an entry may release it: the second changes nothing
    assert (ledger.bytes, ledger.chunks) == (40, 1)
    second.release()
    assert (ledger.bytes, ledger.chunks) == (0, 0)


def test_a_charge_past_the_bound_fails_loudly_where_it_happens():
    ledger = Ledger(max_bytes=10, max_chunks=1)
    reservation = ledger.reservation()
    with pytest.raises(AssertionError, match="11 bytes held of 10"):
        reservation.charge(11)  # the caller should have asked `fits`: an accounting slip, not a refusal
