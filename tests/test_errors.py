"""Every way a call can be wrong, through the real wire: the status code, the message naming the model, tensor and
sizes, the typed exception; and afterwards the broker holds nothing of it and still serves a good hand-off.

Pushes here go through `raw_push`, which sends what the client library would refuse to send, so these are the
broker's own checks; `test_the_client_refuses_the_same_faults_with_the_same_errors` shows the client's match.
"""

from __future__ import annotations

import grpc
import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import (
    AlreadyClaimed,
    BadChunk,
    FingerprintMismatch,
    HandoffClient,
    HandoffError,
    HandoffExists,
    HandoffGone,
    MalformedRequest,
    MissingTensor,
    PositionOutOfRange,
    StaleClaim,
    UnknownHandoff,
    UnknownModel,
    UnknownTensor,
    WaitTimedOut,
    WrongLength,
)
from handoff_client.protocol.errors import from_rpc_error
from handoff_client.protocol.frames import encode_chunk
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import method_path
from support import chunk_frames, header_frame, open_channel, raises_handoff_error, raw_pull, raw_push

MODEL = "every-dtype"  # 9 tensors of 7 x 13, one per dtype
F32 = "layers.1.state_float32"  # 364 bytes


@pytest.fixture
def contract(contracts):
    return contracts[MODEL]


@pytest.fixture
def good_frames(contract):
    return chunk_frames(contract, seeded_tensors(contract), chunk_bytes=100)


@pytest.fixture(autouse=True)
def broker_stays_clean_and_serving(broker, client):
    """After every test here: nothing held, and a good hand-off still goes through."""
    yield
    assert_holds_nothing(broker)
    contract = client.get_contract(MODEL)
    tensors = seeded_tensors(contract, seed=99)
    client.push(MODEL, "after-the-error", 1, tensors)
    assert_same_bits(client.pull(MODEL, "after-the-error").state, tensors)
    assert_holds_nothing(broker)


def push_error(broker, frames) -> HandoffError:
    return raises_handoff_error(raw_push, broker.address, frames)


def without(tensors: dict, name: str) -> dict:
    return {k: v for k, v in tensors.items() if k != name}


def confirm(client: HandoffClient, handoff_id: str, claim: int) -> None:
    client._call(client._confirm, pb.ConfirmRequest(model=MODEL, handoff_id=handoff_id, claim=claim), 2)


def test_an_unknown_model_is_not_found_and_the_message_lists_what_is_served(client):
    error = raises_handoff_error(client.get_contract, "llama-9")
    assert isinstance(error, UnknownModel) and error.code is grpc.StatusCode.NOT_FOUND
    assert (
        error.message == "no contract for model `llama-9`; this broker serves: demo-hybrid, every-dtype, wide-attention"
    )


def test_a_push_from_a_different_contract_is_refused_with_both_fingerprints(broker, contract, good_frames):
    error = push_error(broker, [header_frame(contract, "r", fingerprint="abc123"), *good_frames])
    assert isinstance(error, FingerprintMismatch) and error.code is grpc.StatusCode.FAILED_PRECONDITION
    assert f"Broker: {contract.fingerprint}, caller: abc123" in error.message


def test_a_position_past_the_cache_is_out_of_range(broker, contract, good_frames):
    error = push_error(broker, [header_frame(contract, "r", position=contract.ctx), *good_frames])
    assert isinstance(error, PositionOutOfRange) and error.code is grpc.StatusCode.OUT_OF_RANGE
    assert error.message == (
        "every-dtype: after 64 tokens the next decode writes row 64 (counted from 0); a cache of 64 has rows 0 to 63"
    )


def test_a_chunk_of_a_tensor_the_contract_does_not_carry_is_refused_by_name(broker, contract, good_frames):
    frames = [header_frame(contract, "r"), *good_frames[:3], encode_chunk("layers.0.mlp", 0, b"1234"), *good_frames[3:]]
    error = push_error(broker, frames)
    assert isinstance(error, UnknownTensor) and error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert (error.model, error.tensor) == (MODEL, "layers.0.mlp")
    assert error.message == "every-dtype: the hand-off carries `layers.0.mlp`, which no decode step reads"


def test_a_chunk_past_its_tensors_end_is_refused_with_the_sizes(broker, contract):
    error = push_error(broker, [header_frame(contract, "r"), encode_chunk(F32, 360, b"12345")])
    assert isinstance(error, BadChunk) and error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == (
        f"every-dtype: the chunk of `{F32}` at byte 360 (5 bytes) runs past the tensor's 364 bytes ((7, 13) float32)"
    )


def test_a_chunk_over_bytes_already_received_is_refused(broker, contract):
    frames = [header_frame(contract, "r"), encode_chunk(F32, 0, b"x" * 100), encode_chunk(F32, 99, b"y" * 10)]
    error = push_error(broker, frames)
    assert isinstance(error, BadChunk) and error.tensor == F32
    assert error.message.endswith("at byte 99 (10 bytes) overlaps bytes already received")


def test_a_chunk_whose_checksum_fails_is_refused_by_name(broker, contract, good_frames):
    corrupt = bytearray(good_frames[5])
    corrupt[-1] ^= 0x01  # one bit of payload flipped in flight
    error = push_error(broker, [header_frame(contract, "r"), *good_frames[:5], bytes(corrupt), *good_frames[6:]])
    assert isinstance(error, BadChunk) and error.message.endswith("fails its CRC32C on arrival")


def test_a_push_that_ends_without_a_carried_tensor_is_refused_by_name(broker, contract):
    tensors = without(seeded_tensors(contract), "layers.4.state_float8_e4m3fn")
    error = push_error(broker, [header_frame(contract, "r"), *chunk_frames(contract, tensors, 100)])
    assert isinstance(error, MissingTensor) and error.tensor == "layers.4.state_float8_e4m3fn"
    assert error.message == "every-dtype: the hand-off leaves out the carried `layers.4.state_float8_e4m3fn`"


def test_a_push_that_leaves_out_several_tensors_is_refused_naming_each(broker, contract):
    """Issue "What an outside implementer meets first": MISSING_TENSOR named only the first tensor left out."""
    gone = ["layers.1.state_float32", "layers.4.state_float8_e4m3fn", "layers.8.state_uint8"]
    tensors = {k: v for k, v in seeded_tensors(contract).items() if k not in gone}
    error = push_error(broker, [header_frame(contract, "r"), *chunk_frames(contract, tensors, 100)])
    assert isinstance(error, MissingTensor) and error.tensor == gone[0] and error.fields["missing"] == "3"
    assert error.message == (
        "every-dtype: the hand-off leaves out the carried `layers.1.state_float32` and 2 more "
        "(`layers.4.state_float8_e4m3fn`, `layers.8.state_uint8`)"
    )
    assert str(raises_handoff_error(contract.take, 1, tensors)) == error.message  # the client's own check, the same


def test_every_refusal_of_a_push_names_its_hand_off_in_the_metadata(broker, contract, good_frames):
    """Issue "What an outside implementer meets first": push refusals left `handoff_id` out of the error metadata."""
    bad_crc = bytearray(good_frames[1])
    bad_crc[-1] ^= 0xFF
    refused = [
        [header_frame(contract, "r", fingerprint="0" * 64), *good_frames[1:]],  # FINGERPRINT_MISMATCH
        [header_frame(contract, "r", position=contract.ctx), *good_frames[1:]],  # POSITION_OUT_OF_RANGE
        [header_frame(contract, "r"), encode_chunk("nope", 0, b"x")],  # UNKNOWN_TENSOR
        [header_frame(contract, "r"), bytes(bad_crc)],  # BAD_CHUNK
        [header_frame(contract, "r")],  # MISSING_TENSOR
    ]
    for frames in refused:
        error = push_error(broker, frames)
        assert error.handoff_id == "r", (type(error).__name__, error.fields)
    assert_holds_nothing(broker)


def test_a_push_that_ends_with_a_tensor_short_is_refused_with_both_sizes(broker, contract):
    tensors = without(seeded_tensors(contract), "layers.8.state_uint8")
    frames = [header_frame(contract, "r"), *chunk_frames(contract, tensors, 100)]
    frames.append(encode_chunk("layers.8.state_uint8", 0, b"\x01" * 90))
    error = push_error(broker, frames)
    assert isinstance(error, WrongLength) and error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == (
        "every-dtype: `layers.8.state_uint8` is 91 values in the contract and 90 in the hand-off "
        "(91 and 90 bytes of uint8)"
    )


def test_a_tensor_ending_mid_element_is_refused_as_not_whole(broker, contract):
    frames = [header_frame(contract, "r"), *chunk_frames(contract, without(seeded_tensors(contract), F32), 100)]
    frames.append(encode_chunk(F32, 0, b"\x01" * 363))
    error = push_error(broker, frames)
    assert isinstance(error, WrongLength)
    assert "363 bytes, not a whole number of float32 values," in error.message


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        (lambda c, g: g, "a push must start with its header"),
        (lambda c, g: [header_frame(c, "r"), *g[:2], header_frame(c, "r"), *g[2:]], "a second one came"),
        (lambda c, g: [header_frame(c, "r"), b"\x12\xff\xff\xff\x0f garbage"], "not a PushRequest"),
        (lambda c, g: [header_frame(c, ""), *g], "a handoff_id must be 1..256 printable characters"),
        (lambda c, g: [header_frame(c, "x" * 300), *g], "a handoff_id must be 1..256 printable characters"),
    ],
    ids=["no header", "two headers", "garbage", "empty id", "long id"],
)
def test_a_malformed_push_is_invalid_argument_and_says_why(broker, contract, good_frames, frames, why):
    error = push_error(broker, frames(contract, good_frames))
    assert isinstance(error, MalformedRequest) and error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert why in error.message


def test_a_second_push_of_the_same_id_must_repeat_it_byte_for_byte(broker, client, contract):
    tensors = seeded_tensors(contract, seed=1)
    first = client.push(MODEL, "r", 1, tensors)
    again = client.push(MODEL, "r", 1, tensors)  # a blind retry: succeeds, changes nothing
    assert (again.duplicate, again.digest) == (True, first.digest)
    with HandoffClient(broker.address, chunk_bytes=100) as small_chunks:  # the same bytes, chunked otherwise
        recut = small_chunks.push(MODEL, "r", 1, tensors)
    assert (recut.duplicate, recut.chunks, recut.digest) == (True, first.chunks, first.digest)  # what is held
    assert broker.store.stats().ready == 1
    changed = {**tensors, F32: tensors[F32] + 1}
    error = raises_handoff_error(client.push, MODEL, "r", 1, changed)
    assert isinstance(error, HandoffExists) and error.code is grpc.StatusCode.ALREADY_EXISTS
    assert f"differs in `{F32}`" in error.message
    error = raises_handoff_error(client.push, MODEL, "r", 2, tensors)
    assert isinstance(error, HandoffExists) and "was pushed at position 1, not 2" in error.message
    assert_same_bits(client.pull(MODEL, "r").state, tensors)  # the first push is what a decoder gets


def test_a_retried_push_after_delivery_is_recognised(client, contract):
    tensors = seeded_tensors(contract, seed=2)
    client.push(MODEL, "r", 1, tensors)
    client.pull(MODEL, "r")
    assert client.push(MODEL, "r", 1, tensors).duplicate
    error = raises_handoff_error(client.push, MODEL, "r", 1, {**tensors, F32: tensors[F32] * 2})
    assert isinstance(error, HandoffExists) and "was delivered with different content" in error.message


def test_a_second_puller_of_a_claimed_hand_off_is_refused(broker, client, contract):
    client.push(MODEL, "r", 1, seeded_tensors(contract))
    with open_channel(broker.address) as channel:
        stream = raw_pull(channel, MODEL, "r")
        header = next(stream)  # the claim is held, not yet confirmed
        error = raises_handoff_error(client.pull, MODEL, "r", timeout=2)
        assert isinstance(error, AlreadyClaimed) and error.code is grpc.StatusCode.FAILED_PRECONDITION
        assert error.message == "every-dtype: hand-off `r` is claimed by another decode worker"
        list(stream)
    confirm(client, "r", header.claim)


def test_a_pull_whose_hand_off_never_comes_times_out_saying_so(client):
    error = raises_handoff_error(client.pull, MODEL, "never", timeout=0.5)
    assert isinstance(error, WaitTimedOut) and error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.message.startswith("every-dtype: hand-off `never` was not pushed within")


def test_a_pull_of_a_hand_off_already_confirmed_says_it_is_gone(client, contract):
    client.push(MODEL, "r", 1, seeded_tensors(contract))
    client.pull(MODEL, "r")
    error = raises_handoff_error(client.pull, MODEL, "r", timeout=2)
    assert isinstance(error, HandoffGone) and error.code is grpc.StatusCode.NOT_FOUND
    assert "was already delivered to a decode worker and confirmed" in error.message


def test_confirms_name_their_claim(client, contract):
    error = raises_handoff_error(confirm, client, "x", 1)
    assert isinstance(error, UnknownHandoff) and error.code is grpc.StatusCode.NOT_FOUND
    client.push(MODEL, "r", 1, seeded_tensors(contract))
    pulled = client.pull_tensors(MODEL, "r")
    list(pulled)  # confirmed as its claim
    confirm(client, "r", pulled.claim)  # again: idempotent
    error = raises_handoff_error(confirm, client, "r", pulled.claim + 1)
    assert isinstance(error, StaleClaim) and error.code is grpc.StatusCode.FAILED_PRECONDITION


def test_the_client_refuses_the_same_faults_with_the_same_errors(broker, client, contract):
    """Checked before sending, by the same rules: the same class and the same message as the broker's."""
    tensors = seeded_tensors(contract)
    cases = []
    local = raises_handoff_error(client.push, MODEL, "r", contract.ctx, tensors)
    remote = push_error(
        broker, [header_frame(contract, "r", position=contract.ctx), *chunk_frames(contract, tensors, 64)]
    )
    cases.append((local, remote))
    short = {**tensors, F32: tensors[F32].reshape(-1)[:90].reshape(90, 1)}
    local = raises_handoff_error(client.push, MODEL, "r", 1, short)
    frames = [header_frame(contract, "r"), *chunk_frames(contract, without(tensors, F32), 1 << 20)]
    remote = push_error(broker, [*frames, encode_chunk(F32, 0, tensors[F32].tobytes()[:360])])
    cases.append((local, remote))
    local = raises_handoff_error(client.push, MODEL, "r", 1, without(tensors, F32))
    remote = push_error(broker, frames)
    cases.append((local, remote))
    for local, remote in cases:
        assert type(local) is type(remote)
        assert local.message == remote.message


BAD_IDS = ["", "x" * 257, "x" * 20_000, "tab\there", "nul\x00", "line\nbreak"]


@pytest.mark.parametrize("rpc", ["ConfirmHandoff", "CancelHandoff", "GetPushProgress", "PullHandoff", "PushHandoff"])
def test_every_rpc_naming_a_hand_off_checks_its_id_by_the_one_rule(broker, contract, rpc):
    """Sent raw (the client checks ids too), each RPC that names a hand-off refuses an id that is empty, longer than
    256 characters or not printable with INVALID_ARGUMENT saying the rule: ConfirmHandoff and GetPushProgress once
    took any id and answered NOT_FOUND."""
    requests = {
        "ConfirmHandoff": lambda bad: pb.ConfirmRequest(model=MODEL, handoff_id=bad, claim=1),
        "CancelHandoff": lambda bad: pb.CancelRequest(model=MODEL, handoff_id=bad),
        "GetPushProgress": lambda bad: pb.PushProgressRequest(model=MODEL, handoff_id=bad),
        "PullHandoff": lambda bad: pb.PullRequest(model=MODEL, handoff_id=bad),
    }
    with open_channel(broker.address) as channel:
        for bad in BAD_IDS:
            if rpc == "PushHandoff":
                error = push_error(broker, [header_frame(contract, bad)])
            else:
                call = getattr(channel, "unary_stream" if rpc == "PullHandoff" else "unary_unary")(
                    method_path(rpc), request_serializer=lambda m: m.SerializeToString()
                )
                try:
                    list(call(requests[rpc](bad), timeout=10)) if rpc == "PullHandoff" else call(requests[rpc](bad))
                except grpc.RpcError as e:
                    error = from_rpc_error(e)
                else:
                    raise AssertionError(f"{rpc} took the id {bad[:20]!r}")
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT, (rpc, bad[:20], error)
            assert error.reason == "MALFORMED_REQUEST" and "1..256 printable characters" in error.message, error
            assert len(error.message) < 400  # the id is echoed bounded
