"""A hand-off's whole life under faults: bounded memory, expiry, cancel, stalls, drain, retries, pipelining.

Every timeout here is short and passed as a flag, so the suite stays fast.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from handoff_client import (
    AlreadyClaimed,
    BrokerUnavailable,
    CallCancelled,
    CapacityExhausted,
    HandoffCancelled,
    HandoffClient,
    HandoffError,
    HandoffGone,
    PushAborted,
    WaitTimedOut,
)
from handoff_client._client import retryable_pull, retryable_push
from handoff_client.protocol import errors
from handoff_client.protocol.frames import decode_chunk, encode_chunk
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import identity, method_path
from proxy import Proxy
from support import broker_holds, chunk_frames, header_frame, open_channel, raises_handoff_error, raw_pull, raw_push
from test_claims import wait_until

EVERY_PATH = True  # each test on the gRPC streams, the TCP lane and the shared-memory lane (conftest.PATHS)
DEMO = "demo-hybrid"  # 4,334,592 bytes a hand-off


def push_in_thread(target: str, frames: Iterator[bytes]) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["response"] = raw_push(target, frames, timeout=30)
        except HandoffError as e:
            outcome["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def gated(frames: list[bytes], gate: threading.Event, after: int) -> Iterator[bytes]:
    """The frames, holding back all but the first `after` until `gate` opens."""
    yield from frames[:after]
    gate.wait(30)
    yield from frames[after:]


# -- memory is bounded ----------------------------------------------------------------------------------------------


def test_a_push_that_does_not_fit_fails_at_once_when_asked_not_to_wait(start_broker, contracts):
    nbytes = contracts[DEMO].nbytes
    broker = start_broker(max_bytes=nbytes + nbytes // 2)
    with HandoffClient(broker.address) as client:
        tensors = seeded_tensors(contracts[DEMO])
        client.push(DEMO, "first", 1, tensors)
        error = raises_handoff_error(client.push, DEMO, "second", 1, tensors, wait_for_room=False)
        assert isinstance(error, CapacityExhausted) and error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (
            error.message
            == f"{DEMO}: the hand-off needs {nbytes} bytes and the broker has {nbytes // 2} of {nbytes * 3 // 2} free"
        )
        assert broker.store.stats().resident_bytes == nbytes  # no byte of the refused push was accepted
        client.pull(DEMO, "first")
        assert_holds_nothing(broker)


def test_a_refusal_for_capacity_says_when_to_retry(start_broker, contracts):
    broker = start_broker(max_bytes=1000)
    frames = [header_frame(contracts[DEMO], "r")]
    with open_channel(broker.address) as channel:
        push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity)
        with pytest.raises(grpc.RpcError) as e:
            push(iter(frames), timeout=5)
    status = rpc_status.from_call(e.value)
    kinds = [d.type_url.rsplit("/", 1)[1] for d in status.details]
    assert kinds == ["google.rpc.ErrorInfo", "google.rpc.RetryInfo"]
    retry = error_details_pb2.RetryInfo()
    status.details[1].Unpack(retry)
    assert retry.retry_delay.ToNanoseconds() == 1_000_000_000
    assert "more than it can ever hold: raise --max-bytes" in status.message


def test_a_push_that_does_not_fit_waits_for_room(start_broker, contracts):
    nbytes = contracts[DEMO].nbytes
    broker = start_broker(max_bytes=nbytes)
    with HandoffClient(broker.address) as client:
        tensors = seeded_tensors(contracts[DEMO])
        client.push(DEMO, "first", 1, tensors)
        waiting = threading.Thread(target=client.push, args=(DEMO, "second", 1, tensors), kwargs={"timeout": 20})
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive() and broker.store.stats().receiving == 0
        client.pull(DEMO, "first")  # frees room
        waiting.join(20)
        assert_same_bits(client.pull(DEMO, "second").state, tensors)


def test_many_concurrent_pushes_never_pass_the_bound(start_broker, contracts):
    nbytes = contracts[DEMO].nbytes
    broker = start_broker(max_bytes=2 * nbytes + 1)
    tensors = seeded_tensors(contracts[DEMO])
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], broker.store.stats().resident_bytes)

    def push(i: int) -> None:
        with HandoffClient(broker.address) as c:
            c.push(DEMO, f"r{i}", 1, tensors, timeout=30)

    pulled = []

    def pull(i: int) -> None:
        with HandoffClient(broker.address) as c:
            pulled.append(c.pull(DEMO, f"r{i}", timeout=30))

    threads = [threading.Thread(target=watch)]
    threads += [threading.Thread(target=f, args=(i,)) for i in range(8) for f in (push, pull)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(60)
    done.set()
    threads[0].join()
    assert 0 < peak[0] <= 2 * nbytes
    assert len(pulled) == 8
    for handoff in pulled:
        assert_same_bits(handoff.state, tensors)
    assert_holds_nothing(broker)


# -- nothing lingers --------------------------------------------------------------------------------------------------


def test_an_unclaimed_hand_off_expires_and_a_late_pull_hears_expired(start_broker, contracts):
    broker = start_broker(ttl=0.3)
    with HandoffClient(broker.address) as client:
        client.push(DEMO, "r", 1, seeded_tensors(contracts[DEMO]))
        wait_until(lambda: broker.store.stats().ready == 0)
        assert_holds_nothing(broker)
        error = raises_handoff_error(client.pull, DEMO, "r", timeout=2)
        assert isinstance(error, HandoffGone) and error.code is grpc.StatusCode.NOT_FOUND
        assert error.message == f"{DEMO}: hand-off `r` expired before any decode worker claimed it"


def test_a_push_may_ask_for_a_shorter_ttl(broker, client, contracts):
    client.push(DEMO, "short", 1, seeded_tensors(contracts[DEMO]), ttl=0.3)
    client.push(DEMO, "long", 1, seeded_tensors(contracts[DEMO]))
    wait_until(lambda: broker.store.stats().ready == 1)
    assert isinstance(raises_handoff_error(client.pull, DEMO, "short", timeout=1), HandoffGone)
    client.pull(DEMO, "long")


def test_cancel_frees_a_hand_off_that_waits_and_refuses_its_pull_and_a_late_push(broker, client, contracts):
    tensors = seeded_tensors(contracts[DEMO])
    client.push(DEMO, "r", 1, tensors)
    assert client.cancel(DEMO, "r") is True
    assert_holds_nothing(broker)
    error = raises_handoff_error(client.pull, DEMO, "r", timeout=2)
    assert isinstance(error, HandoffCancelled) and error.code is grpc.StatusCode.CANCELLED
    error = raises_handoff_error(client.push, DEMO, "r", 1, tensors)
    assert isinstance(error, HandoffGone) and "was cancelled; push it under a new id" in error.message
    assert client.cancel(DEMO, "never-pushed") is False
    assert isinstance(raises_handoff_error(client.push, DEMO, "never-pushed", 1, tensors), HandoffGone)


def test_cancel_interrupts_a_push_in_flight(broker, client, contracts):
    gate = threading.Event()
    frames = [
        header_frame(contracts[DEMO], "r"),
        *chunk_frames(contracts[DEMO], seeded_tensors(contracts[DEMO]), 1 << 16),
    ]
    thread, outcome = push_in_thread(broker.address, gated(frames, gate, after=5))
    wait_until(lambda: broker.store.stats().receiving == 1)
    assert client.cancel(DEMO, "r") is True
    thread.join(10)
    gate.set()
    assert isinstance(outcome["error"], CallCancelled)
    assert_holds_nothing(broker)


def test_cancel_interrupts_a_puller_in_flight_and_one_still_waiting(broker, client, contracts):
    client.push("wide-attention", "big", 1, seeded_tensors(contracts["wide-attention"]))
    with open_channel(broker.address) as channel:
        stream = raw_pull(channel, "wide-attention", "big")
        next(stream)
        waiting = threading.Thread(
            target=lambda: outcome.update(e=raises_handoff_error(client.pull, DEMO, "later", timeout=10))
        )
        outcome: dict = {}
        waiting.start()
        time.sleep(0.2)
        assert client.cancel("wide-attention", "big") and not client.cancel(DEMO, "later")
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() is grpc.StatusCode.CANCELLED
        waiting.join(10)
        assert isinstance(outcome["e"], HandoffCancelled)
    assert_holds_nothing(broker)


def test_a_puller_that_stops_reading_loses_its_claim_after_the_lease(start_broker, contracts):
    broker = start_broker(lease=0.5)
    tensors = seeded_tensors(contracts["wide-attention"])
    with HandoffClient(broker.address) as client, open_channel(broker.address) as channel:
        client.push("wide-attention", "r", 1, tensors)
        stream = raw_pull(channel, "wide-attention", "r")
        next(stream)  # then read no more: flow control holds the broker's stream
        with pytest.raises(AlreadyClaimed):
            client.pull("wide-attention", "r", timeout=0.2)
        wait_until(lambda: broker.store.stats().ready == 1, timeout=5)
        assert_same_bits(client.pull("wide-attention", "r").state, tensors)
        with pytest.raises(grpc.RpcError):
            list(stream)  # the stalled stream was cut
    assert_holds_nothing(broker)


def test_a_push_that_sends_nothing_is_aborted_after_the_idle_timeout(start_broker, contracts):
    broker = start_broker(idle_timeout=0.4)
    gate = threading.Event()
    thread, outcome = push_in_thread(broker.address, gated([header_frame(contracts[DEMO], "r")], gate, after=1))
    wait_until(lambda: broker.store.stats().receiving == 1)
    thread.join(10)
    gate.set()
    assert isinstance(outcome["error"], CallCancelled)
    wait_until(lambda: broker.store.stats().receiving == 0)  # (the call may be ended a moment before its entry)
    assert_holds_nothing(broker)


def test_drain_refuses_new_work_and_hands_over_what_it_holds_before_it_stops(start_broker, contracts):
    broker = start_broker()
    tensors = seeded_tensors(contracts["wide-attention"])
    unclaimed = seeded_tensors(contracts[DEMO])
    with HandoffClient(broker.address) as client, open_channel(broker.address) as channel:
        client.push("wide-attention", "r", 1, tensors)
        client.push(DEMO, "unclaimed", 1, unclaimed)
        client.push(DEMO, "left-behind", 1, unclaimed)
        stream = raw_pull(channel, "wide-attention", "r")
        header = next(stream)
        stopping = threading.Thread(target=lambda: result.update(stats=broker.stop(grace=3)))
        result: dict = {}
        stopping.start()
        health = health_pb2_grpc.HealthStub(channel)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == not_serving)
        error = raises_handoff_error(client.push, DEMO, "new", 1, unclaimed)
        assert isinstance(error, BrokerUnavailable) and error.reason == "DRAINING"
        error = raises_handoff_error(client.pull, DEMO, "not-here", timeout=2)
        assert isinstance(error, BrokerUnavailable) and error.reason == "DRAINING"  # go to another broker
        assert_same_bits(client.pull(DEMO, "unclaimed").state, unclaimed)  # what it holds is still handed over
        messages = list(stream)  # the stream in flight runs to its end ...
        assert isinstance(messages[-1], pb.PullEnd)
        client._confirm_claim("wide-attention", "r", header.claim, 5)  # ... and its decoder can still confirm
        stopping.join(15)
    stats = result["stats"]
    assert (stats.ready, stats.claimed, stats.receiving) == (1, 0, 0)  # nobody came for it: counted at the end


# -- retries ------------------------------------------------------------------------------------------------------


def test_what_the_client_retries_is_exactly_what_is_safe():
    kinds = {
        cls: cls._rebuild("x", {})
        for cls in [
            *errors.BY_REASON.values(),
            errors.BrokerUnavailable,
            errors.CallCancelled,
            errors.DeadlineExceeded,
        ]
    }
    assert {cls for cls, e in kinds.items() if retryable_push(e)} == {
        errors.BrokerUnavailable,
        errors.BrokerBusy,
        errors.LaneBroken,  # the retry goes on the stream
    }
    assert {cls for cls, e in kinds.items() if retryable_pull(e)} == {
        errors.BrokerUnavailable,
        errors.BrokerBusy,
        errors.LaneBroken,
        errors.CallCancelled,
        errors.PushAborted,
    }


def test_a_push_whose_connection_breaks_is_retried_and_lands_once(broker, contracts):
    proxy = Proxy(broker.port)
    try:
        proxy.cut_after(1_000_000)  # the first connection dies a quarter of the way through the push
        tensors = seeded_tensors(contracts[DEMO], seed=4)
        with HandoffClient(proxy.address, lanes=False) as client:  # (the lane's own breaks: test_lanes.py)
            result = client.push(DEMO, "r", 1, tensors)
        assert proxy.connections == 2 and not result.duplicate
        with HandoffClient(broker.address) as client:
            assert_same_bits(client.pull(DEMO, "r").state, tensors)
        assert_holds_nothing(broker)
    finally:
        proxy.close()


def test_a_resumable_push_whose_connection_breaks_sends_only_the_rest(broker, contracts):
    contract = contracts[DEMO]
    proxy = Proxy(broker.port)
    try:
        proxy.cut_after(2_500_000, once=broker_holds(broker.address, DEMO, "r", 2_000_000))  # short of the 4.3 MB
        tensors = seeded_tensors(contract, seed=12)
        with HandoffClient(proxy.address, chunk_bytes=256 << 10, lanes=False) as client:
            result = client.push(DEMO, "r", 1, tensors, resumable=True)
        assert proxy.connections == 2 and not result.duplicate
        assert proxy.carried[1] < contract.nbytes - 1_000_000  # the retry did not send it all again
        with HandoffClient(broker.address) as client:
            assert_same_bits(client.pull(DEMO, "r").state, tensors)
        assert_holds_nothing(broker)
    finally:
        proxy.close()


def break_a_resumable_push(broker, client, channel, contract, tensors, gate, after: int) -> list[bytes]:
    """A resumable push of `r` whose stream breaks after `after` frames (the rest held back by `gate`), once the
    broker holds two tensors of it: the broker keeps it for its resume. Its frames, header first."""
    header = pb.PushHeader(model=DEMO, handoff_id="r", position=1, fingerprint=contract.fingerprint, resumable=True)
    frames = [pb.PushRequest(header=header).SerializeToString(), *chunk_frames(contract, tensors, 1 << 20)]
    push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity)
    call = push.future(gated(frames, gate, after=after), timeout=30)
    wait_until(lambda: broker.store.stats().receiving == 1 and len(client.push_progress(DEMO, "r").tensors) >= 2)
    call.cancel()  # the prefill's stream breaks
    wait_until(lambda: broker.store.stats().receiving == 1 and broker.store._h.entries[(DEMO, "r")].push is None)
    return frames


def test_a_broken_resumable_push_is_kept_unseen_for_the_resume_window_then_freed(start_broker, contracts):
    broker = start_broker(resume_window=0.6)
    contract = contracts[DEMO]
    tensors = seeded_tensors(contract, seed=13)
    with HandoffClient(broker.address) as client, open_channel(broker.address) as channel:
        gate = threading.Event()
        break_a_resumable_push(broker, client, channel, contract, tensors, gate, after=4)
        kept = client.push_progress(DEMO, "r")
        assert not kept.complete and kept.position == 1
        assert kept.tensors[0].tensor == contract.carried[0].name
        with pytest.raises(WaitTimedOut):
            client.pull(DEMO, "r", timeout=0.2)  # unseen
        wait_until(lambda: broker.store.stats().receiving == 0)  # the window passed: freed
        gate.set()
        assert isinstance(raises_handoff_error(client.push_progress, DEMO, "r"), errors.UnknownHandoff)
    assert_holds_nothing(broker)


def test_a_draining_broker_lets_a_kept_push_resume_finish_and_be_pulled(start_broker, contracts):
    """Suspected in the robustness issue, confirmed: a broken resumable push is a push in flight, which a draining
    broker promises may finish; its resume was refused with DRAINING, so the hand-off was lost with the broker."""
    broker = start_broker()
    contract = contracts[DEMO]
    tensors = seeded_tensors(contract, seed=21)
    with HandoffClient(broker.address) as client, open_channel(broker.address) as channel:
        gate = threading.Event()
        frames = break_a_resumable_push(broker, client, channel, contract, tensors, gate, after=3)
        stopping = threading.Thread(target=broker.stop, kwargs={"grace": 20})
        stopping.start()
        wait_until(lambda: broker.store.stats().draining)
        resume = pb.PushHeader(model=DEMO, handoff_id="r", position=1, fingerprint=contract.fingerprint, resume=True)
        raw_push(broker.address, [pb.PushRequest(header=resume).SerializeToString(), *frames[1:]])
        assert_same_bits(client.pull(DEMO, "r").state, tensors)
        gate.set()
        stopping.join(20)
        assert not stopping.is_alive()


def test_resuming_a_push_that_is_not_kept_is_refused_so_the_client_pushes_it_whole(client, contracts):
    contract = contracts[DEMO]
    header = pb.PushHeader(model=DEMO, handoff_id="r", position=1, fingerprint=contract.fingerprint, resume=True)
    error = raises_handoff_error(raw_push, client.target, [pb.PushRequest(header=header).SerializeToString()])
    assert isinstance(error, errors.UnknownHandoff)


def test_the_bytes_a_resume_sends_are_exactly_those_not_held():
    from handoff_client._pushes import missing

    assert list(missing(10, [])) == [(0, 10)]
    assert list(missing(10, [(0, 10)])) == []
    assert list(missing(10, [(2, 3), (7, 1)])) == [(0, 2), (5, 7), (8, 10)]
    assert list(missing(10, [(0, 4), (4, 2)])) == [(6, 10)]


def test_a_pull_whose_connection_breaks_is_retried_and_gets_the_whole_hand_off(broker, client, contracts):
    tensors = seeded_tensors(contracts[DEMO], seed=6)
    client.push(DEMO, "r", 1, tensors)
    proxy = Proxy(broker.port)
    try:
        proxy.cut_after(2_000_000)
        with HandoffClient(proxy.address, lanes=False) as decoder:
            assert_same_bits(decoder.pull(DEMO, "r").state, tensors)
        assert proxy.connections == 2
        assert_holds_nothing(broker)
    finally:
        proxy.close()


def test_a_retried_pull_takes_over_its_own_broken_claim_at_once(broker, client, contracts):
    tensors = seeded_tensors(contracts["wide-attention"], seed=3)
    client.push("wide-attention", "r", 1, tensors)
    with open_channel(broker.address) as channel:
        zombie = raw_pull(channel, "wide-attention", "r")
        claim = next(zombie).claim  # the broker still streams to this claim, as if the break were unnoticed
        assert isinstance(raises_handoff_error(client.pull, "wide-attention", "r", timeout=0.3), AlreadyClaimed)
        pulled = client.pull_tensors("wide-attention", "r", supersedes=claim)
        assert [c.name for c, _ in pulled] and pulled.claim > claim
        assert_same_bits(pulled.handoff.state, tensors)
        with pytest.raises(grpc.RpcError):
            list(zombie)  # the superseded stream was cut
    assert_holds_nothing(broker)


def test_another_decoder_cannot_end_a_claim_by_guessing_its_number(broker, client, contracts):
    """`supersedes` ends the caller's own broken claim; a decoder that names another's claim must not end it. Claim
    numbers were a counter: a decoder that saw its own claim n took the next decoder's claim by naming n + 1."""
    tensors = seeded_tensors(contracts["wide-attention"], seed=4)
    client.push("wide-attention", "mine", 1, tensors)
    client.push("wide-attention", "theirs", 1, tensors)
    own = client.pull_tensors("wide-attention", "mine")
    list(own)
    with open_channel(broker.address) as channel:
        holder = raw_pull(channel, "wide-attention", "theirs")
        held = next(holder).claim
        guesses = [own.claim + n for n in range(1, 4)] + [held - 1, held + 1]
        for guess in guesses:
            error = raises_handoff_error(client.pull, "wide-attention", "theirs", timeout=0.3)
            assert isinstance(error, AlreadyClaimed)
            pulled = client.pull_tensors("wide-attention", "theirs", supersedes=guess, timeout=0.3)
            assert isinstance(raises_handoff_error(list, pulled), (AlreadyClaimed, WaitTimedOut)), guess
        list(holder)  # streamed to its end, never cut (a superseded stream raises here)
    client._confirm_claim("wide-attention", "theirs", held, 5)
    assert_holds_nothing(broker)


def test_a_decoder_whose_connection_half_dies_loses_its_claim_by_keepalive(start_broker, contracts):
    """The decoder's link goes silent (no FIN, no RST) while its stream waits for the rest of a push: the broker's
    HTTP/2 pings go unanswered, the connection is dropped, and the claim returns long before its lease would."""
    broker = start_broker(lease=60.0, keepalive_seconds=0.5, keepalive_timeout_seconds=0.5)
    contract = contracts[DEMO]
    tensors = seeded_tensors(contract, seed=2)
    gate = threading.Event()
    frames = [header_frame(contract, "r"), *chunk_frames(contract, tensors, 1 << 20)]
    thread, outcome = push_in_thread(broker.address, gated(frames, gate, after=3))
    proxy = Proxy(broker.port)
    try:
        with open_channel(proxy.address) as channel:
            stream = raw_pull(channel, DEMO, "r", timeout=60)
            next(stream)
            wait_until(lambda: broker.store._h.entries[(DEMO, "r")].claimed)
            proxy.freeze()  # the decoder's host is gone: its side of the connection says nothing more
            wait_until(lambda: not broker.store._h.entries[(DEMO, "r")].claimed, timeout=15)
        with HandoffClient(broker.address) as decoder:
            pulled = decoder.pull_tensors(DEMO, "r", timeout=20)
            arrived = iter(pulled)
            next(arrived)
            gate.set()
            list(arrived)
            assert_same_bits(pulled.handoff.state, tensors)
        thread.join(10)
        assert "response" in outcome
    finally:
        gate.set()
        proxy.close()
    assert_holds_nothing(broker)


# -- streaming before the push ends -------------------------------------------------------------------------------


def test_a_pull_receives_a_push_still_under_way_tensor_by_tensor(broker, contracts):
    contract = contracts[DEMO]
    tensors = seeded_tensors(contract, seed=9)
    frames = [header_frame(contract, "r"), *chunk_frames(contract, tensors, 1 << 20)]
    gate = threading.Event()
    thread, outcome = push_in_thread(broker.address, gated(frames, gate, after=3))  # layer 0 and a bit of layer 1
    with HandoffClient(broker.address) as decoder:
        pulled = decoder.pull_tensors(DEMO, "r", timeout=20)
        arrived = iter(pulled)
        first, array = next(arrived)
        assert first.layer == 0 and not gate.is_set()  # the push is still under way
        assert array.tobytes() == tensors[first.name].tobytes()
        gate.set()
        rest = [carried.name for carried, _ in arrived]
        assert len(rest) == len(contract.carried) - 1
        thread.join(10)
        assert "response" in outcome
        assert_same_bits(pulled.handoff.state, tensors)
    assert_holds_nothing(broker)


def test_a_pull_of_a_push_that_fails_midway_is_aborted_and_keeps_nothing(broker, client, contracts):
    contract = contracts[DEMO]
    tensors = seeded_tensors(contract, seed=10)
    good = chunk_frames(contract, tensors, 1 << 20)
    gate = threading.Event()
    frames = [header_frame(contract, "r"), *good[:3], encode_chunk("not-carried", 0, b"x")]
    thread, outcome = push_in_thread(broker.address, gated(frames, gate, after=4))
    pulled = client.pull_tensors(DEMO, "r", timeout=20)
    arrived = iter(pulled)
    next(arrived)
    gate.set()
    with pytest.raises(PushAborted) as e:
        list(arrived)
    assert e.value.code is grpc.StatusCode.ABORTED
    thread.join(10)
    assert outcome["error"].reason == "UNKNOWN_TENSOR"
    assert_holds_nothing(broker)
    with pytest.raises(PushAborted):  # nothing of it is left to pull, and a late puller hears why at once
        client.pull(DEMO, "r", timeout=0.3)


def test_a_resume_may_resend_a_chunk_its_broken_stream_delivered_after_the_progress_was_read(broker, contracts):
    contract = contracts[DEMO]
    tensors = seeded_tensors(contract, seed=14)
    header = pb.PushHeader(model=DEMO, handoff_id="r", position=1, fingerprint=contract.fingerprint, resumable=True)
    chunks = chunk_frames(contract, tensors, 64 << 10)
    sizes = [len(decode_chunk(frame).data) for frame in chunks]
    one_more, stall = threading.Event(), threading.Event()

    def first_stream():
        yield pb.PushRequest(header=header).SerializeToString()
        yield from chunks[:5]
        one_more.wait(10)
        yield chunks[5]  # arrives after the pusher read the progress below
        stall.wait(10)

    def held_bytes() -> int:
        return sum(r.length for t in client.push_progress(DEMO, "r").tensors for r in t.received)

    with HandoffClient(broker.address) as client, open_channel(broker.address) as channel:
        push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity)
        call = push.future(first_stream(), timeout=30)
        wait_until(lambda: broker.store.stats().receiving == 1 and held_bytes() == sum(sizes[:5]))
        one_more.set()  # the pusher has read "5 chunks held"; the sixth lands now
        wait_until(lambda: held_bytes() == sum(sizes[:6]))
        resume = pb.PushHeader(model=DEMO, handoff_id="r", position=1, fingerprint=contract.fingerprint, resume=True)
        result = raw_push(broker.address, [pb.PushRequest(header=resume).SerializeToString(), *chunks[5:]])
        stall.set()
        assert not result.duplicate and result.chunks == len(chunks)  # the sixth chunk counted once
        assert_same_bits(client.pull(DEMO, "r").state, tensors)
        call.cancel()
    assert_holds_nothing(broker)
