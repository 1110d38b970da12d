"""Tensors <-> content-addressed chunks.

A numeric tensor is stored as its C-order little-endian bytes cut at row boundaries into chunks of at most
``chunk_bytes`` (one row at least), so an unchanged region of a table yields the same chunk and is stored once;
string tensors are serialised (:mod:`psguard.codec.tensor_bytes`) and cut the same way; changed rows go as
segments (an int64 id chunk and a chunk of those rows). Every chunk is named by its SHA-256 and carries its
CRC32C in the manifest: readers check size and CRC32C of every chunk, ``verify`` also the SHA-256.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psguard.codec.tensor_bytes import as_le_bytes, byte_view, crc32c, tensor_bytes
from psguard.errors import CorruptCheckpointError, ObjectNotFoundError, StorageError, UnreadableChunkError
from psguard.storage.base import Backend
from psguard.store.manifest import ChunkRef, Segment, chunk_key
from psguard.tensors import FullStream

#: A reader allocates a buffer from the sizes a manifest *claims* only up to this many bytes at once; for more, it
#: first asks the storage for the objects' real sizes (:meth:`ChunkReader.check_claims`), so a hostile claim of
#: 10^12 bytes is refused before anything is allocated. Real chunks are 8 MiB (one row at least).
LARGE_READ_BYTES = 64 << 20


def row_bytes(shape: Sequence[int], itemsize: int) -> int:
    return max(1, math.prod(shape[1:]) * itemsize)


def split_ranges(total: int, unit: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Byte ranges of at most ``chunk_bytes`` (but at least one ``unit``), aligned to ``unit``."""
    step = max(1, chunk_bytes // unit) * unit
    for start in range(0, total, step):
        yield start, min(start + step, total)


@dataclass
class WriteStats:
    chunks_written: int = 0
    bytes_written: int = 0
    chunks_deduplicated: int = 0
    bytes_deduplicated: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, size: int, written: bool) -> None:
        with self._lock:
            if written:
                self.chunks_written += 1
                self.bytes_written += size
            else:
                self.chunks_deduplicated += 1
                self.bytes_deduplicated += size


class ChunkWriter:
    """Hashes and uploads chunks in parallel with a bound on the bytes in flight; digests in ``known`` (the
    parent chain's) are not uploaded again. Futures come back in order, so a tensor's chunk list keeps its order."""

    def __init__(self, backend: Backend, pool: ThreadPoolExecutor, *, inflight_bytes: int, known: set[str]) -> None:
        self.backend = backend
        self.pool = pool
        self.known = known
        self.stats = WriteStats()
        self._budget = threading.Condition()
        self._available = inflight_bytes
        self._limit = inflight_bytes
        self._futures: list[Future[ChunkRef]] = []
        self._failure: BaseException | None = None

    def _acquire(self, n: int) -> None:
        n = min(n, self._limit)  # one oversized chunk may still go alone
        with self._budget:
            self._budget.wait_for(lambda: self._available >= n)
            self._available -= n

    def _release(self, n: int) -> None:
        with self._budget:
            self._available += min(n, self._limit)
            self._budget.notify_all()

    def submit(self, data: memoryview | bytes) -> Future[ChunkRef]:
        self._acquire(len(data))
        return self._start(data)

    def _start(self, data: memoryview | bytes) -> Future[ChunkRef]:
        """Upload ``data``, whose bytes were acquired from the window (released when its upload ends)."""
        size = len(data)

        def work() -> ChunkRef:
            try:
                if self._failure is not None:
                    raise self._failure  # one chunk gave up: the save has failed, don't wait out every other
                digest = hashlib.sha256(data).hexdigest()
                ref = ChunkRef(digest, size, crc32c(data))
                if digest in self.known:
                    self.stats.add(size, written=False)
                else:
                    self.backend.put(chunk_key(digest), data)
                    self.stats.add(size, written=True)
                return ref
            except BaseException as e:
                if self._failure is None:
                    self._failure = e
                raise
            finally:
                self._release(size)

        fut = self.pool.submit(work)
        self._futures.append(fut)
        return fut

    def submit_tensor(self, value: np.ndarray, chunk_bytes: int) -> list[Future[ChunkRef]]:
        buf = tensor_bytes(value)
        strings = value.dtype.kind in "OSU"  # cut by bytes, not rows
        unit = 1 if strings else row_bytes(value.shape, value.dtype.itemsize) if value.ndim else len(buf) or 1
        return [self.submit(buf[a:b]) for a, b in split_ranges(len(buf), unit, chunk_bytes)]

    def submit_stream(self, stream: FullStream, chunk_bytes: int) -> list[Future[ChunkRef]]:
        """As :meth:`submit_tensor`, the same chunks, but each read from ``stream`` just before its upload:
        the bytes held at once are bounded by ``inflight_bytes``, not by the tensor's size."""
        unit = row_bytes(stream.shape, stream.dtype.itemsize) if stream.shape else stream.nbytes or 1
        futures = []
        for a, b in split_ranges(stream.nbytes, unit, chunk_bytes):
            self._acquire(b - a)  # before the read: the window bounds the bytes read, not only those uploading
            try:
                data = as_le_bytes(stream.read(a // unit, b // unit))
            except BaseException:
                self._release(b - a)
                raise
            futures.append(self._start(data))
        return futures

    def submit_rows(self, ids: np.ndarray, values: np.ndarray, chunk_bytes: int) -> list[Future[Segment]]:
        ids = np.ascontiguousarray(ids, dtype="<i8")
        rb = row_bytes(values.shape, values.dtype.itemsize)
        per = max(1, chunk_bytes // rb)
        ranges = ((a, min(a + per, len(ids))) for a in range(0, len(ids), per))
        return [
            _combine(self.submit(byte_view(ids[a:b])), self.submit(as_le_bytes(values[a:b])), b - a) for a, b in ranges
        ]

    def wait(self) -> None:
        """Block until every submitted chunk is stored; re-raise the first failure."""
        for f in self._futures:
            f.result()


def _combine(f_ids: Future[ChunkRef], f_vals: Future[ChunkRef], count: int) -> Future[Segment]:
    out: Future[Segment] = Future()

    def done(_: object) -> None:
        if f_ids.done() and f_vals.done() and not out.done():
            try:
                out.set_result(Segment(count, f_ids.result(), f_vals.result()))
            except BaseException as e:  # the upload's error travels to whoever waits on the segment
                out.set_exception(e)

    f_ids.add_done_callback(done)
    f_vals.add_done_callback(done)
    return out


class ChunkReader:
    """Reads chunks, checking size and CRC32C always and the SHA-256 when ``verify_hash``. A chunk the storage
    does not have is corrupt; one it fails to read is :class:`UnreadableChunkError` naming checkpoint and chunk, so a
    restore falls back past it as past a corrupt one."""

    def __init__(self, backend: Backend, *, checkpoint: str, verify_hash: bool = False) -> None:
        self.backend = backend
        self.checkpoint = checkpoint
        self.verify_hash = verify_hash

    def _corrupt(self, ref: ChunkRef, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"checkpoint {self.checkpoint}: chunk {ref.hash} {what}", checkpoint=self.checkpoint, chunk=ref.hash
        )

    def _unreadable(self, ref: ChunkRef, error: BaseException) -> UnreadableChunkError:
        return UnreadableChunkError(
            f"checkpoint {self.checkpoint}: chunk {ref.hash} could not be read from the storage: "
            + " ".join(str(error).split())[:300],
            checkpoint=self.checkpoint,
            chunk=ref.hash,
        )

    def _ask(self, ref: ChunkRef, call: Callable[[str], int]) -> int:
        """``call(key)`` of the chunk's key: a missing chunk is corrupt, any other storage failure unreadable."""
        try:
            return call(chunk_key(ref.hash))
        except (ObjectNotFoundError, FileNotFoundError):
            raise self._corrupt(ref, "is missing") from None
        except (StorageError, OSError) as e:
            raise self._unreadable(ref, e) from e

    def read_into(self, ref: ChunkRef, out: memoryview) -> None:
        if len(out) != ref.size:
            raise self._corrupt(ref, f"does not fit its tensor ({ref.size} bytes for a {len(out)}-byte slot)")
        size = self._ask(ref, lambda key: self.backend.get_into(key, out))
        if size != ref.size:
            raise self._corrupt(ref, f"has {size} bytes, expected {ref.size} (truncated or damaged)")
        self.check(ref, out)

    def read(self, ref: ChunkRef) -> bytearray:
        if ref.size > LARGE_READ_BYTES:
            self.check_claims([ref])
        buf = bytearray(ref.size)
        self.read_into(ref, memoryview(buf))
        return buf

    def verify(self, ref: ChunkRef) -> None:
        """Read and check one chunk, keeping nothing (verifying a whole chain holds one chunk per thread)."""
        self.read(ref)

    def check_claims(self, refs: Sequence[ChunkRef], pool: ThreadPoolExecutor | None = None) -> None:
        """Compare each chunk's claimed size with its size in the store, reading nothing (a stat or HEAD each,
        in parallel on ``pool``); :class:`CorruptCheckpointError` for the first that differs or is missing."""

        def one(ref: ChunkRef) -> None:
            actual = self._ask(ref, self.backend.size)
            if actual != ref.size:
                raise self._corrupt(ref, f"has {actual} bytes in the store, its manifest claims {ref.size}")

        if pool is None or len(refs) < 2:
            for ref in refs:
                one(ref)
        else:
            wait_all([pool.submit(one, ref) for ref in refs])

    def check(self, ref: ChunkRef, data: memoryview) -> None:
        if crc32c(data) != ref.crc32c:
            raise self._corrupt(ref, "failed its CRC32C check (bit rot or a damaged write)")
        if self.verify_hash and hashlib.sha256(data).hexdigest() != ref.hash:
            raise self._corrupt(ref, "does not match its SHA-256 name")


def wait_all(futures: Sequence[Future[Any]]) -> None:
    """Wait for all futures, then raise the first error (never leave reads running behind an exception)."""
    first: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            if first is None:
                first = e
    if first is not None:
        raise first
