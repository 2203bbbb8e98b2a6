"""Worker processes that tests kill with SIGKILL in the middle of a stream.

    python tests/workers.py pull-and-stall TARGET MODEL ID [RANK TP]   claims (a shard), reads the header and one
                                                                       chunk, then stalls
    python tests/workers.py push-and-stall TARGET MODEL ID     pushes the header and half the chunks, then stalls

Each prints "stalled" once it is mid-stream, so the test knows when to kill it.

    python tests/workers.py pull-faults TARGET MODEL ID tuned|plain|lane   pulls ID-1 to -4 into preallocated
        arrays, on the stream with or without tune_allocator(), or on the TCP lane; prints the page faults of the
        third or fourth, the fewer
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from conftest import seeded_tensors  # noqa: E402
from handoff_client import HandoffClient, tune_allocator  # noqa: E402
from support import chunk_frames, header_frame, open_channel, raw_pull  # noqa: E402


def pull_and_stall(target: str, model: str, handoff_id: str, *shard: str) -> None:
    channel = open_channel(target)
    part = (int(shard[0]), int(shard[1])) if shard else None
    stream = raw_pull(channel, model, handoff_id, timeout=120, shard=part)
    next(stream)
    next(stream)
    print("stalled", flush=True)
    time.sleep(120)


def push_and_stall(target: str, model: str, handoff_id: str) -> None:
    with HandoffClient(target) as client:
        contract = client.get_contract(model)
    frames = chunk_frames(contract, seeded_tensors(contract), chunk_bytes=1 << 20)
    stalled = threading.Event()

    def stream() -> Iterator[bytes]:
        yield header_frame(contract, handoff_id)
        yield from frames[: len(frames) // 2]
        stalled.set()
        time.sleep(120)

    push = open_channel(target).stream_unary("/handoff.v1.HandoffBroker/PushHandoff", request_serializer=lambda b: b)
    future = push.future(stream(), timeout=120)
    stalled.wait()
    time.sleep(0.3)  # let the sent frames leave the process
    print("stalled", flush=True)
    future.result()


def pull_faults(target: str, model: str, handoff_id: str, allocator: str) -> None:
    if allocator == "tuned" and not tune_allocator():
        print("untunable", flush=True)
        return
    with HandoffClient(target, timeout=60, lanes=allocator == "lane") as client:
        contract = client.get_contract(model)
        into = {c.name: np.zeros(c.shape, c.numpy_dtype) for c in contract.carried}  # allocated and touched first
        client.pull(model, f"{handoff_id}-1", into=into)  # a decoder's first pulls warm its heap
        client.pull(model, f"{handoff_id}-2", into=into)
        faults = []
        for last in (3, 4):  # the fewer of two warm pulls: one may still grow the heap while gRPC's threads settle
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            client.pull(model, f"{handoff_id}-{last}", into=into)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        print(min(faults), flush=True)


if __name__ == "__main__":
    workers = {"pull-and-stall": pull_and_stall, "push-and-stall": push_and_stall, "pull-faults": pull_faults}
    workers[sys.argv[1]](*sys.argv[2:])
