"""A push's and a pull's arguments checked before anything else happens, so a caller's mistake is one line of the
client's error model (MalformedRequest, naming the model and what to pass) rather than an error from deep inside.

- `position` is a whole number of tokens, 0 or more (the contract then checks it is below its ctx).
- `tensors` and `into` are mappings of tensor name to array. An array is a numpy array, or a CPU torch tensor taken
  as a numpy view of its memory (no copy, bfloat16 and float8 included: handoff_client._torch), or any other object
  numpy reads through DLPack; anything else is left as it is, for the contract's checks to refuse by name.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from .protocol.errors import MalformedRequest


def checked_position(model: str, position: object) -> int:
    """`position` as an int; MalformedRequest unless it is a whole number 0 or more."""
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
        raise MalformedRequest(
            f"position is a {type(position).__name__}: it counts the tokens prefilled, a whole number 0 or more", model
        )
    if position < 0:
        raise MalformedRequest(f"position {position}: it counts the tokens prefilled, a whole number 0 or more", model)
    return int(position)


def as_arrays(model: str, tensors: object, argument: str = "tensors") -> dict[str, Any]:
    """`tensors` as a dict of tensor name to numpy array (torch and DLPack tensors viewed, not copied);
    MalformedRequest when it is not a mapping, or holds a tensor that is not in host memory."""
    if not isinstance(tensors, Mapping):
        raise MalformedRequest(
            f"{argument} is a {type(tensors).__name__}: pass a mapping of tensor name to array, {{name: array, ...}} "
            "(the names are the contract's: [c.name for c in client.get_contract(model).carried])",
            model,
        )
    return {name: host_array(model, name, value) for name, value in tensors.items()}


def host_array(model: str, name: str, value: object) -> object:
    if isinstance(value, np.ndarray):
        return value
    torch = sys.modules.get("torch")  # (a torch tensor exists only where torch is imported already)
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise MalformedRequest(
                f"`{name}` is a {value.device} tensor: the client sends and fills host memory (tensor.cpu() first)",
                model,
            )
        from ._torch import to_numpy

        return to_numpy(value)
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (TypeError, ValueError, BufferError, RuntimeError):
            return value  # (numpy cannot read it: the contract's check names what it is)
    return value
