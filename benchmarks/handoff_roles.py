"""What the lane benchmarks (tls_lanes.py, long_link.py) share: the pusher's or the puller's one timed call on a
one-tensor hand-off of `mib` MiB, and the broker's address read off its start-up line."""

from __future__ import annotations

import re
import subprocess
import time


def payload(mib: int):
    """The pushed tensor: the same random bytes in every process, so a puller can check what it got."""
    import numpy as np

    return np.random.default_rng(1).integers(0, 1 << 30, (mib * 256, 1024), dtype=np.int32).view(np.float32)


def timed_call(client, model: str, side: str, handoff_id: str, mib: int, verify: bool = False) -> float:
    """Push the payload ("push") or pull it into a preallocated array ("pull", checked with `verify`): the seconds
    the call took."""
    import numpy as np

    if side == "push":
        array = payload(mib)
        started = time.perf_counter()
        client.push(model, handoff_id, 1, {"k": array})
        return time.perf_counter() - started
    into = {"k": np.ones((mib * 256, 1024), np.float32)}
    started = time.perf_counter()
    client.pull(model, handoff_id, into=into)
    elapsed = time.perf_counter() - started
    if verify:
        assert np.array_equal(into["k"].view(np.int32), payload(mib).view(np.int32)), "the pull's bytes differ"
    return elapsed


def broker_address(process: subprocess.Popen) -> str:
    """The address `handoff-broker serve` prints on its first line."""
    line = process.stdout.readline()
    match = re.search(r"listening on (\S+);", line)
    if match is None:
        raise RuntimeError(f"the broker did not start: {line!r}")
    return match.group(1)
