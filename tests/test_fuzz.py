"""Random, malformed and adversarial push streams through the real server: after each, a clear status (never
INTERNAL or UNKNOWN), no resident byte leaked, and a good hand-off still goes through.

A longer run by hand: HANDOFF_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py -p no:cacheprovider
"""

from __future__ import annotations

import itertools
import os

import grpc
import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import HandoffClient
from handoff_client.protocol.frames import crc32c, encode_chunk
from handoff_client.protocol.messages import handoff_pb2 as pb
from handoff_client.protocol.wire import identity, method_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import open_channel

MODEL = "every-dtype"
COUNTER = itertools.count()
EXAMPLES = int(os.environ.get("HANDOFF_FUZZ_EXAMPLES", "60"))
CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
}  # fmt: skip
TENSORS = [f"layers.{i}.state_{d}" for i, d in enumerate(
    ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int32", "int8", "uint8"])]  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_broker(contracts):
    from handoff_broker import BrokerConfig, build_server

    broker, _ = build_server(BrokerConfig(port=0, contracts=contracts, max_bytes=1 << 20))
    broker.start()
    yield broker
    broker.stop(grace=0.2)


def headers(contract) -> st.SearchStrategy[bytes]:
    good = pb.PushHeader(model=MODEL, handoff_id="fuzz", position=1, fingerprint=contract.fingerprint)
    variants = st.one_of(
        st.just(good),
        st.builds(
            lambda p: pb.PushHeader(model=MODEL, handoff_id="fuzz", position=p, fingerprint=contract.fingerprint),
            st.integers(0, 2**64 - 1),
        ),
        st.builds(
            lambda m, i, f: pb.PushHeader(model=m, handoff_id=i, position=1, fingerprint=f),
            st.text(max_size=40),
            st.text(max_size=300),
            st.text(max_size=70),
        ),
    )
    return variants.map(lambda h: pb.PushRequest(header=h).SerializeToString())


def chunks() -> st.SearchStrategy[bytes]:
    def frame(tensor: str, offset: int, data: bytes, corrupt: bool) -> bytes:
        crc = crc32c(data) ^ (1 if corrupt else 0)
        return encode_chunk(tensor, offset, data, crc)

    return st.one_of(
        st.builds(
            frame,
            st.sampled_from(TENSORS) | st.text(max_size=20),
            st.integers(0, 2**64 - 1) | st.integers(0, 800),
            st.binary(max_size=900),
            st.booleans(),
        ),
        st.binary(max_size=64),  # garbage on the wire
    )


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_push_stream_gets_a_clear_status_and_leaves_nothing(fuzz_broker, contracts, data):
    contract = contracts[MODEL]
    frames = data.draw(st.lists(headers(contract), min_size=0, max_size=2)) if data.draw(st.booleans()) else []
    frames = [*frames, *data.draw(st.lists(chunks(), max_size=12))]
    if data.draw(st.booleans()):
        frames = [data.draw(headers(contract)), *frames]
    with open_channel(fuzz_broker.address) as channel:
        push = channel.stream_unary(method_path("PushHandoff"), request_serializer=identity,
                                    response_deserializer=pb.PushResponse.FromString)  # fmt: skip
        try:
            response = push(iter(frames), timeout=10)
            accepted = not response.duplicate
        except grpc.RpcError as e:
            assert e.code() in CLEAR, (e.code(), e.details())
            accepted = False
    with HandoffClient(fuzz_broker.address, timeout=10) as client:
        if accepted:  # a random stream that is a whole, valid hand-off: take it back out
            client.pull(MODEL, "fuzz")
        assert_holds_nothing(fuzz_broker)
        tensors = seeded_tensors(contract)
        good = f"good-{next(COUNTER)}"
        client.push(MODEL, good, 1, tensors)
        assert_same_bits(client.pull(MODEL, good).state, tensors)
