"""Dtype names as a manifest and a spool capture record them, the logical size they imply, and the most
dimensions a shape may have: shared by the manifest, the spool and the chunk and tier codecs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class _Sized(Protocol):
    @property
    def size(self) -> int: ...


STRING = "string"
_EXTENDED = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4")
_NUMPY = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip
#: Every dtype a checkpoint may hold (docs/storage-format.md, "Dtypes"). Anything else (``object``, ``O``,
#: ``datetime64``, a structured dtype) could never be restored into a TensorFlow variable, so a manifest or a
#: capture naming it is refused when read, and a save of it when written.
DTYPE_NAMES: frozenset[str] = frozenset((*_NUMPY, *_EXTENDED, STRING))
#: Most dimensions a tensor may have (numpy's own limit is 32 in 1.x, 64 in 2.x).
MAX_DIMS = 32
_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int4": 1, "uint4": 1}


def dtype_name(dtype: np.dtype) -> str:  # type: ignore[type-arg]
    """The name a manifest records; TF's string tensors arrive as numpy ``object`` arrays of bytes."""
    return STRING if dtype.kind in ("O", "S", "U") else str(dtype.name)


def dtype_from_name(name: str) -> np.dtype:  # type: ignore[type-arg]
    """The numpy dtype of an allowed name (:data:`DTYPE_NAMES`); ValueError for any other."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name[:40]!r} (not one psguard stores)")
    if name == STRING:
        return np.dtype(object)
    if name in _EXTENDED:
        import ml_dtypes  # ships with TensorFlow; only needed for these types

        return np.dtype(getattr(ml_dtypes, name))  # type: ignore[no-any-return]
    return np.dtype(name)


def itemsize_of(name: str) -> int:
    """Bytes per element of an allowed numeric dtype name, without importing ml_dtypes (8 for ``string``: the
    length table's entry, the least a string element takes on storage)."""
    if name == STRING:
        return 8
    return _ITEMSIZE[name] if name in _ITEMSIZE else int(np.dtype(name).itemsize)


def logical_nbytes(dtype: str, shape: Sequence[int], chunks: Sequence[_Sized] = ()) -> int:
    if dtype == STRING:
        return sum(c.size for c in chunks)
    return math.prod(shape) * dtype_from_name(dtype).itemsize
