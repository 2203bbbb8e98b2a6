"""The element types a contract may declare, by the numpy name that manifests and the wire use.

bfloat16 and the float8 kinds come from ml_dtypes, the library JAX and TensorFlow use for them, so arrays of those
types are ordinary numpy arrays on both sides.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int32": np.dtype(np.int32),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
}
"""Every dtype name a contract may use; little-endian, as numpy lays them out on every platform we serve."""


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a contract dtype name; KeyError for a name outside DTYPES."""
    return DTYPES[name]


def dtype_name(dtype: np.dtype) -> str | None:
    """The contract name of a numpy dtype, or None if contracts cannot declare it."""
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    return None
