"""A pull across an emulated long link: one gRPC stream, against the TCP lane on 1 and on N connections, as a
fraction of the link's rate (and of what one raw TCP connection gets across the same link).

    sudo python benchmarks/long_link.py [--rtt-ms 20] [--mbit 1000] [--mib 256] [--runs 3] [--connections 4]

Two network namespaces this script makes and removes itself, joined by a TUN device in each and a forwarder in this
process that delays every packet by half the round trip and lets it go no faster than the link's rate (a drop-tail
queue of one bandwidth-delay product): this kernel has no `netem` qdisc, so the link is emulated in user space. The
broker and the pusher live in one namespace ("near"), the puller in the other ("far"), so only the pull crosses the
link; the broker offers no shared-memory lane (both namespaces share its host). Each run pushes a hand-off on the
near side, then pulls it from the far side into a preallocated array, which it checks; the time is the pull's.
Needs root (namespaces, TUN devices) and iproute2. Ratios hold within a run only: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from handoff_roles import broker_address, timed_call

ROOT = Path(__file__).resolve().parent.parent
NEAR_ADDRESS, FAR_ADDRESS = "10.231.0.2", "10.231.0.1"  # inside the namespaces this script makes, nowhere else
MTU = 9000  # jumbo frames: a packet rate the forwarder keeps up with in Python at 1 Gbit/s
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
RAW_PORT = 5201


class Link:
    """Two namespaces joined by an emulated link: `rtt` seconds of round trip, `rate` bytes a second each way."""

    def __init__(self, rtt: float, rate: float) -> None:
        tag = os.getpid()
        self.near, self.far = f"hb-near-{tag}", f"hb-far-{tag}"
        self._delay, self._rate = rtt / 2, rate
        self._queue_limit = rtt  # seconds of backlog the link queues before it drops (one bandwidth-delay product)
        self._stop = threading.Event()
        self._fds: list[int] = []
        self.dropped = 0
        try:
            for namespace in (self.near, self.far):
                _ip("netns", "add", namespace)
                _ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
            self._near_fd = self._tun(f"hbn{tag % 100000}", self.near, NEAR_ADDRESS, FAR_ADDRESS)
            self._far_fd = self._tun(f"hbf{tag % 100000}", self.far, FAR_ADDRESS, NEAR_ADDRESS)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._forward, name="link", daemon=True)
        self._thread.start()

    def _tun(self, device: str, namespace: str, address: str, peer: str) -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        self._fds.append(fd)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
        _ip("link", "set", device, "netns", namespace)  # (the device keeps this descriptor attached)
        _ip("netns", "exec", namespace, "ip", "addr", "add", address, "peer", peer, "dev", device)
        _ip("netns", "exec", namespace, "ip", "link", "set", device, "mtu", str(MTU), "up")
        return fd

    def _forward(self) -> None:
        """Each packet leaves its direction's queue once the link has sent the ones before it (at `rate`), and
        arrives `delay` later; one that would wait past the queue's limit is dropped."""
        due: list[tuple[float, int, int, bytes]] = []  # (arrival, sequence, destination, packet)
        free_at = {self._near_fd: 0.0, self._far_fd: 0.0}  # when each direction's link is next idle
        other = {self._near_fd: self._far_fd, self._far_fd: self._near_fd}
        sequence = 0
        while not self._stop.is_set():
            wait = max(0.0, due[0][0] - time.monotonic()) if due else 0.05
            readable, _, _ = select.select(list(other), [], [], wait)
            now = time.monotonic()
            for fd in readable:
                while True:
                    try:
                        packet = os.read(fd, 65536)
                    except (BlockingIOError, OSError):
                        break
                    start = max(now, free_at[fd])
                    if start - now > self._queue_limit:
                        self.dropped += 1
                        continue
                    free_at[fd] = start + len(packet) / self._rate
                    sequence += 1
                    heapq.heappush(due, (free_at[fd] + self._delay, sequence, other[fd], packet))
            while due and due[0][0] <= time.monotonic():
                _, _, destination, packet = heapq.heappop(due)
                try:
                    os.write(destination, packet)
                except OSError:
                    pass

    def run(self, namespace: str, *command: str, **options: object) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", namespace, *command], **options)  # type: ignore[call-overload]

    def close(self) -> None:
        self._stop.set()
        if hasattr(self, "_thread"):
            self._thread.join(timeout=5)
        for fd in self._fds:
            os.close(fd)
        for namespace in (self.near, self.far):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)  # gone already: fine


def _ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True)


# -- the processes on each side ---------------------------------------------------------------------------------------


def role(side: str, target: str, handoff_id: str, settings: str, mib: str) -> None:
    """A pusher or a puller process: prints the seconds its call took (a pull's bytes checked after)."""
    from handoff_client import HandoffClient, tune_allocator

    tune_allocator()
    with HandoffClient(target, timeout=300, **json.loads(settings)) as client:
        print(timed_call(client, "long-link", side, handoff_id, int(mib), verify=True))


def raw(side: str, mib: str) -> None:
    """One plain TCP connection across the link, the reference: the far side receives `mib` MiB and prints the
    seconds from its first byte's request to its last byte."""
    size = int(mib) << 20
    if side == "serve":
        with socket.create_server((NEAR_ADDRESS, RAW_PORT)) as listener:
            print("ready", flush=True)
            connection, _ = listener.accept()
            with connection:
                payload = memoryview(bytearray(size))
                connection.recv(1)
                connection.sendall(payload)
        return
    with socket.create_connection((NEAR_ADDRESS, RAW_PORT), timeout=300) as connection:
        into = memoryview(bytearray(size))
        started = time.perf_counter()
        connection.sendall(b"g")
        got = 0
        while got < size:
            n = connection.recv_into(into[got:])
            if n == 0:
                raise RuntimeError("the raw relay closed early")
            got += n
        print(time.perf_counter() - started)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "role":
        role(*sys.argv[2:])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "raw":
        raw(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    parser.add_argument("--mbit", type=float, default=1000.0)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--connections", type=int, default=4)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("long_link.py makes network namespaces and TUN devices: run it as root", file=sys.stderr)
        return 2
    paths = {  # name: the puller's client settings
        "gRPC stream": {"lanes": False},
        "TCP lane, 1 connection": {"lane_connections": 1},
        f"TCP lane, {args.connections} connections": {"lane_connections": args.connections},
    }
    link_rate = args.mbit * 1e6 / 8
    link = Link(args.rtt_ms / 1000, link_rate)
    seconds: dict[str, list[float]] = {"raw TCP, 1 connection": [], **{name: [] for name in paths}}
    try:
        with tempfile.TemporaryDirectory() as folder:
            manifests = Path(folder)
            manifest = {"model": "long-link", "ctx": 2, "hidden": 8,
                        "carried": [{"name": "k", "layer": 0, "rows": args.mib * 256, "cols": 1024,
                                     "dtype": "float32"}]}  # fmt: skip
            (manifests / "m.json").write_text(json.dumps(manifest))
            broker = link.run(link.near, sys.executable, "-m", "handoff_broker", "serve", "--host", NEAR_ADDRESS,
                              "--port", "0", "--contracts", str(manifests), "--metrics-port", "-1",
                              "--max-bytes", "2GiB", "--no-shared-memory-lane", "--lane-max-connections",
                              str(max(1, args.connections)), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)  # fmt: skip
            try:
                target = broker_address(broker)
                for run in range(args.runs):
                    seconds["raw TCP, 1 connection"].append(_raw(link, args.mib))
                    for name, settings in paths.items():
                        key = f"{run}-{len(seconds[name])}-{name.replace(' ', '-').replace(',', '')}"
                        _role(link, link.near, "push", target, key, {"shared_memory": False}, args.mib)
                        seconds[name].append(_role(link, link.far, "pull", target, key, settings, args.mib))
            finally:
                broker.terminate()
                broker.wait(timeout=20)
    finally:
        link.close()
    mib_per_s = link_rate / (1 << 20)
    print(f"a {args.mib} MiB pull across an emulated {args.rtt_ms:g} ms, {args.mbit:g} Mbit/s link "
          f"({mib_per_s:.0f} MiB/s; {link.dropped} packets dropped), medians of {args.runs}")  # fmt: skip
    raw_rate = args.mib / statistics.median(seconds["raw TCP, 1 connection"])
    print(f"  {'path':<28} {'MiB/s':>8} {'x link':>8} {'x raw TCP':>10}")
    for name, times in seconds.items():
        rate = args.mib / statistics.median(times)
        print(f"  {name:<28} {rate:>8.0f} {rate / mib_per_s:>8.2f} {rate / raw_rate:>10.2f}")
    return 0


def _role(link: Link, namespace: str, side: str, target: str, key: str, settings: dict, mib: int) -> float:
    process = link.run(namespace, sys.executable, __file__, "role", side, target, key, json.dumps(settings), str(mib),
                       stdout=subprocess.PIPE, text=True)  # fmt: skip
    out, _ = process.communicate(timeout=600)
    if process.returncode != 0:
        raise RuntimeError(f"the {side} process failed ({process.returncode})")
    return float(out.strip().splitlines()[-1])


def _raw(link: Link, mib: int) -> float:
    server = link.run(link.near, sys.executable, __file__, "raw", "serve", str(mib), stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()  # ready
        client = link.run(link.far, sys.executable, __file__, "raw", "pull", str(mib), stdout=subprocess.PIPE,
                          text=True)  # fmt: skip
        out, _ = client.communicate(timeout=600)
        return float(out.strip().splitlines()[-1])
    finally:
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
