"""Lanes under TLS: a 256 MiB hand-off pushed then pulled by separate processes through a broker serving TLS, on the
gRPC streams (TLS), on the sealed TCP lane (AES-256-GCM frames) and on the shared-memory lane (same host, nothing to
seal), beside the plain broker's TCP lane; medians of --runs, side by side in one run.

    python benchmarks/tls_lanes.py [--runs 3] [--mib 256]

Each run: a pusher process pushes, then a puller process pulls into a preallocated array and checks it; the time
is each process's own call. Ratios hold within a run only: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from handoff_roles import broker_address, timed_call

ROOT = Path(__file__).resolve().parent.parent
PATHS = {  # name: (broker, client settings)
    "TLS streams": ("tls", {"lanes": False}),
    "TLS sealed TCP lane": ("tls", {"shared_memory": False}),
    "TLS shared-memory lane": ("tls", {}),
    "plain TCP lane": ("plain", {"shared_memory": False}),
}


def role(target: str, ca_file: str, side: str, handoff_id: str, settings: str, mib: str) -> None:
    """A pusher or a puller process: prints the seconds its call took."""
    from handoff_client import HandoffClient, tune_allocator

    tune_allocator()
    tls = {"tls_root_certificates": Path(ca_file).read_bytes(), "tls_server_name": "localhost"} if ca_file else {}
    with HandoffClient(target, timeout=120, **tls, **json.loads(settings)) as client:
        print(timed_call(client, "tls-bench", side, handoff_id, int(mib)))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "role":
        role(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from certs import Authority  # the tests' throwaway CA (cryptography)

    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        (work / "manifests").mkdir()
        manifest = {"model": "tls-bench", "ctx": 2, "hidden": 8,
                    "carried": [{"name": "k", "layer": 0, "rows": args.mib * 256, "cols": 1024, "dtype": "float32"}]}  # fmt: skip
        (work / "manifests" / "m.json").write_text(json.dumps(manifest))
        ca = Authority("bench CA")
        server = ca.issue("localhost", server=True)
        for name, pem in (("ca.pem", ca.pem), ("cert.pem", server.cert), ("key.pem", server.key)):
            (work / name).write_bytes(pem)
        brokers = {"plain": _serve(work, []), "tls": _serve(work, ["--tls-cert", str(work / "cert.pem"),
                                                                   "--tls-key", str(work / "key.pem")])}  # fmt: skip
        try:
            targets = {kind: broker_address(process) for kind, process in brokers.items()}
            seconds: dict[str, list[float]] = {name: [] for name in PATHS}
            for run in range(args.runs):
                for name, (kind, settings) in PATHS.items():
                    ca_file = str(work / "ca.pem") if kind == "tls" else ""
                    key = f"{run}-{name.replace(' ', '-')}"
                    push = _role(targets[kind], ca_file, "push", key, settings, args.mib)
                    pull = _role(targets[kind], ca_file, "pull", key, settings, args.mib)
                    seconds[name].append(push + pull)
        finally:
            for process in brokers.values():
                process.terminate()
                process.wait(timeout=20)
    streams = statistics.median(seconds["TLS streams"])
    print(f"{args.mib} MiB pushed then pulled, medians of {args.runs}      MiB/s (push+pull)   x TLS streams")
    for name, times in seconds.items():
        rate = 2 * args.mib / statistics.median(times)
        print(f"  {name:<26} {rate:>20.0f} {streams / statistics.median(times):>16.2f}")
    return 0


def _serve(work: Path, tls: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "handoff_broker", "serve", "--contracts", str(work / "manifests"), "--port", "0",
               "--metrics-port", "-1", "--max-bytes", "2GiB", *tls]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _role(target: str, ca_file: str, side: str, key: str, settings: dict, mib: int) -> float:
    out = subprocess.run([sys.executable, __file__, "role", target, ca_file, side, key, json.dumps(settings), str(mib)],
                         capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
