"""Worker processes that tests kill with SIGKILL in the middle of a stream.

    python tests/workers.py pull-and-stall TARGET MODEL ID [RANK TP]   claims (a shard), reads the header and one
                                                                       chunk, then stalls
    python tests/workers.py push-and-stall TARGET MODEL ID     pushes the header and half the chunks, then stalls
    python tests/workers.py push-on-ring-and-stall TARGET MODEL ID   a resumable push on the shared-memory lane:
                                                                     half its chunks, then stalls holding the ring

Each prints "stalled" once it is mid-stream, so the test knows when to kill it.

    python tests/workers.py pull-faults TARGET MODEL ID tuned|plain|lane   pulls ID-1 to -5 into preallocated
        arrays, on the stream with or without tune_allocator(), or on the TCP lane; prints the page faults of the
        third, fourth and fifth
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from conftest import seeded_tensors
from handoff_client import HandoffClient, tune_allocator
from handoff_client.protocol.frames import crc32c
from handoff_client.protocol.lane import new_capability
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.ring import open_ring_lane
from handoff_client.protocol.wire import identity, method_path
from support import chunk_frames, header_frame, open_channel, raw_pull


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


def push_on_ring_and_stall(target: str, model: str, handoff_id: str) -> None:
    with HandoffClient(target) as client:
        lane = client.lane()
        assert lane is not None and lane.kind == pb.LANE_KIND_SHM, lane
        contract = client.get_contract(model)
        tensors = seeded_tensors(contract)
        capability = new_capability()
        header = pb.PushHeader(model=model, handoff_id=handoff_id, position=1, fingerprint=contract.fingerprint,
                               resumable=True, lane_capability=capability)  # fmt: skip
        push = client._channel.stream_unary(method_path("PushHandoff"), request_serializer=identity)
        call = push.future(iter([pb.PushRequest(header=header).SerializeToString()]), timeout=120)
        frames = open_ring_lane(lane.path, capability, timeout=30)
        chunks = [(i, at, data) for i, c in enumerate(contract.carried)
                  for at, data in _cut(tensors[c.name], 1 << 20)]  # fmt: skip
        for index, offset, data in chunks[: len(chunks) // 2]:
            frames.send(index, offset, data, crc32c(data))
        time.sleep(0.3)  # let the broker take them in
        print("stalled", flush=True)
        time.sleep(120)
        call.cancel()


def _cut(array: np.ndarray, size: int) -> Iterator[tuple[int, memoryview]]:
    payload = memoryview(array.reshape(-1).view(np.uint8))
    for at in range(0, len(payload), size):
        yield at, payload[at : at + size]


def pull_faults(target: str, model: str, handoff_id: str, allocator: str) -> None:
    if allocator == "tuned" and not tune_allocator():
        print("untunable", flush=True)
        return
    with HandoffClient(target, timeout=60, lanes=allocator == "lane", shared_memory=False) as client:
        contract = client.get_contract(model)
        into = {c.name: np.zeros(c.shape, c.numpy_dtype) for c in contract.carried}  # allocated and touched first
        client.pull(model, f"{handoff_id}-1", into=into)  # a decoder's first pulls warm its heap
        client.pull(model, f"{handoff_id}-2", into=into)
        faults = []
        for last in (3, 4, 5):  # three warm pulls: one may still grow a heap, on whichever of gRPC's threads (each
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # with its own arena) received it
            client.pull(model, f"{handoff_id}-{last}", into=into)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        print(*faults, flush=True)


if __name__ == "__main__":
    workers = {"pull-and-stall": pull_and_stall, "push-and-stall": push_and_stall, "pull-faults": pull_faults,
               "push-on-ring-and-stall": push_on_ring_and_stall}  # fmt: skip
    workers[sys.argv[1]](*sys.argv[2:])
