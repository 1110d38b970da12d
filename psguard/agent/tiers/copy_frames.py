"""The peer copies' wire: frames (a JSON header and raw arrays, no pickle) and the row digests that verify a copy.

A frame is ``MAGIC``, a little-endian u32 header length, a JSON header (``arrays``: each array's dtype and shape;
``crc32`` of the payload, or null for rows checked against their owner's digests), then the arrays' bytes, C order.

A digest (:func:`rows_digest`) is a sum over rows modulo 2**64 of a hash of each row's index and bytes, so a delta
updates it from the rows it changes; owners and holders of any version must agree on it bit for bit.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from psguard.codec.dtypes import dtype_from_name, dtype_name
from psguard.errors import CorruptCheckpointError
from psguard.handoff.native import digest_function

MAGIC = b"PSGCOPY1"
MAX_HEADER = 4 << 20
MASK = (1 << 64) - 1
_BLOCK_ROWS = 1 << 15
_BLOCK_BYTES = 2 << 20
_PIECE_BYTES = 1 << 20  # a fetch's pieces (read_frame_into): hashed while in cache


# ---------------------------------------------------------------------------------------------------- digests
@cache
def _weights(words: int) -> np.ndarray:
    """``words + 1`` fixed odd 64-bit weights, splitmix64's sequence from a seed per width (not ``numpy.random``,
    whose import at a fetch held its threads on its lock)."""
    with np.errstate(over="ignore"):
        seed = np.uint64(0x5053475541524400 + words)
        steps = np.arange(1, words + 2, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        return _mix(seed + steps) | np.uint64(1)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place: a row's sum of products becomes a well-spread 64-bit value."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def rows_digest(values: np.ndarray, ids: np.ndarray | None = None, *, first: int = 0) -> int:
    """The digest of rows ``values`` (row ``ids``, default ``first..first+n-1``). Each row's term hashes its index
    with its bytes, so a moved row shows. In C when built (the GIL released), else numpy: the same value."""
    n = int(values.shape[0]) if values.ndim else 1
    if ids is not None and (len(ids) != n or first):
        raise ValueError(f"{len(ids)} row ids for {n} rows" if len(ids) != n else "row ids and a first row both given")
    if n == 0:
        return 0
    flat = np.ascontiguousarray(values).reshape(n, -1).view(np.uint8)
    width = flat.shape[1]
    native = digest_function()
    if native is not None and width and width % 4 == 0:
        w = _weights(width // 4)
        rid = None if ids is None else np.ascontiguousarray(ids, dtype=np.int64)
        return int(
            native(flat.ctypes.data, n, width // 4, None if rid is None else rid.ctypes.data, first, w.ctypes.data)
        )
    return _numpy_digest(flat, ids, first)


def _numpy_digest(flat: np.ndarray, ids: np.ndarray | None, first: int = 0) -> int:
    """:func:`rows_digest` of ``flat`` (rows of bytes, C order) in numpy: where the C digest is not built, and
    for rows whose width is not a whole number of 32-bit words (zero-padded here)."""
    n, width = flat.shape
    pad = (-width) % 4
    w = _weights((width + pad) // 4)
    # Blocks of about _BLOCK_BYTES stay in cache; a matrix-vector product sums each row's products without a
    # temporary of them all (integer arithmetic modulo 2**64 either way).
    block_rows = min(_BLOCK_ROWS, max(2048, _BLOCK_BYTES // (8 * len(w))))
    total = 0
    for lo in range(0, n, block_rows):
        block = flat[lo : lo + block_rows]
        if pad:
            block = np.concatenate([block, np.zeros((block.shape[0], pad), np.uint8)], axis=1)
        h = block.view(np.uint32).astype(np.uint64) @ w[:-1]
        rid = (
            np.arange(first + lo, first + lo + block.shape[0], dtype=np.uint64)
            if ids is None
            else ids[lo : lo + block.shape[0]].astype(np.uint64)
        )
        h += (rid + np.uint64(1)) * w[-1]
        total = (total + int(_mix(h).sum(dtype=np.uint64))) & MASK
    return total


def delta_digest(before: int, ids: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    return (before - rows_digest(old, ids) + rows_digest(new, ids)) & MASK


# ---------------------------------------------------------------------------------------------------- frames
def frame_parts(
    header: Mapping[str, Any], arrays: Sequence[np.ndarray] = (), *, crc: bool = True
) -> list[bytes | memoryview]:
    """One message as the pieces sent in order: the head, then each array's own bytes (views, not copies).
    ``crc=False``: ``"crc32": null``, for rows whose reader checks them against their owner's digests anyway."""
    chunks = [np.ascontiguousarray(a) for a in arrays]
    check = 0
    for c in chunks if crc else ():
        check = zlib.crc32(c.data.cast("B"), check)
    arrays_doc = [{"dtype": dtype_name(c.dtype), "shape": list(c.shape)} for c in chunks]
    head = json.dumps({**header, "arrays": arrays_doc, "crc32": check if crc else None}, allow_nan=False).encode()
    return [MAGIC + struct.pack("<I", len(head)) + head, *(c.data.cast("B") for c in chunks)]


def encode_frame(header: Mapping[str, Any], arrays: Sequence[np.ndarray] = ()) -> bytes:
    """One message in one bytes (:func:`frame_parts` joined)."""
    return b"".join(frame_parts(header, arrays))


@dataclass
class Frame:
    """A frame as :func:`frame_parts` of arrays valid until ``release`` (an export lease): the HTTP handler writes
    the parts, then releases; ``bytes(frame)`` joins and releases."""

    parts: list[bytes | memoryview]
    release: Callable[[], None]

    def __bytes__(self) -> bytes:
        try:
            return b"".join(self.parts)
        finally:
            self.release()


def _frame_header(prefix: bytes, read_head: Callable[[int], bytes]) -> tuple[dict[str, Any], int]:
    """The header of a frame that starts with ``prefix`` (magic and header length), its JSON read by
    ``read_head(length)``, and where the arrays start; :class:`CorruptCheckpointError` for anything malformed."""
    if len(prefix) < len(MAGIC) + 4 or not prefix.startswith(MAGIC):
        raise CorruptCheckpointError("peer copy frame: bad magic")
    (hlen,) = struct.unpack_from("<I", prefix, len(MAGIC))
    if hlen > MAX_HEADER:
        raise CorruptCheckpointError("peer copy frame: bad header length")
    head = read_head(hlen)
    if len(head) != hlen:
        raise CorruptCheckpointError("peer copy frame: bad header length")
    try:
        header = json.loads(head)
    except ValueError as e:
        raise CorruptCheckpointError(f"peer copy frame: header is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise CorruptCheckpointError("peer copy frame: header without arrays")
    return header, len(prefix) + hlen


def _array_specs(header: Mapping[str, Any]) -> list[tuple[np.dtype[Any], tuple[int, ...], int]]:
    """Each array's dtype, shape and byte count, as the header says."""
    specs = []
    for spec in header["arrays"]:
        try:
            dtype = dtype_from_name(str(spec["dtype"]))
            shape = tuple(int(x) for x in spec["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"peer copy frame: bad array spec {spec!r}: {e}") from None
        if any(x < 0 for x in shape):
            raise CorruptCheckpointError(f"peer copy frame: bad shape {shape}")
        specs.append((dtype, shape, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize))
    return specs


def decode_frame(data: bytes) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The header and read-only arrays of a frame; :class:`CorruptCheckpointError` for anything malformed."""
    start = len(MAGIC) + 4
    header, offset = _frame_header(data[:start], lambda n: data[start : start + n])
    view = memoryview(data)
    arrays: list[np.ndarray] = []
    crc = 0
    checked = header.get("crc32") is not None
    for dtype, shape, nbytes in _array_specs(header):
        if offset + nbytes > len(data):
            raise CorruptCheckpointError("peer copy frame: truncated")
        chunk = view[offset : offset + nbytes]
        if checked:
            crc = zlib.crc32(chunk, crc)
        arrays.append(np.frombuffer(chunk, dtype=dtype).reshape(shape))
        offset += nbytes
    if offset != len(data):
        raise CorruptCheckpointError("peer copy frame: bytes after the last array")
    if checked and crc != header.get("crc32"):
        raise CorruptCheckpointError("peer copy frame: CRC32 mismatch (damaged in transit)")
    return header, arrays


def read_frame_into(
    stream: io.BufferedIOBase,
    out: np.ndarray,
    take: Callable[[int, np.ndarray], None] | None = None,
    *,
    piece_bytes: int = _PIECE_BYTES,
) -> dict[str, Any]:
    """Read a frame from ``stream`` as it arrives, its one array's bytes into ``out`` (its dtype and shape; left
    alone by a frame without arrays), checked as :func:`decode_frame` checks; the header. ``take(row, rows)``:
    the rows pass through a buffer of ``piece_bytes`` instead, each piece handed to ``take`` while in cache."""
    start = len(MAGIC) + 4
    header, _ = _frame_header(stream.read(start), stream.read)
    specs = _array_specs(header)
    crc = 0
    checked = header.get("crc32") is not None
    if specs:
        dtype, shape, nbytes = specs[0]
        if len(specs) != 1 or dtype != out.dtype or shape != out.shape or not out.flags.c_contiguous:
            raise CorruptCheckpointError(
                f"peer copy frame: {[(str(d), s) for d, s, _ in specs]} does not fit {out.dtype} {out.shape}"
            )
        if nbytes and take is not None:
            rows = out.shape[0] if out.ndim else 1
            step = max(1, piece_bytes // max(1, nbytes // max(1, rows)))
            buffer = np.empty((min(step, rows), *out.shape[1:]), dtype=out.dtype)
            for row in range(0, rows, step):
                piece = buffer[: min(step, rows - row)]
                _read_exactly(stream, piece.data.cast("B"))
                if checked:
                    crc = zlib.crc32(piece.data.cast("B"), crc)
                take(row, piece)
        elif nbytes:
            _read_exactly(stream, out.data.cast("B"))
            if checked:
                crc = zlib.crc32(out.data.cast("B"))
    if stream.read(1):
        raise CorruptCheckpointError("peer copy frame: bytes after the last array")
    if checked and crc != header.get("crc32"):
        raise CorruptCheckpointError("peer copy frame: CRC32 mismatch (damaged in transit)")
    return header


def _read_exactly(stream: io.BufferedIOBase, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = stream.readinto(view[got:])
        if not n:
            raise CorruptCheckpointError("peer copy frame: truncated")
        got += n


def delta_rows(
    it: Iterator[np.ndarray], name: str, kind: object, rows: int, what: str
) -> tuple[np.ndarray, np.ndarray]:
    """The next row ids and values of a delta frame for tensor ``name`` of ``rows`` rows, checked."""
    ids, values = next(it, None), next(it, None)
    if ids is None or values is None or kind != "rows":
        raise CorruptCheckpointError(f"{what} delta: bad update of {name}")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (ids[0] < 0 or ids[-1] >= rows or np.any(np.diff(ids) <= 0)):
        raise CorruptCheckpointError(f"{what} delta: bad row ids for {name}")
    return ids, values


def digests_from(doc: Any) -> dict[str, int]:
    try:
        return {str(k): int(v) & MASK for k, v in doc.items()}
    except (AttributeError, TypeError, ValueError):
        raise CorruptCheckpointError("peer copy: bad digests") from None


def copy_header(
    step: int | None, token: str | None, metadata: Any, tensors: Any, digests: Mapping[str, int]
) -> dict[str, Any]:
    """What describes a copy's state in a frame's header: a whole's ``begin``, a ``delta``, a holder's answer."""
    # Digests as strings: JSON numbers lose 64-bit precision in some readers.
    digests_doc = {k: str(v) for k, v in digests.items()}
    return {"step": step, "token": token, "metadata": metadata, "tensors": tensors, "digests": digests_doc}
