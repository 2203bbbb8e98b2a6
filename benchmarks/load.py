"""Load and faults against one broker: many prefill and decode workers, random cancels and kills, then the books.

    python benchmarks/load.py --seconds 60 --pairs 32 --max-bytes 64MiB          # by hand, a longer run
    (tests/test_load.py runs a short one)

The router hands each request id, with a prompt length drawn at random (a hand-off carries only the cache rows its
prompt filled), to a prefill worker and a decode worker at once, so pulls race pushes. Each id has a fate drawn at
random: pushed and pulled; its prefill killed mid-push; its first decoder killed mid-pull (the next
decoder must get it whole); or cancelled by the router at a random moment. At the end every id must be accounted
for: pulled exactly once and bit-identical, or refused as cancelled, or never pushed whole; none delivered twice;
the broker holding 0 bytes, its RSS back near where it started.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import queue
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from handoff_client import (
    NO_RETRY,
    AlreadyClaimed,
    CallCancelled,
    Contract,
    DeadlineExceeded,
    HandoffClient,
    HandoffError,
    HandoffGone,
)
from handoff_client.protocol.frames import encode_chunk
from handoff_client.protocol.messages import handoff_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
FATES = ("normal", "kill-pusher", "kill-puller", "cancel")


@dataclass
class Books:
    """What happened to every id, kept by the workers."""

    fate: dict[str, str] = field(default_factory=dict)
    delivered: Counter = field(default_factory=Counter)
    corrupt: list[str] = field(default_factory=list)
    pushed: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)
    outcomes: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, what: str, handoff_id: str | None = None, detail: str = "") -> None:
        with self.lock:
            self.outcomes[what] += 1
            if handoff_id is not None and detail:
                self.refused[handoff_id] = detail


def content(contract: Contract, handoff_id: str, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The id's tensors at `contract`'s shapes (a hand-off's filled view: `Contract.at`): the model's random base,
    cut to the rows filled, with the id's hash over the first bytes of each tensor."""
    stamp = np.frombuffer(hashlib.sha256(handoff_id.encode()).digest(), np.uint8)
    tensors = {}
    for c in contract.carried:
        array = base[c.name][: c.rows].copy()
        flat = array.reshape(-1).view(np.uint8)
        flat[: min(32, flat.size)] = stamp[: min(32, flat.size)]
        tensors[c.name] = array
    return tensors


def broker_rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    get = lambda key: int(re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024
    return get("VmRSS"), get("VmHWM")


def run_load(
    target: str, seconds: float, pairs: int, models: list[str], seed: int = 0, pull_timeout: float = 30.0
) -> Books:
    """Drive `pairs` prefill and `pairs` decode threads against `target` for `seconds`; return the books."""
    rng = random.Random(seed)
    books = Books()
    with HandoffClient(target) as admin:
        contracts = {m: admin.get_contract(m) for m in models}
    bases = {
        m: {
            c.name: np.random.default_rng(seed)
            .integers(0, 256, c.nbytes, np.uint8)
            .view(c.numpy_dtype)
            .reshape(c.shape)
            for c in contract.carried
        }
        for m, contract in contracts.items()
    }
    to_push: queue.Queue = queue.Queue(maxsize=pairs * 2)
    to_pull: queue.Queue = queue.Queue()
    stop = threading.Event()

    def router() -> None:
        n = 0
        while not stop.is_set():
            handoff_id = f"req-{n}"
            n += 1
            fate = rng.choices(FATES, weights=(70, 10, 10, 10))[0]
            model = rng.choice(models)
            position = rng.randrange(1, contracts[model].ctx)
            books.fate[handoff_id] = fate
            try:
                to_push.put((model, handoff_id, position, fate), timeout=0.5)
            except queue.Full:
                books.fate.pop(handoff_id)
                continue
            to_pull.put((model, handoff_id, position, fate))
            if fate == "cancel":
                threading.Timer(rng.uniform(0, 0.05), cancel, args=(model, handoff_id)).start()

    def cancel(model: str, handoff_id: str) -> None:
        with HandoffClient(target) as c:
            c.cancel(model, handoff_id)

    def prefill() -> None:
        with HandoffClient(target, chunk_bytes=256 << 10) as client:
            while not (stop.is_set() and to_push.empty()):
                try:
                    model, handoff_id, position, fate = to_push.get(timeout=0.2)
                except queue.Empty:
                    continue
                tensors = content(contracts[model].at(position), handoff_id, bases[model])
                if fate == "kill-pusher":
                    kill_push(client, contracts[model], handoff_id, position, tensors)
                    books.note("push killed")
                    cancel(model, handoff_id)  # the router sees its prefill die and aborts the request
                    continue
                try:
                    client.push(model, handoff_id, position, tensors, timeout=30)
                    with books.lock:
                        books.pushed.add(handoff_id)
                    books.note("pushed")
                except HandoffError as e:
                    books.note(f"push refused: {type(e).__name__}", handoff_id, e.message)

    def decode() -> None:
        with HandoffClient(target) as client:
            while not (stop.is_set() and to_pull.empty()) or not to_push.empty():
                try:
                    model, handoff_id, position, fate = to_pull.get(timeout=0.2)
                except queue.Empty:
                    continue
                if fate == "kill-puller":
                    with HandoffClient(target) as doomed:
                        try:
                            stream = iter(doomed.pull_tensors(model, handoff_id, timeout=pull_timeout))
                            next(stream)
                            stream.close()  # the decoder dies mid-stream; the next one (below) must get it whole
                            books.note("puller killed")
                        except (HandoffError, StopIteration):
                            pass
                try:
                    handoff = pull_after_a_dead_decoder(client, model, handoff_id, pull_timeout)
                except (DeadlineExceeded, HandoffGone, CallCancelled) as e:
                    books.note(f"pull refused: {type(e).__name__}", handoff_id, e.message)
                    continue
                except HandoffError as e:
                    books.note(f"pull failed: {type(e).__name__}", handoff_id, e.message)
                    continue
                want = content(contracts[model].at(position), handoff_id, bases[model])
                with books.lock:
                    books.delivered[handoff_id] += 1
                    if any(handoff.state[k].tobytes() != v.tobytes() for k, v in want.items()):
                        books.corrupt.append(handoff_id)
                books.note("pulled")

    threads = [threading.Thread(target=router)]
    threads += [threading.Thread(target=prefill) for _ in range(pairs)]
    threads += [threading.Thread(target=decode) for _ in range(pairs)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return books


def pull_after_a_dead_decoder(client: HandoffClient, model: str, handoff_id: str, timeout: float):
    """A pull that, like a router replacing a dead decoder, tries again while the broker still sees the old claim
    (until it notices the broken stream, or until the lease of a claim that was streamed whole runs out)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.pull(model, handoff_id, timeout=max(deadline - time.monotonic(), 0.1))
        except AlreadyClaimed:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def kill_push(
    client: HandoffClient, contract: Contract, handoff_id: str, position: int, tensors: dict[str, np.ndarray]
) -> None:
    """A prefill that dies mid-push: half its chunks sent, then the stream cut."""
    gate = threading.Event()

    def frames():
        header = pb.PushHeader(
            model=contract.model, handoff_id=handoff_id, position=position, fingerprint=contract.fingerprint
        )
        yield pb.PushRequest(header=header).SerializeToString()
        for c in contract.carried[: max(1, len(contract.carried) // 2)]:
            yield encode_chunk(c.name, 0, tensors[c.name].tobytes())
        gate.wait(5)

    future = client._push.future(frames(), timeout=30)
    time.sleep(0.01)
    future.cancel()
    gate.set()


def audit(books: Books) -> list[str]:
    """Every way the books fail the guarantees; empty when they hold."""
    problems = []
    for handoff_id, count in books.delivered.items():
        if count > 1:
            problems.append(f"{handoff_id} delivered {count} times")
    problems += [f"{i} delivered with wrong bytes" for i in books.corrupt]
    for handoff_id, fate in books.fate.items():
        delivered = books.delivered[handoff_id]
        if fate == "kill-pusher" and delivered:
            problems.append(f"{handoff_id}: its push was killed, yet it was delivered")
        if fate in ("normal", "kill-puller") and handoff_id in books.pushed and delivered != 1:
            problems.append(
                f"{handoff_id}: pushed whole but delivered {delivered} times ({books.refused.get(handoff_id)})"
            )
        if fate in ("normal", "kill-puller") and handoff_id not in books.pushed and delivered:
            problems.append(f"{handoff_id}: delivered though its push never succeeded")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--max-bytes", default="64MiB")
    parser.add_argument("--models", default="demo-hybrid,every-dtype")
    parser.add_argument("--contracts", default=str(ROOT / "tests" / "manifests"))
    args = parser.parse_args(argv)
    report = run_against_own_broker(args.seconds, args.pairs, args.max_bytes, args.models.split(","), args.contracts)
    problems = report["problems"]
    report["problems"] = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
    print(json.dumps(report, indent=2))
    return 0 if not problems else 1


def run_against_own_broker(seconds: float, pairs: int, max_bytes: str, models: list[str], contracts: str) -> dict:
    """Start a broker process, load it, audit the books, and read its memory and holdings at the end."""
    command = [
        sys.executable,
        "-m",
        "handoff_broker.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--port",
        "0",
        "--metrics-port",
        "0",
    ]
    command += [
        "--contracts",
        contracts,
        "--max-bytes",
        max_bytes,
        "--lease",
        "2",
        "--idle-timeout",
        "2",
        "--ttl",
        "30",
        "--trim-after",
        "0.5",
    ]
    broker = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        address = re.match(r"handoff-broker listening on (\S+);", broker.stdout.readline()).group(1)
        rss_start, _ = broker_rss(broker.pid)
        started = time.monotonic()
        books = run_load(address, seconds, pairs, models)
        elapsed = time.monotonic() - started
        with HandoffClient(address, retry=NO_RETRY) as admin:
            deadline = time.monotonic() + 15  # killed streams and expiring leftovers settle
            while (status := admin.status()).resident_bytes and time.monotonic() < deadline:
                time.sleep(0.1)
        time.sleep(1.5)  # the broker hands memory back once it has held nothing for --trim-after
        rss_end, rss_peak = broker_rss(broker.pid)
    finally:
        broker.terminate()
        broker.wait(timeout=30)
    return {
        "seconds": round(elapsed, 2),
        "ids": len(books.fate),
        "fates": dict(Counter(books.fate.values())),
        "outcomes": dict(books.outcomes),
        "delivered_once": sum(1 for n in books.delivered.values() if n == 1),
        "delivered_twice_or_more": sum(1 for n in books.delivered.values() if n > 1),
        "resident_bytes_at_end": status.resident_bytes,
        "hand_offs_held_at_end": status.receiving + status.ready + status.claimed,
        "broker_rss_mib": {"start": rss_start >> 20, "end": rss_end >> 20, "peak": rss_peak >> 20},
        "problems": audit(books),
    }


if __name__ == "__main__":
    sys.exit(main())
