"""The .proto is the single source of truth: the committed module matches it, the hand-made chunk frames are the
bytes protoc's code writes and reads, the servicer implements every RPC, and every error reason has its class."""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from handoff_broker.service import HandoffBrokerServicer
from handoff_client import HandoffClient, RetryPolicy
from handoff_client.protocol import errors
from handoff_client.protocol.frames import ChunkFrame, crc32c, decode_chunk, encode_chunk
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import SERVICE, Malformed, decode_pull_response, decode_push_request
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent


def _drop_json_names(messages) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def test_the_committed_generated_module_matches_the_proto(tmp_path: Path):
    from grpc_tools import protoc

    descriptors = tmp_path / "handoff.desc"
    proto = ROOT / "proto" / "handoff" / "v1" / "handoff.proto"
    assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"--descriptor_set_out={descriptors}", str(proto)]) == 0
    (want,) = descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes()).file
    _drop_json_names(want.message_type)  # protoc leaves them out of the generated Python module
    have = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(have)
    assert have == want, "client/protocol/messages is stale: run `python scripts/generate_proto.py`"


names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
offsets = st.integers(0, 2**64 - 1)
crcs = st.integers(0, 2**32 - 1)
payloads = st.binary(max_size=600)


@given(names, offsets, crcs, payloads)
def test_a_hand_made_chunk_frame_is_the_bytes_protobuf_writes(tensor, offset, crc, data):
    chunk = pb.Chunk(tensor=tensor, offset=offset, crc32c=crc, data=data)
    frame = encode_chunk(tensor, offset, data, crc)
    assert frame == pb.PushRequest(chunk=chunk).SerializeToString()
    assert frame == pb.PullResponse(chunk=chunk).SerializeToString()
    assert pb.PullResponse.FromString(frame).chunk == chunk


@given(names, offsets, crcs, payloads)
def test_a_chunk_protobuf_writes_is_read_in_place(tensor, offset, crc, data):
    frame = pb.PushRequest(chunk=pb.Chunk(tensor=tensor, offset=offset, crc32c=crc, data=data)).SerializeToString()
    parsed = decode_chunk(frame)
    assert (parsed.tensor, parsed.offset, parsed.crc32c, bytes(parsed.data)) == (tensor, offset, crc, data)
    assert parsed.frame is frame  # no copy: the payload is a view of the received bytes


def test_a_chunk_encoded_another_way_is_still_read_right():
    """Fields out of order, an unknown field, a repeated field: valid protobuf that the fast path hands over."""
    chunk = pb.Chunk(tensor="k", offset=9, crc32c=crc32c(b"abc"), data=b"abc")
    body = chunk.SerializeToString()
    reordered = b"\x22\x03abc" + b"\x10\x09" + b"\x0a\x01k" + b"\x1d" + chunk.crc32c.to_bytes(4, "little")
    unknown = body + b"\x28\x01"  # field 5, varint: a field from a newer peer
    repeated = b"\x10\x01" + body  # offset given twice: the last one wins
    for inner in (reordered, unknown, repeated):
        frame = b"\x12" + bytes([len(inner)]) + inner
        parsed = decode_push_request(frame)
        assert isinstance(parsed, ChunkFrame)
        assert (parsed.tensor, parsed.offset, bytes(parsed.data)) == ("k", 9, b"abc")
        assert pb.PullResponse.FromString(parsed.frame).chunk == chunk  # what a puller will be forwarded


def test_headers_and_garbage_are_told_apart_from_chunks():
    header = pb.PushHeader(model="m", handoff_id="r", position=3, fingerprint="f")
    assert decode_push_request(pb.PushRequest(header=header).SerializeToString()) == header
    assert isinstance(decode_push_request(b"\x12\xff\xff\xff"), Malformed)
    assert isinstance(decode_push_request(b""), Malformed)
    end = pb.PullEnd(digest="d")
    assert decode_pull_response(pb.PullResponse(end=end).SerializeToString()) == end


def test_the_servicer_implements_every_rpc_the_proto_declares():
    declared = {method.name for method in SERVICE.methods}
    assert declared == {
        "ListContracts",
        "GetContract",
        "PushHandoff",
        "PullHandoff",
        "ConfirmHandoff",
        "CancelHandoff",
        "GetStatus",
        "GetPushProgress",
        "GetLanes",
    }
    for name in declared:
        assert callable(getattr(HandoffBrokerServicer, name, None)), name


def test_every_error_reason_in_the_proto_has_its_exception_and_back():
    declared = set(pb.ErrorReason.keys()) - {"ERROR_REASON_UNSPECIFIED"}
    assert declared == set(errors.BY_REASON)


EXAMPLES = [
    errors.UnknownTensor("m", "t"),
    errors.MissingTensor("m", "t"),
    errors.WrongLength("m", "t", 6, 9, "float32", 4),
    errors.WrongLayout("m", "t", "(2, 3) float32", "(3, 2) float32"),
    errors.BadChunk("m", "t", 4, 8, "overlaps bytes already received"),
    errors.PositionOutOfRange("m", 9, 9),
    errors.MalformedRequest("no header", "m"),
    errors.UnknownModel("m", ["a", "b"]),
    errors.UnknownHandoff("m", "r"),
    errors.HandoffGone("m", "r", "expired"),
    errors.HandoffExists("m", "r", "differs"),
    errors.FingerprintMismatch("m", "aa", "bb"),
    errors.AlreadyClaimed("m", "r"),
    errors.StaleClaim("m", "r", 1, "is superseded"),
    errors.WaitTimedOut("m", "r", 1.5),
    errors.CapacityExhausted("m", 10, 5, 8),
    errors.PushAborted("m", "r"),
    errors.MessageTooLarge("m", 10, 8),
    errors.BrokerBusy("pulls waiting for their push", 3),
    errors.LaneBroken("demo-hybrid", "the push's lane broke: the lane closed after 10 of 1048576 bytes"),
    errors.Unauthenticated("no bearer token"),
    errors.PermissionDenied("prefill-pool", "has roles prefill; PullHandoff needs decode"),
    errors.Draining(),
    errors.BrokerRestarted("m", "h", "0a1b", "2c3d"),
    errors.HandoffCancelled("m", "r"),
    errors.InternalError(),
    errors.DigestMismatch("m", "r", "aa", "bb"),
    errors.NotInShard("m", "t", 1, 2, "it is not split, and rank 0 pushes it"),
    errors.ShardLayout("m", "`t` has 6 heads, which 4 ranks cannot share", "t"),
    errors.ShardMismatch("m", "r", "pushed", 2, 4),
    errors.BrokerUnavailable("failed to connect to all addresses"),
    errors.CallCancelled("the call was cancelled"),
    errors.DeadlineExceeded("Deadline Exceeded"),
    errors.RpcFailed(grpc.StatusCode.UNIMPLEMENTED, "Method not found"),
]


def test_the_examples_cover_every_reason():
    assert {type(e).reason for e in EXAMPLES} == set(errors.BY_REASON)


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_an_error_crosses_the_wire_as_the_same_class_code_message_and_fields(error):
    status = errors.to_status(error)
    assert status.code == error.code.value[0]
    back = errors.from_status(error.code, status.message, list(status.details))
    assert type(back) is type(error)
    assert (back.message, back.fields) == (error.message, error.fields)


def test_a_status_without_our_details_maps_by_its_code():
    assert type(errors.from_status(grpc.StatusCode.UNAVAILABLE, "down", [])) is errors.BrokerUnavailable
    other = errors.from_status(grpc.StatusCode.UNIMPLEMENTED, "nope", [])
    assert isinstance(other, errors.RpcFailed) and other.status is grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK], ids=lambda c: c.name)
def test_every_grpc_failure_maps_to_a_reason_of_the_error_model_and_keeps_its_code(code):
    """A status without our details (a proxy's, gRPC's own, a broker that cannot be reached) still becomes an error
    with a reason the .proto declares, never ERROR_REASON_UNSPECIFIED; the vLLM connector once logged a broker it
    could not reach as `ERROR_REASON_UNSPECIFIED failed to connect to all addresses`."""
    error = errors.from_status(code, "what gRPC said", [])
    assert error.reason in set(pb.ErrorReason.keys()) and error.reason != "ERROR_REASON_UNSPECIFIED", (code, error)
    assert error.code is code and "what gRPC said" in error.message


def test_every_error_class_has_a_reason_of_the_error_model():
    """Every class a call can raise or rebuild has its reason; only the three families no code raises (their
    members do) are left without one."""
    families = {errors.NotFound, errors.Precondition, errors.ContractViolation}

    def every(cls: type) -> list[type]:
        return [cls] + [each for sub in cls.__subclasses__() for each in every(sub)]

    for cls in every(errors.HandoffError):
        if cls is not errors.HandoffError and cls not in families:
            assert cls.reason in set(pb.ErrorReason.keys()) and cls.reason != "ERROR_REASON_UNSPECIFIED", cls


def test_a_broker_that_cannot_be_reached_is_broker_unavailable():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: every connection is refused
        with (
            HandoffClient(address, timeout=2, retry=RetryPolicy(attempts=1)) as client,
            pytest.raises(errors.BrokerUnavailable) as failed,
        ):
            client.status()
    assert failed.value.reason == "BROKER_UNAVAILABLE" and failed.value.code is grpc.StatusCode.UNAVAILABLE
