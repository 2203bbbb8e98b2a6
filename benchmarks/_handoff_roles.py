"""handoff-broker's role processes: a pusher and a puller through the client library (on the streams, the TCP lane
or the shared-memory lane), a prefill and a decoder after a prompt of some length, one rank of a tensor-parallel
engine, and threads of pusher/puller pairs. Each prints one JSON line of its timestamps; a puller prints "ready"
first. Run through `_roles.py`."""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent import futures

import numpy as np
from _harness import crc, destination, payload

PATHS = {"stream": "handoff", "tcp": "handoff tcp", "shm": "handoff shm"}  # the client's path: its row's name


def tensors_of(contract, seed: int = 1) -> dict[str, np.ndarray]:
    data = payload(contract.nbytes, seed)
    tensors, at = {}, 0
    for c in contract.carried:
        tensors[c.name] = data[at : at + c.nbytes].view(c.numpy_dtype).reshape(c.shape)
        at += c.nbytes
    return tensors


def chunk_bytes() -> int | None:
    """--chunk-bytes, or None: the client's own choice for each path."""
    chosen = os.environ.get("BENCH_CHUNK_BYTES")
    return int(chosen) if chosen else None


def lanes(path: str) -> dict[str, bool]:
    """The client's settings for a path: "stream", "tcp" (the TCP lane) or "shm" (the shared-memory lane)."""
    return {"lanes": path != "stream", "shared_memory": path == "shm"}


def role_handoff_producer(target: str, model: str, key: str, path: str = "stream") -> None:
    from handoff_client import HandoffClient

    with HandoffClient(target, chunk_bytes=chunk_bytes(), **lanes(path)) as client:
        tensors = tensors_of(client.get_contract(model))
        t0 = time.monotonic()
        client.push(model, key, 1, tensors)
        print(json.dumps({"t0": t0, "t_end": time.monotonic()}))


def caches_of(contract) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The decoder's whole caches as one touched buffer, each tensor a view of it at its declared shape."""
    out = destination(contract.nbytes)
    into, at = {}, 0
    for c in contract.carried:
        into[c.name] = out[at : at + c.nbytes].view(c.numpy_dtype).reshape(c.shape)
        at += c.nbytes
    return out, into


def role_handoff_consumer(target: str, model: str, key: str, path: str = "stream") -> None:
    from handoff_client import HandoffClient

    with HandoffClient(target, **lanes(path)) as client:
        out, into = caches_of(client.get_contract(model))
        print("ready", flush=True)
        pulled = client.pull_tensors(model, key, timeout=120, into=into)
        first = None
        for _ in pulled:
            first = first or time.monotonic()
        t1 = time.monotonic()
        print(json.dumps({"t1": t1, "t_first": first, "crc": crc(out)}))


def role_prompt_producer(target: str, model: str, key: str, position: str) -> None:
    """A prefill after a prompt of `position` tokens: pushes its whole cache arrays; what crosses is up to the
    contract (only the filled rows where they are marked as positions)."""
    from handoff_client import HandoffClient

    with HandoffClient(target, chunk_bytes=chunk_bytes(), timeout=600) as client:
        contract = client.get_contract(model)
        tensors = tensors_of(contract)
        filled = contract.at(int(position))
        digest = filled_crc(filled, tensors)
        t0 = time.monotonic()
        result = client.push(model, key, int(position), tensors)
        print(json.dumps({"t0": t0, "t_end": time.monotonic(), "bytes": result.bytes, "crc": digest}))


def role_prompt_consumer(target: str, model: str, key: str) -> None:
    """A decoder pulling into its whole preallocated caches: the first rows filled, the rest untouched."""
    from handoff_client import HandoffClient

    with HandoffClient(target, timeout=600) as client:
        contract = client.get_contract(model)
        _, into = caches_of(contract)
        print("ready", flush=True)
        handoff = client.pull(model, key, timeout=600, into=into)
        t1 = time.monotonic()
        print(json.dumps({"t1": t1, "crc": filled_crc(contract.at(handoff.position), handoff.state)}))


def filled_crc(filled, tensors: dict[str, np.ndarray]) -> int:
    """CRC32C over each tensor's filled rows in contract order (the bytes a prefix hand-off must deliver)."""
    from crc32c import crc32c  # (the package itself: it continues a CRC from a previous value)

    value = 0
    for c in filled.carried:
        value = crc32c(np.ascontiguousarray(tensors[c.name][: c.rows]).reshape(-1).view(np.uint8), value)
    return value


def role_handoff_rank(target: str, model: str, key: str, side: str, rank: int, tp: int) -> None:
    """One rank of a TP engine, a process of its own as in vLLM or SGLang, pushing or pulling its shard of one
    hand-off. It prints "ready" once prepared (a pusher has its shard in memory) and a pusher starts on a line read
    from stdin, so every rank starts together."""
    from handoff_client import HandoffClient, Shard, shard_arrays

    with HandoffClient(target, chunk_bytes=chunk_bytes()) as client:
        contract = client.get_contract(model)
        mine = shard_arrays(contract, tensors_of(contract), Shard(rank, tp), pushing=True) if side == "push" else None
        print("ready", flush=True)
        if side == "push":
            sys.stdin.readline()
        t0 = first = time.monotonic()
        if side == "push":
            client.push(model, key, 1, mine, shard=(rank, tp))
        else:
            first = None
            for _ in client.pull_tensors(model, key, shard=(rank, tp), timeout=120):
                first = first or time.monotonic()
        print(json.dumps({"t0": t0, "t1": time.monotonic(), "t_first": first}))


def role_handoff_pairs(target: str, model: str, pairs: int, side: str, prefix: str) -> None:
    """`pairs` threads, each pushing (or pulling) one hand-off; per-thread start and end times."""
    from handoff_client import HandoffClient

    with HandoffClient(target, chunk_bytes=chunk_bytes()) as client:
        contract = client.get_contract(model)
        tensors = tensors_of(contract)
        if side == "pull":
            print("ready", flush=True)

        def one(i: int) -> tuple[float, float]:
            start = time.monotonic()
            if side == "push":
                client.push(model, f"{prefix}-{i}", 1, tensors)
            else:
                client.pull(model, f"{prefix}-{i}", timeout=120)
            return start, time.monotonic()

        with futures.ThreadPoolExecutor(pairs) as pool:
            times = list(pool.map(one, range(pairs)))
    print(json.dumps({"times": times}))
