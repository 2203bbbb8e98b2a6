"""What a lane's opening may make the broker hold (docs/lanes.md, "What a call may hold"): a worker thread waiting for
a lane is let go the moment its call ends, and its admission slot with it, not before; an idle connection to the
lane port holds one of the openings only for a while and never starves a call's own; a lane that cannot open is given
up by both sides within the opening deadline, the call going on the stream.

Each test runs a real broker on loopback, with a long --idle-timeout (30 s), so that a call waiting it out shows.
"""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from grpc_health.v1 import health_pb2, health_pb2_grpc
from handoff_broker.lanes import MAX_OPENINGS
from handoff_client import HandoffClient
from handoff_client.protocol.lane import OPENING_TIMEOUT, new_capability
from handoff_client.protocol.messages import handoff_pb2 as pb
from lane_wire import LARGE, TCP_ONLY, pull_call
from support import open_channel

IDLE = 30.0  # the brokers' --idle-timeout: what a call that waits it out would take
PROMPT = 1.0  # what health and status must answer within


def health_answers(address: str) -> bool:
    with open_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=PROMPT)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def threads_waiting_on_a_lane() -> list[str]:
    """The threads of this process (the broker's among them) asleep in a call's wait for its lane."""
    waiting = []
    for ident, frame in sys._current_frames().items():
        stack = frame
        while stack is not None:
            if stack.f_code.co_name == "open" and stack.f_code.co_filename.endswith("lane_calls.py"):
                waiting.append(str(ident))
                break
            stack = stack.f_back
    return waiting


def settles(condition, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_pull_cancelled_while_its_broker_waits_for_its_lane_lets_the_thread_go_at_once(start_broker):
    """A decoder that reads a pull's header, which offers a lane, then cancels, again and again: each pull's handler
    is woken as its call ends, so the broker's few worker threads are never all asleep on lanes nobody will open.
    Health, status and a push on the stream answer promptly throughout, and nothing is left held. (Each handler
    once slept --idle-timeout, its admission slot given back meanwhile: with 8 workers, health stopped answering.)"""
    broker = start_broker(contracts={"large": LARGE}, workers=8, idle_timeout=IDLE, max_bytes=64 << 20, **TCP_ONLY)
    tensors = seeded_tensors(LARGE)
    with HandoffClient(broker.address, timeout=10) as client:
        client.push("large", "r", 1, tensors)
        for cycle in range(3 * broker.config.workers):
            started = time.monotonic()
            stream = pull_call(broker.address, "r", new_capability())
            assert next(stream).HasField("lane")
            stream.close()  # the decoder is gone: its call is cancelled, its lane never opened
            assert health_answers(broker.address)
            client.status(timeout=PROMPT)
            assert time.monotonic() - started < 3 * PROMPT, f"cycle {cycle} took {time.monotonic() - started:.1f} s"
        started = time.monotonic()
        client.push("large", "other", 1, tensors, timeout=5)
        assert time.monotonic() - started < 3 * PROMPT
        assert settles(lambda: not threads_waiting_on_a_lane()), threads_waiting_on_a_lane()
        assert settles(lambda: broker.admission.streams.taken == 0)
        assert broker.registry.get_sample_value("handoff_streams_in_flight", {"kind": "pull"}) == 0
        assert_same_bits(client.pull("large", "r").state, tensors)
        assert_same_bits(client.pull("large", "other").state, tensors)
    assert_holds_nothing(broker)


def idle_connections(port: int, count: int, host: str = "127.0.0.1") -> list[socket.socket]:
    """Connections to the lane port that never send a byte: no TLS, no token, no opening."""
    return [socket.create_connection((host, port), timeout=10) for _ in range(count)]


def closed_by_the_broker(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_connections_to_the_lane_port_never_keep_a_calls_lane_out_and_are_closed_past_the_opening_deadline(
    start_broker,
):
    """More idle connections than the broker reads openings at once (MAX_OPENINGS): a call's own connection, which
    presents its opening as it connects, takes the place of one of them, so pushes and pulls on both lanes keep their
    lane and take well under --idle-timeout; each idle one is closed once the opening deadline has passed. (The
    listener once closed every connection past the 64th unread, and each call then waited out --idle-timeout.)"""
    broker = start_broker(contracts={"large": LARGE}, idle_timeout=IDLE, max_bytes=128 << 20,
                          shared_memory_lane_min_bytes=1)  # fmt: skip
    tensors = seeded_tensors(LARGE)
    with HandoffClient(broker.address, shared_memory=False) as tcp, HandoffClient(broker.address) as shm:
        assert tcp.lane().kind == pb.LANE_KIND_TCP and shm.lane().kind == pb.LANE_KIND_SHM
        idle = idle_connections(tcp.lane().port, MAX_OPENINGS + 16)
        opened = time.monotonic()
        try:
            for client, handoff_id in ((tcp, "tcp"), (shm, "shm"), (tcp, "tcp-again")):
                started = time.monotonic()
                client.push("large", handoff_id, 1, tensors)
                assert_same_bits(client.pull("large", handoff_id).state, tensors)
                assert time.monotonic() - started < 3, f"{handoff_id}: {time.monotonic() - started:.1f} s"
            for sock in idle:
                sock.settimeout(max(0.1, opened + OPENING_TIMEOUT + 2 - time.monotonic()))
                assert closed_by_the_broker(sock)
        finally:
            for sock in idle:
                sock.close()
    for kind, lane, moved in (("push", "tcp", 2), ("pull", "tcp", 2), ("push", "shm", 1), ("pull", "shm", 1)):
        labels = {"model": "large", "kind": kind, "lane": lane}
        assert broker.registry.get_sample_value("handoff_lane_bytes_total", labels) == moved * LARGE.nbytes
    assert_holds_nothing(broker)


def test_a_lane_that_cannot_open_is_given_up_by_both_sides_within_the_opening_deadline(start_broker, caplog):
    """The lane's advertised address leads to a listener that accepts nothing and answers nothing (a proxy or a load
    balancer that holds the connection, say): no READY ever comes. The push's broker gives its lane up at the opening
    deadline, the pull's client as well, and each call goes on the stream at once, well under --idle-timeout."""
    broker = start_broker(contracts={"large": LARGE}, idle_timeout=IDLE, lane_advertise_host="127.0.0.3", **TCP_ONLY)
    tensors = seeded_tensors(LARGE)
    with HandoffClient(broker.address, timeout=IDLE) as client:
        silent = socket.create_server(("127.0.0.3", client.lane().port))  # connections wait in its backlog, unread
        try:
            for call in (lambda: client.push("large", "r", 1, tensors), lambda: client.pull("large", "r")):
                started = time.monotonic()
                result = call()
                assert OPENING_TIMEOUT - 1 < time.monotonic() - started < OPENING_TIMEOUT + 3
        finally:
            silent.close()
        assert_same_bits(result.state, tensors)
    fallbacks = [r.getMessage() for r in caplog.records if getattr(r, "lane_fallback", False)]
    assert len(fallbacks) == 2, fallbacks
    assert_holds_nothing(broker)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_broker_out_of_descriptors_rests_its_lane_listener_instead_of_spinning(tmp_path):
    """A broker process whose descriptors run out (its limit lowered to what it holds, plus a few) while connections
    wait in the lane port's backlog: accept fails with EMFILE and the listener stays readable. It rests, as gRPC's
    listener does, and the broker uses little CPU meanwhile; it still answers once descriptors are free again. (The
    listener once retried at once: 1.7-2.9 s of CPU a 3 s.)"""
    command = [sys.executable, "-m", "handoff_broker", "--log-level", "ERROR", "serve", "--port", "0",
               "--metrics-port", "-1", "--no-shared-memory-lane", "--idle-timeout", str(IDLE)]  # fmt: skip
    broker = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    idle: list[socket.socket] = []
    try:
        address = re.match(r"handoff-broker listening on (\S+);", broker.stdout.readline()).group(1)
        with HandoffClient(address, timeout=10) as client:
            port = client.lane().port
        held = len(os.listdir(f"/proc/{broker.pid}/fd"))
        soft, hard = resource.prlimit(broker.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(broker.pid, resource.RLIMIT_NOFILE, (held + 4, hard))
        idle = idle_connections(port, 32)  # (the kernel completes each; the broker can accept 4)
        time.sleep(0.5)
        before = cpu_seconds(broker.pid)
        time.sleep(2.0)
        used = cpu_seconds(broker.pid) - before
        assert used < 0.3, f"the broker used {used:.2f} s of CPU in 2 s, out of descriptors"
        for sock in idle:
            sock.close()
        resource.prlimit(broker.pid, resource.RLIMIT_NOFILE, (soft, hard))
        with HandoffClient(address, timeout=10) as client:
            assert client.status().max_bytes > 0
    finally:
        for sock in idle:
            sock.close()
        broker.terminate()
        broker.wait(timeout=30)


def test_a_pipelined_pull_whose_lane_cannot_be_reached_goes_on_the_stream_within_the_same_call(start_broker, caplog):
    """`pull_tensors` (the vLLM connector's pull) from a client that cannot reach the broker's TCP lane: the pull is
    made again on the stream within the same call, naming its claim, and yields every tensor, instead of failing
    (which cost the connector a recompute of the prompt)."""
    broker = start_broker(contracts={"large": LARGE}, idle_timeout=IDLE, lane_advertise_host="127.0.0.2", **TCP_ONLY)
    tensors = seeded_tensors(LARGE)
    with HandoffClient(broker.address, lanes=False) as pusher, HandoffClient(broker.address) as puller:
        pusher.push("large", "r", 1, tensors)
        started = time.monotonic()
        pulled = puller.pull_tensors("large", "r", timeout=IDLE)
        got = {carried.name: array.copy() for carried, array in pulled}
        assert time.monotonic() - started < 3
        assert pulled.left_its_lane
        assert_same_bits(got, tensors)
        assert_same_bits(pulled.handoff.state, tensors)
    fallbacks = [r.getMessage() for r in caplog.records if getattr(r, "lane_fallback", False)]
    assert len(fallbacks) == 1 and "127.0.0.2" in fallbacks[0], fallbacks
    assert_holds_nothing(broker)


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""  # (nothing is ever sent to an opening: data here would be a bug)
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False


def test_a_source_flooding_the_lane_port_takes_only_its_own_openings_places(start_broker):
    """A few idle connections from one address, then a flood from another, past the 64 openings the broker reads at
    once: each newcomer takes the place of the flooding source's oldest, so the other source keeps its own until
    the opening deadline. No source holds more than its share of the openings."""
    broker = start_broker(contracts={"large": LARGE}, idle_timeout=IDLE, **TCP_ONLY)
    with HandoffClient(broker.address) as client:
        port = client.lane().port
    few = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.4", 0)) for _ in range(8)]
    flood = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.3", 0)) for _ in range(80)]
    try:
        assert settles(lambda: sum(not still_open(s) for s in flood) >= len(few) + len(flood) - MAX_OPENINGS)
        assert all(still_open(s) for s in few)
    finally:
        for sock in few + flood:
            sock.close()
