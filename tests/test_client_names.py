"""The client refuses by name what the broker would: a tensor the contract does not carry, pushed as a mapping or as
pairs still being made, is UnknownTensor naming it (a misspelled one named, not reported as the carried tensor it
stands for), before the broker is asked, unless the caller opts in to dropping extras. And a pull's `into=`
mistakes are said as the caller's buffers, in shapes; a URL for a target, and a plaintext client of a TLS broker,
are told what to do. Through a real broker on loopback."""

from __future__ import annotations

import numpy as np
import pytest
from certs import Authority
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_broker import BrokerConfig, build_server
from handoff_client import (
    BrokerUnavailable,
    HandoffClient,
    MalformedRequest,
    MissingTensor,
    UnknownTensor,
    WrongLayout,
    WrongLength,
)

MODEL = "demo-hybrid"
K = "layers.1.self_attn.k_cache"


def test_a_push_with_a_tensor_the_contract_does_not_carry_is_refused_naming_it(client, broker, contracts):
    """Fails before the fix: the push succeeded and the extra tensor was left behind without a word."""
    tensors = {**seeded_tensors(contracts[MODEL]), "layers.1.mlp.up": np.zeros((4, 4), np.float32)}
    with pytest.raises(UnknownTensor) as refused:
        client.push(MODEL, "extra", 17, tensors)
    assert refused.value.tensor == "layers.1.mlp.up"
    assert refused.value.message == f"{MODEL}: the hand-off carries `layers.1.mlp.up`, which no decode step reads"
    assert not client.cancel(MODEL, "extra")  # the broker was never asked: it holds nothing under the id
    assert_holds_nothing(broker)


def test_a_misspelled_name_is_named_with_the_carried_tensor_it_stands_for(client, contracts):
    """Fails before the fix: MissingTensor named `layers.1.self_attn.k_cache` and never the key that was passed."""
    tensors = seeded_tensors(contracts[MODEL])
    tensors["layers.1.self_attn.k_cach"] = tensors.pop(K)
    with pytest.raises(UnknownTensor) as refused:
        client.push(MODEL, "typo", 17, tensors)
    assert refused.value.tensor == "layers.1.self_attn.k_cach"
    assert f"(a misspelling of the carried `{K}`, which it leaves out?)" in refused.value.message
    pairs = iter(tensors.items())  # the same, as pairs still being made
    with pytest.raises(UnknownTensor, match="carries `layers.1.self_attn.k_cach`.*misspelling of the carried"):
        client.push(MODEL, "typo", 17, pairs)


def test_pairs_still_being_made_with_an_extra_are_refused_naming_it(client, broker, contracts):
    """Fails before the fix: the extra pair was made and never sent, and the push succeeded."""
    made = [("layers.0.extra", np.zeros(3, np.float32)), *seeded_tensors(contracts[MODEL]).items()]
    with pytest.raises(UnknownTensor, match="carries `layers.0.extra`"):
        client.push(MODEL, "made", 17, iter(made))
    assert_holds_nothing(broker, within=5)


def test_drop_extra_leaves_what_the_contract_does_not_carry_behind(client, broker, contracts):
    tensors = seeded_tensors(contracts[MODEL])
    extra = {**tensors, "layers.1.mlp.up": np.zeros((4, 4), np.float32)}
    client.push(MODEL, "kept", 17, extra, drop_extra=True)
    client.push(MODEL, "made", 17, iter(extra.items()), drop_extra=True)
    for handoff_id in ("kept", "made"):
        pulled = client.pull(MODEL, handoff_id, timeout=10)
        assert sorted(pulled.state) == sorted(tensors)
    assert_same_bits(pulled.state, {c.name: tensors[c.name][: c.rows] for c in contracts[MODEL].at(17).carried})
    assert_holds_nothing(broker)


def test_pull_into_mistakes_name_the_callers_buffers_in_shapes(client, broker, contracts):
    """Fails before the fix: 'the hand-off leaves out', 'float32 in the hand-off', and a shape given in values."""
    contract = contracts[MODEL]
    client.push(MODEL, "into", 17, seeded_tensors(contract))
    buffers = {c.name: np.zeros(c.shape, c.numpy_dtype) for c in contract.carried}
    typo = {("layers.1.self_attn.k_cach" if name == K else name): array for name, array in buffers.items()}
    with pytest.raises(MissingTensor) as refused:
        client.pull(MODEL, "into", into=typo, timeout=5)
    assert refused.value.message == (f"{MODEL}: `pull(into=...)` has no array for `{K}` ((4096, 128) bfloat16) (it "
                                     "has `layers.1.self_attn.k_cach`: misspelled?): give one for every carried tensor")  # fmt: skip
    with pytest.raises(WrongLength) as refused:
        client.pull(MODEL, "into", into={**buffers, K: np.zeros((17, 128), buffers[K].dtype)}, timeout=5)
    assert refused.value.message == (f"{MODEL}: `pull(into=...)`'s `{K}` is (17, 128) bfloat16; a buffer for it is "
                                     "(4096, 128) bfloat16, C-contiguous and writable (nothing is cast or reshaped)")  # fmt: skip
    with pytest.raises(WrongLayout, match=r"`pull\(into=...\)`'s `.*` is \(4096, 128\) float32; a buffer for it is"):
        client.pull(MODEL, "into", into={**buffers, K: np.zeros((4096, 128), np.float32)}, timeout=5)
    with pytest.raises(WrongLayout, match="is .* but not C-contiguous and writable, so it cannot be filled in place"):
        client.pull(MODEL, "into", into={**buffers, K: np.zeros((128, 4096), buffers[K].dtype).T}, timeout=5)
    client.pull(MODEL, "into", into=buffers, timeout=5)  # nothing was claimed by the refusals
    assert_holds_nothing(broker)


def test_a_url_target_is_refused_naming_the_host_and_port_meant():
    """Fails before the fix: gRPC's `Misformatted domain name`, from the first call."""
    for url in ("http://127.0.0.1:50051", "grpc://broker:50051/"):
        with pytest.raises(MalformedRequest) as refused:
            HandoffClient(url)
        host = url.split("://")[1].rstrip("/")
        assert refused.value.message.startswith(f"target `{url}` is a URL: a broker is reached at host:port (`{host}`)")


def test_a_plaintext_client_of_a_tls_broker_is_told_of_tls():
    """Fails before the fix: `failed to connect to all addresses; ... Socket closed`, and nothing of TLS."""
    authority = Authority("names-ca")
    issued = authority.issue("localhost", server=True)
    broker, port = build_server(BrokerConfig(port=0, lanes=False, metrics_port=None, tls_cert=issued.cert,
                                             tls_key=issued.key))  # fmt: skip
    broker.start()
    try:
        with HandoffClient(f"127.0.0.1:{port}") as plaintext, pytest.raises(BrokerUnavailable) as refused:
            plaintext.status(timeout=3)
        assert "if the broker serves TLS, this plaintext client cannot reach it: give it the broker's CA" in str(
            refused.value.message
        )
        with HandoffClient(
            f"127.0.0.1:{port}", tls_root_certificates=authority.pem, tls_server_name="localhost"
        ) as tls:
            assert tls.status(timeout=10).max_bytes > 0  # (the same broker, over TLS)
    finally:
        broker.stop(0)
