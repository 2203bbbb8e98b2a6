"""torch CPU tensors in and out of the client without a copy: numpy views of the same memory (bfloat16 included,
through ml_dtypes), so a worker holding torch tensors pushes them and pulls into them as it does numpy arrays.

    client.push(model, id, position, {name: to_numpy(t) for name, t in tensors.items()})
    client.pull(model, id, into={name: to_numpy(cache) for name, cache in caches.items()})

torch is imported only when these are called: the client itself never needs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .protocol.dtypes import numpy_dtype

_VIEWS = {"torch.bfloat16": ("int16", "bfloat16"), "torch.float8_e4m3fn": ("uint8", "float8_e4m3fn"),
          "torch.float8_e5m2": ("uint8", "float8_e5m2")}  # fmt: skip
"""dtypes numpy lacks: viewed as an integer of their width by torch, then as the ml_dtypes type by numpy."""


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy array sharing `tensor`'s memory (a CPU tensor; bfloat16 and float8 as ml_dtypes). Writes to either
    show in both. ValueError for a tensor on another device (copy it to the host first, once)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"a {tensor.device} tensor: numpy views need host memory (tensor.cpu() first)")
    view = _VIEWS.get(str(tensor.dtype))
    if view is None:
        return tensor.detach().numpy()
    import torch

    return tensor.detach().view(getattr(torch, view[0])).numpy().view(numpy_dtype(view[1]))


def from_numpy(array: np.ndarray) -> Any:
    """A CPU torch tensor sharing `array`'s memory (bfloat16 and float8 arrays included)."""
    import torch

    for torch_name, (integer, name) in _VIEWS.items():
        if array.dtype == numpy_dtype(name):
            return torch.from_numpy(array.view(integer)).view(getattr(torch, torch_name.split(".")[1]))
    return torch.from_numpy(array)
