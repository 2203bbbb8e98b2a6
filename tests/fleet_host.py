"""A prefill or decode worker on a host of its own (a network namespace), driven by tests/test_fleet_heals.py.

    python tests/fleet_host.py ETCD_URL

holds one FleetClient over the etcd set (refresh 0.3 s, the TCP lane between hosts: `shared_memory=False`, since
the namespaces share a boot id) and answers JSON commands, one a line on stdin, each in its own thread, with one JSON
line on stdout carrying the command's `n`. Times are `time.time()` (the test's processes share the clock).

    {"op": "members"}                                   the brokers this client's set holds now
    {"op": "push", "id", "seed"}                        push; the broker that took it, from its ticket
    {"op": "pull", "id", "seed", "ticket", "timeout"}   pull; whether every bit is the pushed one
    {"op": "push_until", "broker", "brokers", "prefix", "seed", "deadline"}
        push new ids that rank `broker` first among `brokers` until one lands there (or the deadline)
    {"op": "hammer", "tickets", "timeout", "deadline"}
        pull by these tickets in turn (waiting 0.05 s for a push) until one is answered by its broker (anything but
        BrokerUnavailable)
    {"op": "health", "target", "service"}               the broker's gRPC health status for the service
    {"op": "metric", "url", "name", "labels"}           one sample of a broker's /metrics
    {"op": "fallbacks"}                                 lane-fallback warnings logged so far
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import urllib.request
from collections.abc import Callable

import numpy as np
from handoff_client import BrokerUnavailable, HandoffClient, HandoffError
from handoff_client.fleet import read_ticket, rendezvous

MODEL = "demo-hybrid"
POSITION = 4095  # every row filled: 4.3 MB, on the TCP lane
lock = threading.Lock()
fallbacks: list[str] = []


class Fallbacks(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "lane_fallback", False):
            fallbacks.append(record.getMessage())


def tensors(client: HandoffClient, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        c.name: rng.integers(0, 256, size=c.nbytes, dtype=np.uint8).view(c.numpy_dtype).reshape(c.shape)
        for c in client.get_contract(MODEL).carried
    }


def failure(error: HandoffError, started: float) -> dict:
    return {"error": type(error).__name__, "message": error.message, "broker": error.fields.get("broker", ""),
            "elapsed": time.time() - started}  # fmt: skip


def push(client: HandoffClient, handoff_id: str, seed: int) -> dict:
    arrays = tensors(client, seed)
    started = time.time()
    try:
        ticket = client.push(MODEL, handoff_id, POSITION, arrays).ticket
    except HandoffError as e:
        return failure(e, started)
    return {"ok": True, "id": handoff_id, "ticket": ticket, "broker": read_ticket(ticket)["b"], "t": time.time(),
            "elapsed": time.time() - started}  # fmt: skip


def pull(client: HandoffClient, command: dict) -> dict:
    want = tensors(client, command["seed"])
    started = time.time()
    try:
        got = client.pull(MODEL, command["id"], ticket=command.get("ticket"), timeout=command["timeout"]).state
    except HandoffError as e:
        return failure(e, started)
    same = sorted(got) == sorted(want) and all(
        got[n].shape == want[n].shape and got[n].tobytes() == want[n].tobytes() for n in want
    )
    return {"ok": True, "same": same, "elapsed": time.time() - started}


def push_until(client: HandoffClient, command: dict) -> dict:
    pushed, i = [], 0
    while time.time() < command["deadline"]:
        handoff_id = f"{command['prefix']}{i}"
        i += 1
        if rendezvous(command["brokers"], MODEL, handoff_id)[0] != command["broker"]:
            continue
        result = push(client, handoff_id, command["seed"])
        pushed.append(result)
        if result.get("broker") == command["broker"]:
            return {"pushed": pushed, "landed": result["t"]}
    return {"pushed": pushed, "landed": None}


def hammer(client: HandoffClient, command: dict) -> dict:
    tries = []
    while time.time() < command["deadline"]:
        ticket = command["tickets"][len(tries) % len(command["tickets"])]
        fields = read_ticket(ticket)
        started = time.time()
        try:
            client.pull(MODEL, fields["i"], ticket=ticket, timeout=command["timeout"], wait_for_push=0.05)
            tries.append({"t": started, "elapsed": time.time() - started, "error": ""})
        except HandoffError as e:
            tries.append({"t": started, **failure(e, started)})
            if type(e) is BrokerUnavailable:  # (not draining, not a lane: the broker is not there)
                time.sleep(0.05)  # (20 tries a second, as traffic: not a spin)
                continue
        return {"tries": tries, "reached": time.time()}
    return {"tries": tries, "reached": None}


def health(command: dict) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(command["target"]) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=command["service"]), timeout=2
            )
        except grpc.RpcError as e:
            return {"status": e.code().name}
    return {"status": health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}


def metric(command: dict) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(command["url"], timeout=2) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == command["name"] and all(sample.labels.get(k) == v for k, v in command["labels"].items()):
                return {"value": sample.value}
    return {"value": None}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("handoff_client").addHandler(Fallbacks())
    client = HandoffClient(sys.argv[1], refresh=0.3, shared_memory=False, timeout=10)
    ops: dict[str, Callable[[dict], dict]] = {
        "members": lambda c: {"members": client._set.brokers()},
        "push": lambda c: push(client, c["id"], c["seed"]),
        "pull": lambda c: pull(client, c),
        "push_until": lambda c: push_until(client, c),
        "hammer": lambda c: hammer(client, c),
        "health": health,
        "metric": metric,
        "fallbacks": lambda c: {"fallbacks": list(fallbacks)},
    }

    def answer(command: dict) -> None:
        try:
            result = ops[command["op"]](command)
        except Exception as e:  # noqa: BLE001 (any failure is reported to the test, not a dead worker)
            result = {"exception": f"{type(e).__name__}: {e}"}
        with lock:
            print(json.dumps({"n": command["n"], **result}), flush=True)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        threading.Thread(target=answer, args=(json.loads(line),), daemon=True).start()


if __name__ == "__main__":
    main()
