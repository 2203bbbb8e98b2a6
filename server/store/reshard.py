"""Cut a hand-off pushed by one TP size into the shards a decode engine of another TP size pulls.

The pushing ranks' chunks stay as they arrived. For each pulling rank, each tensor it holds is either
    reused     exactly one pushing rank sent exactly these heads (equal TP sizes; a tensor not split): that rank's
               checked chunk frames go to the puller byte for byte, no copy; or
    assembled  its heads come from parts of one or more pushing ranks' arrays: copied, row by row, straight out
               of the received chunks into one new array, which is framed into new chunks with new CRC32Cs.
Assembly is the only copy resharding adds, and only where the TP sizes differ; each pushed tensor's frames are freed
as soon as every pulling rank has its heads of it. Plain numpy, no gRPC.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from handoff_client.protocol.contract import Contract
from handoff_client.protocol.frames import decode_chunk, encode_chunk, handoff_digest
from handoff_client.protocol.limits import DEFAULT_CHUNK_BYTES
from handoff_client.protocol.shards import Shard, ShardContract

from .entries import StoredChunk

Pushed = Mapping[int, tuple[ShardContract, list[list[StoredChunk]]]]
"""Per pushing rank: its view of the contract and its chunks, by the view's tensor index, in offset order."""


@dataclass(frozen=True)
class _Source:
    heads: tuple[int, int]
    chunks: list[StoredChunk]


@dataclass(frozen=True)
class ShardPlan:
    """How one pulling rank's shard is made: per tensor of its view, the chunks to reuse or the parts to assemble."""

    view: ShardContract
    reuse: dict[int, list[StoredChunk]]
    assemble: dict[int, list[_Source]]

    @property
    def new_bytes(self) -> int:
        """Bytes that assembly allocates (what the broker must have room for)."""
        return sum(self.view.carried[i].nbytes for i in self.assemble)


def plan(contract: Contract, pushed: Pushed, shard: Shard) -> ShardPlan:
    """Where `shard`'s every tensor comes from, given every pushing rank's chunks."""
    view = ShardContract.of(contract, shard, pushing=False)
    reuse: dict[int, list[StoredChunk]] = {}
    assemble: dict[int, list[_Source]] = {}
    for index, (carried, wanted) in enumerate(zip(view.carried, view.heads)):
        sources = []
        for push_view, by_tensor in pushed.values():
            at = push_view._index.get(carried.name)
            if at is not None:
                sources.append((push_view.heads[at], by_tensor[at]))
        if wanted is None:  # not split: rank 0 pushed it whole
            reuse[index] = sources[0][1]
            continue
        exact = [chunks for heads, chunks in sources if heads == wanted]
        if exact:
            reuse[index] = exact[0]
        else:
            assemble[index] = [
                _Source(heads, chunks) for heads, chunks in sources if heads[0] < wanted[1] and wanted[0] < heads[1]
            ]
    return ShardPlan(view, reuse, assemble)


def build_all(plans: list[ShardPlan], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[list[StoredChunk], str]]:
    """Every pulling rank's chunks in contract order (reused frames as they are, assembled ones new) and digest,
    built tensor by tensor across the ranks, so each pushed tensor's frames are freed while the cut goes on and the
    next tensor's new frames can take their pages: the cut needs about one tensor's worth of memory on top of the
    hand-off, not a second copy of it (measured: a 256 MiB reshard peaked at base + 1.15x instead of 2.1x)."""
    built: list[list[StoredChunk]] = [[] for _ in plans]
    for name in tensor_names(plans):
        for out, chunks in zip(built, build_tensor(plans, name, chunk_bytes)):
            out += chunks
    return [(out, digest_of(out)) for out in built]


def tensor_names(plans: list[ShardPlan]) -> list[str]:
    """The hand-off's tensors, in contract order."""
    return [c.name for c in plans[0].view.whole.carried] if plans else []


def build_tensor(plans: list[ShardPlan], name: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[list[StoredChunk]]:
    """Each pulling rank's chunks of one tensor (none for a rank that does not hold it), once every pushing rank
    that holds it has all of it. The pushed chunk lists it assembled from are emptied (unless a rank reuses them as
    they are): their frames are no longer needed."""
    built: list[list[StoredChunk]] = [[] for _ in plans]
    consumed: list[list[StoredChunk]] = []
    for out, shard_plan in zip(built, plans):
        index = shard_plan.view._index.get(name)
        if index is None:
            continue
        if index in shard_plan.reuse:
            out += [
                StoredChunk(index, c.offset, c.length, c.crc, c.frame, c.data)
                for c in sorted(shard_plan.reuse[index], key=lambda c: c.offset)
            ]
            continue
        sources = shard_plan.assemble[index]
        array = _assemble(shard_plan.view, index, sources)
        for offset in range(0, len(array), chunk_bytes):
            frame = encode_chunk(name, offset, array[offset : offset + chunk_bytes])
            chunk = decode_chunk(frame)
            assert chunk is not None  # encode_chunk's frames always decode
            out.append(StoredChunk(index, offset, len(chunk.data), chunk.crc32c, frame, chunk.data))
        consumed += [source.chunks for source in sources]
    reused = {id(chunks) for p in plans for chunks in p.reuse.values()}
    for chunks in consumed:
        if id(chunks) not in reused:
            chunks.clear()
    return built


def digest_of(chunks: list[StoredChunk]) -> str:
    """A pulling rank's digest: over its chunks as it receives them."""
    return handoff_digest((c.index, c.offset, c.length, c.crc) for c in chunks)


def _assemble(view: ShardContract, index: int, sources: list[_Source]) -> np.ndarray:
    """The pulling rank's array of one tensor, as bytes, copied from the pushing ranks' chunks that hold its heads."""
    carried, wanted = view.carried[index], view.heads[index]
    assert wanted is not None
    head_bytes = carried.head_dim * carried.numpy_dtype.itemsize
    out = np.empty((carried.rows, (wanted[1] - wanted[0]) * head_bytes), np.uint8)
    for source in sources:
        lo, hi = max(wanted[0], source.heads[0]), min(wanted[1], source.heads[1])
        row_bytes = (source.heads[1] - source.heads[0]) * head_bytes
        columns = ((lo - source.heads[0]) * head_bytes, (hi - source.heads[0]) * head_bytes)
        into = (lo - wanted[0]) * head_bytes
        for chunk in source.chunks:
            _copy_columns(np.frombuffer(chunk.data, np.uint8), chunk.offset, row_bytes, columns, out, into)
    return out.reshape(-1)


def _copy_columns(
    data: np.ndarray, offset: int, row_bytes: int, columns: tuple[int, int], out: np.ndarray, into: int
) -> None:
    """Copy the byte columns [columns) of the rows that `data` (bytes [offset, offset + len) of a row-major array
    with `row_bytes` per row) covers into `out` at column `into`: whole rows as one block, a partial first or last
    row on its own."""
    first, last = columns
    end = offset + len(data)
    row = offset // row_bytes
    while row * row_bytes < end:
        row_start = row * row_bytes
        lo, hi = max(offset, row_start), min(end, row_start + row_bytes)
        if lo == row_start and hi == row_start + row_bytes:  # a run of whole rows
            rows = (end - row_start) // row_bytes
            block = data[row_start - offset : row_start - offset + rows * row_bytes].reshape(rows, row_bytes)
            out[row : row + rows, into : into + last - first] = block[:, first:last]
            row += rows
            continue
        a, b = max(lo - row_start, first), min(hi - row_start, last)
        if a < b:
            out[row, into + a - first : into + b - first] = data[row_start + a - offset : row_start + b - offset]
        row += 1
