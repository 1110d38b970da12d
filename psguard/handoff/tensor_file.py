"""The tensor files a PS's capture writes for its TF-less agent: serialized ``TensorProto`` (the changed rows,
their ids and fingerprints; a shard sent whole goes as a one-tensor bundle, :mod:`psguard.handoff.tensor_bundle`).

``tf.io.serialize_tensor`` + ``tf.io.write_file`` is the file I/O a function on a PS device can do, and the
agent does not import TensorFlow, so this module reads the three fields a dense numeric tensor uses:

    field 1 (varint)  dtype        TF's DataType enum
    field 2 (bytes)   tensor_shape TensorShapeProto: field 2 (bytes) dim { field 1 (varint) size }
    field 4 (bytes)   tensor_content  the values, C order, little-endian

The header is checked against the file's size before anything is allocated, so a truncated or hostile file is a
:class:`~psguard.errors.CorruptCheckpointError`, never a huge allocation. String tensors travel through the
chief's spool instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from psguard.codec.dtypes import dtype_from_name
from psguard.codec.tensor_bytes import byte_view
from psguard.errors import CorruptCheckpointError
from psguard.local_files import open_regular

#: TF DataType enum value -> the dtype name a manifest records (tensorflow/core/framework/types.proto).
TF_DTYPES: dict[int, str] = {
    1: "float32",
    2: "float64",
    3: "int32",
    4: "uint8",
    5: "int16",
    6: "int8",
    9: "int64",
    10: "bool",
    14: "bfloat16",
    17: "uint16",
    19: "float16",
    22: "uint32",
    23: "uint64",
    8: "complex64",
    18: "complex128",
}
_MAX_RANK = 32
_MAX_HEADER = 1024  # dtype + a shape of at most 32 dims: a few hundred bytes


def _read_varint(buf: bytes | memoryview, pos: int, end: int, what: str) -> tuple[int, int]:
    value = 0
    for shift in range(0, 64, 7):
        if pos >= end:
            raise CorruptCheckpointError(f"{what}: truncated tensor header")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise CorruptCheckpointError(f"{what}: a varint of more than 64 bits in the tensor header")


def _parse_header(head: bytes, size: int, what: str) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype name, shape, content offset, content length) of a serialized TensorProto of ``size`` bytes.

    ``head`` is the file's first bytes (at most ``_MAX_HEADER``); the content must be the last field, as
    TensorFlow writes it, so the rest of the file is never parsed.
    """
    pos, dtype_num, shape = 0, None, None
    end = len(head)
    content = (size, 0)
    while pos < size:
        key, pos = _read_varint(head, pos, end, what)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(head, pos, end, what)
            if field == 1:
                dtype_num = value
            continue
        if wire != 2:
            raise CorruptCheckpointError(f"{what}: unexpected field {field} (wire type {wire}) in a tensor file")
        length, pos = _read_varint(head, pos, end, what)
        if length > size - pos:
            raise CorruptCheckpointError(f"{what}: a field claims {length} bytes past the end of the file (truncated?)")
        if field == 4:
            if pos + length != size:
                raise CorruptCheckpointError(f"{what}: bytes after the tensor's content")
            content = (pos, length)
            break
        if field != 2 or pos + length > end:
            raise CorruptCheckpointError(f"{what}: field {field} in a tensor file (only dense numeric tensors)")
        shape = _parse_shape(head[pos : pos + length], what)
        pos += length
    if dtype_num not in TF_DTYPES or shape is None:
        raise CorruptCheckpointError(f"{what}: tensor file without a known dtype ({dtype_num}) or a shape")
    return TF_DTYPES[dtype_num], shape, content[0], content[1]


def _parse_shape(buf: bytes | memoryview, what: str) -> tuple[int, ...]:
    dims: list[int] = []
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos, end, what)
        if key == 0x18 or key == 0x08:  # unknown_rank (3) or a stray varint: not for a stored tensor
            raise CorruptCheckpointError(f"{what}: tensor shape of unknown rank")
        if key != 0x12:
            raise CorruptCheckpointError(f"{what}: unexpected field in a tensor shape")
        length, pos = _read_varint(buf, pos, end, what)
        sub_end = pos + length
        if sub_end > end:
            raise CorruptCheckpointError(f"{what}: truncated tensor shape")
        size = 0
        while pos < sub_end:
            k, pos = _read_varint(buf, pos, sub_end, what)
            v, pos = _read_varint(buf, pos, sub_end, what) if k & 7 == 0 else (0, pos)
            if k == 0x08:
                size = v
            elif k & 7 != 0:
                raise CorruptCheckpointError(f"{what}: unexpected field in a tensor dimension")
        dims.append(size)
        if len(dims) > _MAX_RANK:
            raise CorruptCheckpointError(f"{what}: a tensor of more than {_MAX_RANK} dimensions")
    return tuple(dims)


def open_capture_file(path: Path, what: str, noun: str) -> int:
    """A read-only descriptor of a file a capture left, a regular file opened without blocking and never through a
    link (:func:`psguard.local_files.open_regular`); a missing, unreadable or other one (a FIFO) is a
    :class:`~psguard.errors.CorruptCheckpointError` naming ``what`` and ``noun``."""
    try:
        return open_regular(path, f"{what}: the {noun}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{what}: {noun} missing") from None
    except OSError as e:
        raise CorruptCheckpointError(f"{what}: cannot open the {noun}: {e}") from None


def read_tensor_file(
    path: Path,
    *,
    dtype: str | None = None,
    shape: tuple[int, ...] | None = None,
    what: str = "",
    allocate: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray | None] | None = None,
) -> np.ndarray:
    """The array in a tensor file, checked against the ``dtype``/``shape`` expected (if given) and the file's real
    size before anything is allocated. ``allocate(shape, dtype)`` gives the C-order array to read into (a PS agent's
    tier file), or None for a new one."""
    what = what or str(path)
    fd = open_capture_file(path, what, "tensor file")
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        head = f.read(min(size, _MAX_HEADER))
        name, got_shape, offset, length = _parse_header(head, size, what)
        if dtype is not None and name != dtype:
            raise CorruptCheckpointError(f"{what}: dtype {name}, expected {dtype}")
        if shape is not None and got_shape != tuple(shape):
            raise CorruptCheckpointError(f"{what}: shape {list(got_shape)}, expected {list(shape)}")
        np_dtype = dtype_from_name(name)
        if math.prod(got_shape) * np_dtype.itemsize != length:
            raise CorruptCheckpointError(f"{what}: {length} bytes of content for a {name}{list(got_shape)} tensor")
        out = allocate(got_shape, np_dtype) if allocate is not None else None
        out = np.empty(got_shape, dtype=np_dtype) if out is None else out
        view = byte_view(out)
        f.seek(offset)
        got = f.readinto(view)
        if got != length:
            raise CorruptCheckpointError(f"{what}: the tensor file shrank while being read")
    return out  # psguard runs on little-endian hosts only (store/chunks.py)
