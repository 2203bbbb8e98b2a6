"""Where hand-offs live between their push and their pull: a state machine with bounded memory.

    push header ─► RECEIVING ──commit──► READY ──claim──► CLAIMED ──confirm──► gone (confirmed)
                     │  │                 │  ▲               │
                     │  └─claim (pipelined: chunks stream as they arrive; commit then completes the claim)
                     │ abort, idle        │  └──release──────┤ stream broke, stalled past the lease,
                     ▼                    ▼                  │ or streamed but unconfirmed past the lease
                 (nothing)           gone (expired)          ▼
                                     cancel, from any state: gone (cancelled)

What it guarantees:
- A hand-off is complete for pullers only after every chunk and the whole have passed the contract's checks
  (`commit`). A puller may claim it while it is still RECEIVING and get its chunks as they arrive, but the end of
  its stream, with the digest, comes only after the commit; if the push fails instead, the puller gets PushAborted.
  An aborted push frees its bytes at once and leaves no trace.
- One claimant at a time; each claim has a number unique for the store's life, and only the current claim can
  confirm. A claim whose stream broke returns at once; one whose stream stops moving, or that streamed whole but
  was never confirmed, returns after `lease` seconds.
- Resident bytes (reserved by a push at its header: the contract's size at the header's position, which counts
  only the rows the position filled of each tensor whose rows are positions) never exceed `max_bytes`, nor the
  chunks stored `max_chunks`: every charge is a reservation in the ledger (ledger.py), which asserts both.
- A READY hand-off nobody claims expires after its ttl; a push that sends nothing for `idle_timeout` is aborted.
  What is gone leaves a tombstone for `tombstone_ttl`, so late callers hear *expired*, *cancelled* or
  *confirmed* rather than *unknown*, and a push retried after its hand-off was delivered is recognised.

Where each part lives (all on one `Holdings`, holdings.py, under one lock):
    entries.py   an entry's state (`Stage`, its claim's `Hold`) and the transitions between states
    intake.py    pushes: the header's checks against what the id holds, reservations, chunks, commit, resume
    delivery.py  claims: grant, feed, the stream's end, confirm
    groups.py    tensor-parallel hand-offs (a `shard` on a push or a pull): groups of such entries
    timers.py    when each entry next needs looking at (a heap the sweeper pops)
    pushes.py    one push's checks as its chunks arrive, and whether it is new or a repeat of one held
    reshard.py   cutting what one TP size pushed into the shards a decode engine of another TP size pulls
    ledger.py    what the store holds, charged against max_bytes and max_chunks, in one place
    store.py     the store as the service sees it: life, cancel, the sweep, status

Plain Python: no gRPC in here. Streams are reached through `interrupt` callables (the service passes each call's
cancel), always called outside the lock. Every method is thread-safe; a PushSession belongs to one stream.
"""

from .entries import Claim, HandoffKey, StoreConfig, StoreEvents, StoreStats
from .store import Store

__all__ = ["Claim", "HandoffKey", "Store", "StoreConfig", "StoreEvents", "StoreStats"]
