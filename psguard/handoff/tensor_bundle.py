"""One tensor as a TensorFlow checkpoint bundle, written without TensorFlow: a PS agent's restore files.

Of the ops that read a file on a PS device, only ``RestoreV2`` reads the values straight into the tensor it
returns (docs/design.md, "Restore on the PS"). This module writes the two files itself:

- ``<prefix>.data-00000-of-00001``: the values, C order, little-endian (what :func:`write_array` writes);
- ``<prefix>.index``: a table in LevelDB's format (no compression, every block with a type byte and a masked
  CRC32C) holding two entries, ``""`` -> ``BundleHeaderProto`` (one shard, little-endian, version 1) and
  :data:`BUNDLE_KEY` -> ``BundleEntryProto`` (dtype, shape, size, masked CRC32C of the data file).

The bytes are exactly those ``SaveV2`` writes for the same tensor (tested), and ``RestoreV2`` checks the data's
CRC32C, size and dtype, so a damaged or mismatched file fails the load before anything is assigned.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from psguard.codec.dtypes import dtype_from_name, dtype_name
from psguard.codec.tensor_bytes import byte_view, crc32c
from psguard.errors import CorruptCheckpointError
from psguard.handoff.spool import write_array
from psguard.handoff.tensor_file import TF_DTYPES, open_capture_file

#: The name of the one tensor in a bundle (what ``RestoreV2`` is asked for).
BUNDLE_KEY = "t"
_DT_ENUM = {name: number for number, name in TF_DTYPES.items()}
_TABLE_MAGIC = 0xDB4775248B80FB57  # LevelDB's, as TensorFlow's table format keeps it
_FOOTER_HANDLES = 40  # two block handles, padded to their maximum encoded length
_MAX_INDEX = 4096  # a one-tensor index of a shape of at most 32 dims: a few hundred bytes


def bundle_files(prefix: str | Path) -> tuple[Path, Path]:
    """(index file, data file) of the bundle at ``prefix``."""
    return Path(f"{prefix}.index"), Path(f"{prefix}.data-00000-of-00001")


def write_bundle(prefix: str | Path, value: np.ndarray) -> None:
    """Write ``value`` (a numeric array) as the bundle at ``prefix``: data first, then the index that names it."""
    name = dtype_name(value.dtype)
    if name not in _DT_ENUM:
        raise ValueError(f"a restore file cannot hold dtype {name} (numeric tensors only)")
    data = bundle_files(prefix)[1]
    ref = write_array(data.parent, data.name, value)
    write_index(prefix, value.dtype, value.shape, ref["size"], ref["crc32c"])


def write_index(prefix: str | Path, dtype: np.dtype[Any], shape: tuple[int, ...], size: int, crc: int) -> None:
    """Write the index of the bundle at ``prefix`` for a data file already there: ``size`` bytes of a ``dtype``
    tensor of ``shape`` whose CRC32C (unmasked) is ``crc``. A PS agent whose tier already lives in bundle data files
    writes only this for a restore; ``RestoreV2`` fails the load when it does not describe the data's bytes."""
    table = index_bytes(dtype, shape, size, crc)
    index = bundle_files(prefix)[0]
    fd = os.open(index, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(table)


def index_bytes(dtype: np.dtype[Any], shape: tuple[int, ...], size: int, crc: int) -> bytes:
    """The index file of a one-tensor bundle, byte for byte as ``SaveV2`` writes it (see :func:`write_index`)."""
    name = dtype_name(np.dtype(dtype))
    if name not in _DT_ENUM:
        raise ValueError(f"a restore file cannot hold dtype {name} (numeric tensors only)")
    # proto3, as TensorFlow serializes it: a field at its default (0) is left out.
    dims = b"".join(_field_bytes(2, _field_varint(1, d) if d else b"") for d in shape)
    entry = (
        _field_varint(1, _DT_ENUM[name])
        + _field_bytes(2, dims)
        + (_field_varint(5, size) if size else b"")
        + _tag(6, 5)
        + _masked(crc).to_bytes(4, "little")
    )
    header = _field_varint(1, 1) + _field_bytes(3, _field_varint(1, 1))  # num_shards 1, version {producer 1}
    key = BUNDLE_KEY.encode()
    table = bytearray()
    data_block = _block(table, [(b"", header), (key, entry)])
    meta_block = _block(table, [])
    index_block = _block(table, [(_successor(key), _handle(data_block))])
    footer = (_handle(meta_block) + _handle(index_block)).ljust(_FOOTER_HANDLES, b"\0")
    table += footer + _TABLE_MAGIC.to_bytes(8, "little")
    return bytes(table)


def read_bundle(
    prefix: str | Path,
    *,
    dtype: str,
    shape: tuple[int, ...],
    what: str = "",
    allocate: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray | None] | None = None,
) -> np.ndarray:
    """The ``dtype`` tensor of ``shape`` in the one-tensor bundle ``SaveV2`` wrote at ``prefix`` (a PS's whole
    shard), read without TensorFlow and verified: the index must be byte for byte the one :func:`index_bytes` makes
    for this dtype, shape, size and the data's CRC32C. ``allocate`` as in
    :func:`~psguard.handoff.tensor_file.read_tensor_file`."""
    what = what or str(prefix)
    if dtype not in _DT_ENUM:
        raise CorruptCheckpointError(f"{what}: a bundle of dtype {dtype} (numeric tensors only)")
    index, data = bundle_files(prefix)
    np_dtype = dtype_from_name(dtype)
    size = math.prod(shape) * np_dtype.itemsize
    fd = open_capture_file(data, what, "bundle data file")
    with os.fdopen(fd, "rb") as f:
        got = os.fstat(fd).st_size
        if got != size:
            raise CorruptCheckpointError(f"{what}: {got} bytes of data for a {dtype}{list(shape)} tensor ({size})")
        out = allocate(shape, np_dtype) if allocate is not None else None
        out = np.empty(shape, dtype=np_dtype) if out is None else out
        if size and f.readinto(byte_view(out)) != size:
            raise CorruptCheckpointError(f"{what}: the bundle data file shrank while being read")
    with os.fdopen(open_capture_file(index, what, "bundle index"), "rb") as f:
        table = f.read(_MAX_INDEX + 1)
    if table != index_bytes(np_dtype, shape, size, crc32c(byte_view(out)) if size else 0):
        raise CorruptCheckpointError(f"{what}: the bundle index does not describe its data (damaged or another tensor)")
    return out


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _field_varint(field: int, value: int) -> bytes:
    return _tag(field, 0) + _varint(value)


def _field_bytes(field: int, value: bytes) -> bytes:
    return _tag(field, 2) + _varint(len(value)) + value


def _masked(crc: int) -> int:
    """LevelDB's masked CRC32C (a CRC stored beside the data it covers must not look like that data's)."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _block(table: bytearray, entries: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """Append a block of ``entries`` and its trailer to ``table`` as LevelDB's block builder lays it out; return its
    handle (offset, size without the trailer). A bundle's blocks hold at most two entries, the first key empty: one
    restart point, and no key shares a prefix with the one before it."""
    body = b"".join(_varint(0) + _varint(len(key)) + _varint(len(value)) + key + value for key, value in entries)
    body += (0).to_bytes(4, "little") + (1).to_bytes(4, "little")  # the restart point (offset 0) and their count
    handle = (len(table), len(body))
    body += b"\0"  # no compression
    table += body + _masked(crc32c(body)).to_bytes(4, "little")
    return handle


def _handle(handle: tuple[int, int]) -> bytes:
    return _varint(handle[0]) + _varint(handle[1])


def _successor(key: bytes) -> bytes:
    """The shortest key after ``key`` (the index block's key for the last data block, as LevelDB picks it)."""
    for i, byte in enumerate(key):
        if byte != 0xFF:
            return key[:i] + bytes([byte + 1])
    return key
