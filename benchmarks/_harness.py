"""What the side-by-side comparisons in benchmarks/ share (throughput.py, prompts.py, latency.py, resharding.py,
concurrency.py, memory.py): the payloads and contracts, the role processes and how they are started, reading a
process's CPU time and memory, the services a comparison measures (a broker, the naive gRPC relay, Redis), and the
command line every comparison takes.

Invariants every comparison keeps:
- every payload is deterministic (`payload`), so each process makes its own copy and a consumer checks what it got
  (CRC32C) against the producer's;
- every consumer's destination is allocated and touched before the clock starts (`destination`), as a decoder's
  preallocated cache is, so no path pays first-touch page faults inside the measurement;
- every role is a process of its own, started through `_roles.py` (`spawn`), with the allocator settings the broker
  sets for itself;
- every figure printed is a ratio against a baseline measured in the same run: single runs on a shared 2-core
  machine vary by tens of percent, ratios within one run much less;
- every process a comparison starts is stopped when it ends (`Services` is a context manager).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np

MiB = 1 << 20
RELAY_BUFFER = 4 * MiB  # the raw relays' socket reads and writes, and the tuned gRPC relay's message size
HERE = Path(__file__).resolve().parent
ROLES_SCRIPT = HERE / "_roles.py"


# -- payloads and contracts -----------------------------------------------------------------------------------------


def payload(nbytes: int, seed: int = 1) -> np.ndarray:
    """Deterministic bytes that every process can make for itself."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def destination(nbytes: int) -> np.ndarray:
    """A consumer's buffer, allocated and touched before the clock starts, as a decoder's preallocated cache is:
    every path pays the same first-touch page faults (or none), outside the measurement."""
    out = np.empty(nbytes, np.uint8)
    out.fill(0)
    return out


def crc(buffer) -> int:
    """CRC32C of a buffer's bytes (the lanes' checksum)."""
    from handoff_client.protocol.frames import crc32c

    return crc32c(memoryview(buffer).cast("B"))


def model_name(label: str) -> str:
    """The contract's name for a payload size's label: "16 MiB" -> "bench-16mib"."""
    return f"bench-{label.replace(' ', '').lower()}"


def manifest(model: str, nbytes: int) -> dict:
    """A contract of `nbytes` in bfloat16 tensors of at most 8 MiB, two a layer (a key and a value cache)."""
    rows_total = nbytes // (1024 * 2)
    per = min(rows_total, 4096)
    carried, layer, left = [], 0, rows_total
    while left > 0:
        for kind in ("k_cache", "v_cache"):
            if left <= 0:
                break
            rows = min(per, left)
            carried.append({"name": f"layers.{layer}.self_attn.{kind}", "layer": layer, "rows": rows, "cols": 1024,
                            "dtype": "bfloat16", "heads": 8, "head_dim": 128})  # fmt: skip
            left -= rows
        layer += 1
    return {"model": model, "ctx": 1 << 20, "hidden": 4096, "carried": carried}


def llama3_8b(model: str, ctx: int, layers: int = 32, positional: bool = False) -> dict:
    """Llama-3-8B's carried state over `ctx` positions (bf16, 8 KV heads of 128 a layer); `positional`: the caches
    marked `rows_are_positions` (a hand-off carries the rows its prompt filled), as contract-from-config marks them."""
    marker = {"rows_are_positions": True} if positional else {}
    carried = [{"name": f"layers.{i}.self_attn.{kind}", "layer": i, "rows": ctx, "cols": 8 * 128, "dtype": "bfloat16",
                "heads": 8, "head_dim": 128, **marker} for i in range(layers) for kind in ("k_cache", "v_cache")]  # fmt: skip
    return {"model": model, "ctx": ctx, "hidden": 4096, "carried": carried}


# -- role processes -------------------------------------------------------------------------------------------------


def spawn(*args: object, fed: bool = False) -> subprocess.Popen:
    """A role process (`_roles.py ROLE ARGS...`); `fed`: with a pipe to its stdin (a role that waits there for the
    line that starts it)."""
    stdin = subprocess.PIPE if fed else None
    return subprocess.Popen(
        [sys.executable, str(ROLES_SCRIPT), *map(str, args)], stdin=stdin, stdout=subprocess.PIPE, text=True
    )


def result(process: subprocess.Popen, timeout: float = 600) -> dict:
    """The JSON line a role prints last, once it has exited 0."""
    out, _ = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"{process.args[2:]} failed ({process.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def wait_ready(process: subprocess.Popen) -> None:
    """Block until a consumer role says it is ready (connected, its destination touched)."""
    line = process.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"{process.args[2:]} did not get ready: {line!r}")


def port_from(path: Path, timeout: float = 30) -> int:
    """The port a server role wrote to `path` once it listens."""
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no port in {path}")
        time.sleep(0.01)
    return int(path.read_text())


def relay_run(producer: subprocess.Popen, consumer: subprocess.Popen, nbytes: int) -> dict:
    """One transfer's seconds (consumer done - producer start) and its timestamps, the consumer's bytes checked."""
    c, p = result(consumer), result(producer)
    if c["crc"] != crc(payload(nbytes)):
        raise RuntimeError("the consumer's bytes differ from the producer's")
    return {"seconds": c["t1"] - p["t0"], **{k: v for k, v in {**p, **c}.items() if k.startswith("t")}}


# -- a process's CPU time and memory --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuReading:
    """A process's CPU time at one moment, read two ways: each of its live threads' run time in nanoseconds
    (/proc/PID/task/TID/schedstat), and the whole process's in clock ticks (/proc/PID/stat: 10 ms apiece, but
    counting the threads that have exited too)."""

    threads: dict[int, int]
    ticks: float


def cpu_now(pid: int) -> CpuReading:
    """Read a process's CPU time now."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            threads[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # (exited as we read, or no schedstats in this kernel)
            pass
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return CpuReading(threads, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))


def cpu_since(pid: int, before: CpuReading) -> float:
    """CPU seconds the process spent since `before`: to the nanosecond (its threads' run times since, a thread started
    since counting whole) where those add up to the process's own clock-tick count within two ticks; else that
    count, which also holds the threads that exited meanwhile (one started and gone within the run is in no list)."""
    now = cpu_now(pid)
    ticks = now.ticks - before.ticks
    threads = sum(ns - before.threads.get(tid, 0) for tid, ns in now.threads.items()) / 1e9
    return threads if abs(threads - ticks) <= 2 / os.sysconf("SC_CLK_TCK") else ticks


def rss(pid: int) -> tuple[int, int]:
    """A process's resident set and its peak since the last `reset_peak`, in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()

    def grab(key: str) -> int:
        return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024

    return grab("VmRSS"), grab("VmHWM")


def reset_peak(pid: int) -> None:
    """Reset a process's peak RSS (VmHWM), where the kernel lets us."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass


def machine() -> dict:
    """The machine the figures were measured on."""
    cpu = "unknown"
    try:
        cpu = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE).group(1)
    except (OSError, AttributeError):
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": sys.version.split()[0]}


# -- the services a comparison measures -----------------------------------------------------------------------------


class Redis:
    """Just enough of RESP for PING, RPUSH and BLPOP."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb", buffering=RELAY_BUFFER)

    def command(self, *parts: bytes) -> object:
        """Send one command; its reply."""
        self.sock.sendall(b"".join([f"*{len(parts)}\r\n".encode()] + [b"$%d\r\n%s\r\n" % (len(p), p) for p in parts]))
        return self._read()

    def _read(self) -> object:
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind in (b"+", b":"):
            return rest
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            return [self._read() for _ in range(int(rest))]
        raise RuntimeError(line)


class Services:
    """The long-lived processes of one comparison (a broker, the naive gRPC relay, redis-server, server roles), each
    stopped when the `with` block ends, however it ends."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.notes: list[str] = []
        self._processes: list[subprocess.Popen] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def keep(self, process: subprocess.Popen) -> subprocess.Popen:
        """Stop `process` with the others at the end."""
        self._processes.append(process)
        return process

    def broker(self, models: dict[str, dict]) -> tuple[subprocess.Popen, str]:
        """A broker process serving `models` (name -> manifest), its lanes on from 1 MiB: (process, address)."""
        contracts = self.workdir / "contracts"
        contracts.mkdir(exist_ok=True)
        for name, manifest_json in models.items():
            (contracts / f"{name}.json").write_text(json.dumps(manifest_json))
        broker = self.keep(subprocess.Popen(
            [sys.executable, "-m", "handoff_broker.cli", "--log-level", "WARNING", "serve", "--port", "0",
             "--metrics-port", "-1", "--contracts", str(contracts),
             "--shared-memory-lane-min-bytes", "1MiB"],  # (each lane's row on that lane, from the lanes' 1 MiB floor)
            stdout=subprocess.PIPE, text=True,
        ))  # fmt: skip
        return broker, re.match(r"handoff-broker listening on (\S+);", broker.stdout.readline()).group(1)

    def naive_relay(self) -> int:
        """The naive and tuned gRPC relay (and the gRPC floor's do-nothing methods): its port."""
        port_file = self.workdir / "naive.port"
        self.keep(spawn("naive-grpc-relay", port_file))
        return port_from(port_file)

    def redis(self) -> int | None:
        """A redis-server on loopback, no persistence: its port; None (and a note) when there is none."""
        redis = shutil.which("redis-server")
        if not redis:
            self.notes.append("redis relay skipped: no redis-server on PATH (apt-get install redis-server)")
            return None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.keep(subprocess.Popen(
            [redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--proto-max-bulk-len", "512mb", "--client-output-buffer-limit", "normal 0 0 0"],
            stdout=subprocess.DEVNULL,
        ))  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                Redis(port).command(b"PING")
                return port
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """Terminate every process kept, then wait for each (killing one that does not end)."""
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        self._processes.clear()


# -- the command line and the report --------------------------------------------------------------------------------


def arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options every comparison takes: --quick, --runs, --json, --chunk-bytes."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and few runs (CI's smoke run)")
    parser.add_argument("--runs", type=int, help="runs per path and size (median reported); default 3, quick 2")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--chunk-bytes", type=int, help="the handoff client's chunk size (default: the client's own)")
    return parser


def setting_up(args: argparse.Namespace) -> tuple[int, dict]:
    """The runs per path, and the results' common part (machine, quick, notes); --chunk-bytes passed on to the roles."""
    if args.chunk_bytes:
        os.environ["BENCH_CHUNK_BYTES"] = str(args.chunk_bytes)
    runs = args.runs or (2 if args.quick else 3)
    return runs, {"machine": machine(), "quick": args.quick, "notes": []}


def header(results: dict) -> list[str]:
    """The report's first lines: the machine, and a warning on a quick run."""
    m = results["machine"]
    lines = [f"machine: {m['cpus']} cpus, {m['cpu']}, Python {m['python']}"]
    if results.get("quick"):
        lines.insert(0, "QUICK RUN: a smoke test of the benchmark itself (small sizes, few runs); not measurements")
    return lines


def finish(results: dict, lines: list[str], json_path: str | None) -> None:
    """Print the report (its notes last) and write every figure to `json_path` if given."""
    print("\n".join(header(results) + lines + [f"note: {n}" for n in results["notes"]]))
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
