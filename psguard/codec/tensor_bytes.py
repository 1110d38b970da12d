"""A tensor as bytes: its C-order little-endian view, string tensors serialised (uint64 lengths, then the bytes),
and the CRC32C over them; one layout for a spool capture, a tier file and a store chunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import crc32c as _crc32c
import numpy as np


def crc32c(data: bytes | memoryview) -> int:
    return int(_crc32c.crc32c(data))


def byte_view(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (reads can land straight in the array)."""
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def as_le_bytes(arr: np.ndarray) -> memoryview:
    """A zero-copy byte view of ``arr`` in C order, little-endian (copying only when it must)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return byte_view(np.ascontiguousarray(arr))


def tensor_bytes(value: np.ndarray) -> memoryview:
    """``value``'s bytes as stored: serialised strings, or the little-endian C-order view of numbers."""
    return memoryview(serialize_strings(value)) if value.dtype.kind in "OSU" else as_le_bytes(value)


def serialize_strings(arr: np.ndarray) -> bytes:
    flat = [x if isinstance(x, bytes) else str(x).encode() for x in arr.reshape(-1)]
    lengths = np.array([len(x) for x in flat], dtype="<u8")
    return lengths.tobytes() + b"".join(flat)


def deserialize_strings(blob: bytes | memoryview, shape: Sequence[int]) -> np.ndarray:
    n = math.prod(shape)
    if len(blob) < 8 * n:
        raise ValueError("string tensor blob shorter than its length table")
    lengths = np.frombuffer(blob, dtype="<u8", count=n)
    out = np.empty(n, dtype=object)
    pos = 8 * n
    for i, ln in enumerate(lengths.tolist()):
        out[i] = bytes(blob[pos : pos + ln])
        pos += ln
    if pos != len(blob):
        raise ValueError("string tensor blob length does not match its length table")
    return out.reshape(tuple(shape))
