"""Nothing a client sends can wedge the broker or escape the error model: every number is bounded and finite, every
name echoed is bounded, every request that does not parse is INVALID_ARGUMENT, and a claim or a token reaches only
what it should. Each test names the defect it guards (issue "Nothing a client sends can wedge the broker"); each
failed on the main branch before its fix."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.request

import grpc
import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from grpc_health.v1 import health_pb2, health_pb2_grpc
from handoff_broker.auth import TokenTable, hash_token
from handoff_client import (
    BrokerBusy,
    CapacityExhausted,
    HandoffClient,
    HandoffError,
    HandoffExists,
    MalformedRequest,
    StaleClaim,
    UnknownTensor,
)
from handoff_client.protocol.errors import ShardLayout, from_rpc_error
from handoff_client.protocol.frames import encode_chunk
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.shards import MAX_TP_SIZE
from handoff_client.protocol.wire import identity, method_path
from support import chunk_frames, header_frame, open_channel, raises_handoff_error, raw_pull, raw_push
from test_claims import wait_until

DEMO = "demo-hybrid"


def answers_status_quickly(address: str) -> float:
    """Seconds GetStatus took (it must answer while the broker is under any load a client can make)."""
    started = time.monotonic()
    with HandoffClient(address, timeout=5) as c:
        c.status()
    return time.monotonic() - started


def test_a_pull_naming_a_tp_size_of_two_billion_is_refused_at_once(broker, client, contracts):
    """Defect 1: a PullRequest with shard.size = 2**31 made the broker plan 2**31 ranks under its lock."""
    client.push(DEMO, "r", 1, seeded_tensors(contracts[DEMO]))
    with open_channel(broker.address) as channel:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            list(raw_pull(channel, DEMO, "r", timeout=10, shard=(0, 2**31)))
    error = from_rpc_error(refused.value)
    assert isinstance(error, ShardLayout) and f"past the largest the broker takes, {MAX_TP_SIZE}" in error.message
    assert time.monotonic() - started < 2 and answers_status_quickly(broker.address) < 1
    client.pull(DEMO, "r")  # the hand-off was untouched


def test_a_ttl_that_is_not_a_finite_number_is_refused(broker, contracts):
    """Defect 5: ttl_seconds = NaN passed every comparison and made a hand-off immortal."""
    contract = contracts[DEMO]
    for ttl in (float("nan"), float("inf"), -1.0):
        header = pb.PushHeader(model=DEMO, handoff_id="r", position=1, fingerprint=contract.fingerprint,
                               ttl_seconds=ttl)  # fmt: skip
        error = raises_handoff_error(raw_push, broker.address, [pb.PushRequest(header=header).SerializeToString()])
        assert isinstance(error, MalformedRequest) and "ttl_seconds must be a finite number" in error.message
    assert broker.store.stats().receiving == 0


def test_a_huge_unknown_tensor_name_is_echoed_bounded(broker, contracts, caplog):
    """Defect 14: a 16 KiB+ unknown tensor name was echoed whole; the status overran gRPC's metadata limit
    (RESOURCE_EXHAUSTED "Stream removed") and the broker logged it whole."""
    caplog.set_level(logging.INFO)
    name = "x" * 100_000
    frames = [header_frame(contracts[DEMO], "r"), encode_chunk(name, 0, b"\0" * 16)]
    error = raises_handoff_error(raw_push, broker.address, frames)
    assert isinstance(error, UnknownTensor) and "(100000 characters)" in error.message
    assert len(error.message) <= 2048 and len(error.tensor) <= 256
    assert max(len(record.getMessage()) for record in caplog.records) < 4096
    assert_holds_nothing(broker)


def test_a_request_that_does_not_parse_is_invalid_argument_not_internal(broker):
    """Defect 14: a PullRequest whose id is not UTF-8 got a bare INTERNAL from grpcio's deserializer."""
    model = pb.PullRequest(model=DEMO).SerializeToString()
    not_utf8 = model + b"\x12\x02\xff\xfe"  # field 2 (handoff_id): two bytes that are not UTF-8
    with open_channel(broker.address) as channel:
        for method in ("PullHandoff", "CancelHandoff", "ConfirmHandoff"):
            call = (channel.unary_stream if method == "PullHandoff" else channel.unary_unary)(
                method_path(method), request_serializer=identity
            )
            with pytest.raises(grpc.RpcError) as refused:
                result = call(not_utf8, timeout=5)
                list(result) if method == "PullHandoff" else result
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, method
            assert "is not a valid" in refused.value.details()


def test_a_cancel_checks_its_id_as_a_push_does(broker, client):
    """Defect 18: CancelHandoff took any id, kept it as a tombstone for 10 minutes and logged it whole."""
    for bad in ("x" * 1_000_000, "", "tab\there"):
        error = raises_handoff_error(client.cancel, DEMO, bad)
        assert isinstance(error, MalformedRequest) and "printable characters" in error.message
    assert broker.store.stats().tombstones == 0


def test_status_lists_only_the_contracts_a_scoped_token_covers(start_broker, tmp_path):
    """Defect 19: GetStatus listed every contract to a token scoped to one model (ListContracts did not)."""
    entries = [{"name": "demo-ops", "sha256": hash_token("ops-secret"), "roles": ["admin"], "models": [DEMO]}]
    (tmp_path / "tokens.json").write_text(json.dumps({"tokens": entries}))
    broker = start_broker(tokens=TokenTable.load(tmp_path / "tokens.json"))
    with HandoffClient(broker.address, token="ops-secret") as scoped:
        assert [c.model for c in scoped.status().contracts] == [DEMO]


def test_claims_are_numbered_once_for_the_store_so_a_zombie_confirm_frees_nothing(broker, client, contracts):
    """Defect 12: claim numbers restarted at 1 for each incarnation of an id, so a late confirm from a decoder of
    an expired (here: cancelled) incarnation freed the new one."""
    first, second = seeded_tensors(contracts[DEMO], seed=1), seeded_tensors(contracts[DEMO], seed=2)
    client.push(DEMO, "r", 1, first)
    with open_channel(broker.address) as channel:
        zombie = next(m for m in raw_pull(channel, DEMO, "r") if isinstance(m, pb.PullHeader)).claim
    client.cancel(DEMO, "r")
    broker.store._h.tombstones.clear()  # the cancel's tombstone lapsed: the id may be pushed again
    client.push(DEMO, "r", 1, second)
    with open_channel(broker.address) as channel:
        claim = next(m for m in raw_pull(channel, DEMO, "r") if isinstance(m, pb.PullHeader)).claim
    assert claim != zombie
    error = raises_handoff_error(client._call, client._confirm, pb.ConfirmRequest(model=DEMO, handoff_id="r",
                                                                                  claim=zombie), 5)  # fmt: skip
    assert isinstance(error, StaleClaim)
    assert_same_bits(client.pull(DEMO, "r").state, second)  # the new incarnation was delivered
    assert_holds_nothing(broker)


def test_a_puller_gone_before_its_claim_is_granted_leaves_the_hand_off_free(broker, contracts):
    """Defect 8: a claim granted to a caller already gone was held for the stall timeout (its release callback
    was never registered), and the in-flight pull gauge never came down."""
    tensors = seeded_tensors(contracts[DEMO])
    with HandoffClient(broker.address, timeout=20) as client:
        for attempt in range(5):
            handoff_id = f"r{attempt}"
            with open_channel(broker.address) as channel:
                waiting = raw_pull(channel, DEMO, handoff_id, timeout=30)  # waits for the push ...
                threading.Timer(0.3, waiting.cancel).start()  # ... and goes away
                pushing = threading.Thread(target=client.push, args=(DEMO, handoff_id, 1, tensors))
                time.sleep(0.3)
                pushing.start()
                with pytest.raises(grpc.RpcError):
                    list(waiting)
                pushing.join()
            started = time.monotonic()
            assert_same_bits(client.pull(DEMO, handoff_id, timeout=5).state, tensors)  # not after a 30 s lease
            assert time.monotonic() - started < 3
    deadline = time.monotonic() + 5
    while broker.registry.get_sample_value("handoff_streams_in_flight", {"kind": "pull"}) and time.monotonic() < 9e9:
        assert time.monotonic() < deadline, "a pull stream is still counted in flight"
        time.sleep(0.05)
    assert_holds_nothing(broker)


# -- limits: waiting and silent calls cannot take the threads the work they wait for needs --------------------------


def health_answers(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_pulls_waiting_for_their_pushes_leave_threads_for_the_pushes_health_and_status(start_broker, contracts):
    """Defect 2: with --workers 8, eight pulls waiting for pushes held every thread; the pushes they waited for,
    health and status queued behind them until everything timed out."""
    broker = start_broker(workers=8)
    waiting_budget = broker.admission.waiting.limit
    outcomes: dict[int, object] = {}
    tensors = seeded_tensors(contracts[DEMO])

    def pull(i: int) -> None:
        with open_channel(broker.address) as channel:
            try:
                outcomes[i] = [m for m in raw_pull(channel, DEMO, f"p{i}", timeout=20)]
            except grpc.RpcError as e:
                outcomes[i] = from_rpc_error(e)

    pullers = [threading.Thread(target=pull, args=(i,)) for i in range(8)]
    for t in pullers:
        t.start()
    time.sleep(0.5)
    assert health_answers(broker.address) and answers_status_quickly(broker.address) < 1
    busy = [i for i, o in outcomes.items() if isinstance(o, BrokerBusy)]
    assert len(busy) == 8 - waiting_budget  # refused at once, not queued: the client retries BROKER_BUSY
    with HandoffClient(broker.address, timeout=5) as client:
        for i in sorted(set(range(8)) - set(busy)):
            client.push(DEMO, f"p{i}", 1, tensors)  # the pushes the waiting pulls wait for get through
    for t in pullers:
        t.join(10)
    delivered = [i for i, o in outcomes.items() if isinstance(o, list)]
    assert len(delivered) == waiting_budget and broker.store.stats().claimed == waiting_budget


def test_audit_reads_waiting_for_their_pushes_are_held_to_the_waiting_budget_too(start_broker, contracts):
    """Audit reads of hand-offs not yet committed wait as pulls do, so past the waiting budget they are refused at
    once (BROKER_BUSY) rather than holding every stream slot and thread until their deadline."""
    broker = start_broker(workers=8)
    waiting_budget = broker.admission.waiting.limit
    outcomes: dict[int, object] = {}

    def read(i: int) -> None:
        with open_channel(broker.address) as channel:
            try:
                outcomes[i] = list(raw_pull(channel, DEMO, f"never{i}", timeout=3, audit=True))
            except grpc.RpcError as e:
                outcomes[i] = from_rpc_error(e)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for t in readers:
        t.start()
    time.sleep(0.5)
    assert health_answers(broker.address) and answers_status_quickly(broker.address) < 1
    busy = [i for i, o in outcomes.items() if isinstance(o, BrokerBusy)]
    assert len(busy) == 8 - waiting_budget, outcomes
    for t in readers:
        t.join(10)
    assert broker.admission.waiting.taken == 0


def test_silent_push_streams_are_ended_and_cannot_take_the_last_threads(start_broker, contracts):
    """Defect 3: a push stream that never sent its header (or a repeat push's header, then silence) pinned a thread
    forever; with --workers 2, two such streams left health at DEADLINE_EXCEEDED."""
    broker = start_broker(workers=2, idle_timeout=1.0)
    silence = threading.Event()

    def silent():
        silence.wait(30)
        yield from ()

    with open_channel(broker.address) as channel:
        push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity)
        started = time.monotonic()
        calls = [push.future(silent(), timeout=30) for _ in range(2)]
        time.sleep(0.3)
        assert health_answers(broker.address) and answers_status_quickly(broker.address) < 1
        errors = [from_rpc_error(call.exception(timeout=10)) for call in calls]
        silence.set()
    assert sorted(type(e).__name__ for e in errors) == ["BrokerBusy", "CallCancelled"]  # one refused, one ended
    assert time.monotonic() - started < 5  # at --idle-timeout, not at the caller's 30 s
    with HandoffClient(broker.address, timeout=5) as client:
        client.push(DEMO, "r", 1, seeded_tensors(contracts[DEMO]))
        client.pull(DEMO, "r")
    assert broker.admission.streams.taken == 0


def test_pushes_waiting_for_room_are_bounded(start_broker, contracts):
    """Defect 17: any number of pushes could wait for room, each holding what gRPC had buffered of its stream
    (100 waiting pushes: RSS 95 -> 495 MiB). Past the waiting budget a push short of room is refused at once."""
    contract = contracts[DEMO]
    broker = start_broker(workers=8, max_bytes=contract.nbytes)
    budget = broker.admission.waiting.limit
    tensors = seeded_tensors(contract)
    with HandoffClient(broker.address, timeout=20) as client:
        client.push(DEMO, "full", 1, tensors)  # the broker is full
        outcomes: list[object] = []

        def push(i: int) -> None:
            try:
                outcomes.append(raw_push(broker.address, [header_frame(contract, f"w{i}")], timeout=3))
            except HandoffError as e:
                outcomes.append(e)

        pushers = [threading.Thread(target=push, args=(i,)) for i in range(budget + 3)]
        for t in pushers:
            t.start()
        time.sleep(0.5)
        refused_at_once = [o for o in outcomes if isinstance(o, CapacityExhausted)]
        assert len(refused_at_once) == 3 and broker.admission.waiting.taken == budget
        assert health_answers(broker.address)
        for t in pushers:
            t.join(10)
        client.pull(DEMO, "full")
    assert_holds_nothing(broker)


def test_a_steady_reader_slower_than_a_batch_per_lease_is_not_revoked(start_broker, contracts):
    """Defect 10: a pull's activity was recorded once per batch of 256 chunks, so any reader that took longer than
    the stall timeout (the lease) over a batch was revoked as stalled, however steadily it read."""
    contract = contracts[DEMO]
    broker = start_broker(lease=1.0)
    tensors = seeded_tensors(contract)
    raw_push(broker.address, [header_frame(contract, "r"), *chunk_frames(contract, tensors, 8192)])
    slow = grpc.insecure_channel(
        broker.address, options=[("grpc.http2.bdp_probe", 0)]
    )  # a 64 KiB window: no read-ahead
    try:
        received = []
        started = time.monotonic()
        for message in raw_pull(slow, DEMO, "r", timeout=30):
            received.append(message)
            time.sleep(0.006)  # 8 KiB each 6 ms: 256 chunks take 1.5 s, past the 1 s lease
    finally:
        slow.close()
    assert isinstance(received[-1], pb.PullEnd) and time.monotonic() - started > 2 * broker.config.lease
    assert broker.store.stats().claimed == 1  # still this reader's: not revoked


def test_a_puller_that_confirms_then_stops_reading_has_its_stream_ended(start_broker, contracts):
    """Defect 4: a confirm freed the entry while its pull handler, blocked sending to a reader that had stopped,
    kept its thread and the chunks it held (two such pulls: 0 MiB accounted, 586 MiB RSS)."""
    contract = contracts[DEMO]
    broker = start_broker()
    raw_push(broker.address, [header_frame(contract, "r"), *chunk_frames(contract, seeded_tensors(contract), 65536)])
    stalled = grpc.insecure_channel(broker.address, options=[("grpc.http2.bdp_probe", 0)])  # a 64 KiB window
    try:
        stream = raw_pull(stalled, DEMO, "r", timeout=30)
        header = next(stream)
        next(stream)  # one chunk read; the rest wait on flow control
        with HandoffClient(broker.address) as client:
            client._call(client._confirm, pb.ConfirmRequest(model=DEMO, handoff_id="r", claim=header.claim), 5)
        deadline = time.monotonic() + 3
        in_flight = lambda: broker.registry.get_sample_value("handoff_streams_in_flight", {"kind": "pull"})
        while broker.admission.streams.taken or in_flight():  # (the call's end callbacks run one after another)
            assert time.monotonic() < deadline, "the confirmed pull's stream still holds its thread"
            time.sleep(0.05)
    finally:
        stalled.close()
    assert_holds_nothing(broker)


def test_tiny_chunks_cannot_hold_memory_past_what_max_bytes_counts(start_broker, contracts):
    """Defect 6: 1-byte chunks held ~800x the bytes `--max-bytes` counts (512 KiB accounted, RSS 63 -> 457 MiB):
    each stored chunk costs ~400 bytes beside its data. The store holds at most max_bytes / 4096 chunks (8,192 at
    least), so that overhead stays a bounded fraction of `--max-bytes`."""
    contract = contracts[DEMO]
    broker = start_broker(max_bytes=8 << 20)
    budget = broker.store.config.max_chunks
    memory = next(c for c in contract.carried if c.name.endswith("memory"))
    frames = [header_frame(contract, "r")] + [encode_chunk(memory.name, i, b"\1") for i in range(budget + 10)]
    error = raises_handoff_error(raw_push, broker.address, frames, timeout=60)
    assert isinstance(error, CapacityExhausted) and f"of {budget} free" in error.message
    assert "send chunks of 4096+ bytes" in error.message
    assert_holds_nothing(broker)
    with HandoffClient(broker.address) as client:  # the chunk budget came back with the refused push
        client.push(DEMO, "ok", 1, seeded_tensors(contract))
        client.pull(DEMO, "ok")


def test_half_sent_metrics_requests_cannot_pile_up_threads(start_broker):
    """Defect 13: /metrics started a thread per connection with no timeout: 500 half-sent requests, 500 threads
    that stayed. Now at most 8 are served at once (more are closed) and a silent one is dropped after 5 s."""
    broker = start_broker(metrics_port=0)
    url = f"http://127.0.0.1:{broker.metrics_port}/metrics"
    before = threading.active_count()
    sockets = []
    try:
        for _ in range(100):
            sock = socket.create_connection(("127.0.0.1", broker.metrics_port))
            sock.sendall(b"GET /metr")  # and nothing more
            sockets.append(sock)
        time.sleep(0.5)
        assert threading.active_count() - before <= 8
        deadline = time.monotonic() + 10
        while True:  # the silent ones are dropped after the timeout; scrapes are served again
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    assert b"handoff_resident_bytes" in response.read()
                break
            except OSError:
                assert time.monotonic() < deadline, "scrapes were never served again"
                time.sleep(0.5)
    finally:
        for sock in sockets:
            sock.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before:
        assert time.monotonic() < deadline, f"{threading.active_count() - before} metrics threads stayed"
        time.sleep(0.1)


def test_a_push_whose_caller_died_waiting_for_room_never_replaces_its_live_retry(start_broker, contracts):
    """Defect 16: at capacity, a push whose prefill died while it waited for room did not notice; when room came it
    could begin after the live retry and replace it (the retry cancelled, the hand-off lost: 4-7 of 12 tries). A
    waiting caller that is gone takes no room, and an older push never replaces a newer one."""
    contract = contracts[DEMO]
    broker = start_broker(max_bytes=contract.nbytes)
    with HandoffClient(broker.address, timeout=20) as client:
        for attempt in range(4):
            client.push(DEMO, f"full{attempt}", 1, seeded_tensors(contract, seed=attempt))  # the broker is full
            gone = threading.Event()

            def dead_prefill(handoff_id: str, gone: threading.Event):
                yield header_frame(contract, handoff_id)
                gone.wait(30)

            with open_channel(broker.address) as channel:
                push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity)
                dying = push.future(dead_prefill(f"x{attempt}", gone), timeout=30)
                wait_until(lambda: broker.admission.waiting.taken == 1)  # it waits for room ...
                dying.cancel()  # ... and its prefill dies
            retry = seeded_tensors(contract, seed=100 + attempt)
            retrying = threading.Thread(target=client.push, args=(DEMO, f"x{attempt}", 1, retry))
            retrying.start()
            wait_until(lambda: broker.admission.waiting.taken >= 1)
            client.pull(DEMO, f"full{attempt}")  # room comes
            retrying.join(20)
            gone.set()
            assert_same_bits(client.pull(DEMO, f"x{attempt}", timeout=5).state, retry)
    assert_holds_nothing(broker)


def test_a_repeat_of_a_delivered_hand_off_at_another_position_is_refused(broker, client, contracts):
    """Suspected in the issue, confirmed: a push repeating a hand-off already delivered was checked against its
    tombstone's digest only, so the same bytes at another position passed as a harmless repeat."""
    tensors = seeded_tensors(contracts["every-dtype"])  # no cache rows: the same bytes at any position
    client.push("every-dtype", "r", 1, tensors)
    client.pull("every-dtype", "r")
    assert client.push("every-dtype", "r", 1, tensors).duplicate  # the same push again: recognised
    error = raises_handoff_error(client.push, "every-dtype", "r", 2, tensors)
    assert isinstance(error, HandoffExists) and "was delivered at position 1, not 2" in error.message
