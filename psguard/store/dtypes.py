"""Dtype names as a manifest records them, and the logical size they imply.

Shared by the manifest (which validates what it reads) and the chunk codec (which writes and reads bytes);
neither needs the other for this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

__all__ = ["STRING", "dtype_from_name", "dtype_name", "logical_nbytes"]


class _Sized(Protocol):
    @property
    def size(self) -> int: ...


STRING = "string"
_EXTENDED = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4")


def dtype_name(dtype: np.dtype) -> str:  # type: ignore[type-arg]
    """The name a manifest records; TF's string tensors arrive as numpy ``object`` arrays of bytes."""
    if dtype.kind in ("O", "S", "U"):
        return STRING
    return str(dtype.name)


def dtype_from_name(name: str) -> np.dtype:  # type: ignore[type-arg]
    if name == STRING:
        return np.dtype(object)
    if name in _EXTENDED:
        import ml_dtypes  # ships with TensorFlow; only needed for these types

        return np.dtype(getattr(ml_dtypes, name))  # type: ignore[no-any-return]
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}") from None


def logical_nbytes(dtype: str, shape: Sequence[int], chunks: Sequence[_Sized] = ()) -> int:
    if dtype == STRING:
        return sum(c.size for c in chunks)
    return math.prod(shape) * dtype_from_name(dtype).itemsize
