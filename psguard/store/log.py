"""The durable checkpoint log: full checkpoints and chains of deltas over content-addressed chunks.

Layout under the store's root (specified in docs/storage-format.md)::

    chunks/ab/<sha256>          tensor bytes, named by their hash; shared by every checkpoint using them
    manifests/<id>.json         one per checkpoint; created last, create-only: the commit
    journal/<seq>.json          commits in the order they happened (create-only, one object each)
    locks/writer-<nonce>.json   a save in progress (protects its chunks and parent from gc)
    locks/gc.json               a gc in progress

A checkpoint exists exactly when its manifest does; the manifest is written create-only after all its
chunks, so readers never see a torn checkpoint and no checkpoint is ever overwritten. ``gc`` removes
manifests first and chunks last, keeps every checkpoint a kept one needs, and leaves chunks alone while a
writer is active, so it is safe to run beside training.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from psguard.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    ObjectExistsError,
    ObjectNotFoundError,
    ParentMissingError,
    PsguardError,
    SaveError,
    UnsupportedFormatError,
)
from psguard.storage import Backend, RetryConfig, open_backend
from psguard.store.chunks import LARGE_READ_BYTES, ChunkReader, ChunkWriter, byte_view, deserialize_strings
from psguard.store.dtypes import DTYPE_NAMES, STRING, dtype_from_name, dtype_name, logical_nbytes
from psguard.store.lease import (
    Lease,
    LeaseKeeper,
    LeaseLostError,
    lease_stale,
    read_lease,
    storage_now,
)
from psguard.store.manifest import (
    CHUNK_PREFIX,
    JOURNAL_PREFIX,
    LOCK_PREFIX,
    MANIFEST_PREFIX,
    ChunkRef,
    Manifest,
    Part,
    Segment,
    TensorEntry,
    chunk_key,
    is_checkpoint_id,
    manifest_key,
    new_checkpoint_id,
    parse_journal_entry,
    parse_manifest,
    sharded_entry_from_parts,
    step_of_id,
)
from psguard.store.retention import Candidate, select_kept
from psguard.tensors import Full, FullStream, Rows, Same, TensorUpdate

log = logging.getLogger(__name__)

GC_LOCK = f"{LOCK_PREFIX}gc.json"
DEFAULT_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as ``psguard ls`` shows it."""

    id: str
    step: int
    kind: str
    parent: str | None
    base: str
    chain_length: int
    committed_at: float
    tensors: int
    logical_bytes: int
    stored_bytes: int
    metadata: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, m: Manifest) -> CheckpointInfo:
        return cls(
            id=m.id,
            step=m.step,
            kind=m.kind,
            parent=m.parent,
            base=m.base,
            chain_length=m.chain_length,
            committed_at=m.committed_at,
            tensors=len(m.tensors),
            logical_bytes=int(m.stats.get("logical_bytes", 0)),
            stored_bytes=int(m.stats.get("bytes_written", 0)),
            metadata=m.metadata,
            metrics=m.metrics,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "step": self.step,
            "kind": self.kind,
            "parent": self.parent,
            "base": self.base,
            "chain_length": self.chain_length,
            "committed_at": self.committed_at,
            "tensors": self.tensors,
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "metadata": dict(self.metadata),
            "metrics": dict(self.metrics),
        }


@dataclass(frozen=True)
class Problem:
    checkpoint: str
    chunk: str | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "chunk": self.chunk, "message": self.message}


@dataclass(frozen=True)
class VerifyReport:
    checkpoint: str
    chain: tuple[str, ...]
    chunks_checked: int
    bytes_checked: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "ok": self.ok,
            "chain": list(self.chain),
            "chunks_checked": self.chunks_checked,
            "bytes_checked": self.bytes_checked,
            "problems": [p.to_json() for p in self.problems],
        }


@dataclass(frozen=True)
class GcReport:
    kept: tuple[str, ...]
    deleted_checkpoints: tuple[str, ...]
    deleted_chunks: int
    chunks_deferred: bool  # True when a live writer made gc leave chunks for a later run
    dry_run: bool
    #: Checkpoints that failed verification: never counted towards a retention rule (and deleted, unless
    #: nothing in the store is restorable), with what is wrong with each.
    corrupt: tuple[Problem, ...] = ()
    #: Unreferenced chunks left alone because the storage wrote them less than a lease TTL ago: they may
    #: belong to a save gc cannot see (a lost lease, skewed clocks); a later gc takes them.
    young_chunks: int = 0

    @property
    def corrupt_checkpoints(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.checkpoint for p in self.corrupt))

    def to_json(self) -> dict[str, Any]:
        return {
            "kept": list(self.kept),
            "deleted_checkpoints": list(self.deleted_checkpoints),
            "deleted_chunks": self.deleted_chunks,
            "chunks_deferred": self.chunks_deferred,
            "dry_run": self.dry_run,
            "corrupt": [p.to_json() for p in self.corrupt],
            "young_chunks": self.young_chunks,
        }


@dataclass(frozen=True)
class LoadResult:
    """A restored checkpoint: its info, its tensors, and the newer checkpoints skipped as unusable."""

    info: CheckpointInfo
    tensors: dict[str, np.ndarray]
    skipped: tuple[Problem, ...] = ()


class Store:
    """A checkpoint log on one backend. Thread-safe for concurrent reads; one save at a time per instance
    (several instances, in one process or many, may write to one store concurrently)."""

    def __init__(
        self,
        backend: Backend,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        io_threads: int | None = None,
        inflight_bytes: int | None = None,
        lock_ttl: float = 600.0,
        chunk_grace: float | None = None,
    ) -> None:
        io_threads = io_threads if io_threads is not None else backend.io_parallelism
        # The bytes read ahead of their upload: by default two chunks per I/O thread (one uploading, one ready).
        # More would only wait in the pool's queue, and a streamed tensor's reads are the memory a PS agent
        # holds beyond its shards (a fixed 128 MB was 0.25 of a 512 MB PS on a local store with 2 threads).
        inflight_bytes = 2 * io_threads * chunk_bytes if inflight_bytes is None else inflight_bytes
        if chunk_bytes <= 0 or io_threads <= 0 or inflight_bytes <= 0:
            raise ConfigError("chunk_bytes, io_threads and inflight_bytes must be positive")
        self.backend = backend
        self.url = backend.url
        self.chunk_bytes = chunk_bytes
        self.inflight_bytes = inflight_bytes
        #: The lease of a save or gc: refreshed every quarter of it while the work runs; a lease the storage
        #: has not seen refreshed for this long is stale. Short values stand for long saves in tests.
        self.lock_ttl = lock_ttl
        #: gc leaves unreferenced chunks younger than this (storage clock) alone; defaults to ``lock_ttl``.
        #: 0 turns the guard off: only for a test that knows its chunks are garbage.
        self.chunk_grace = lock_ttl if chunk_grace is None else chunk_grace
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="psguard-io")
        self._save_lock = threading.Lock()
        self._tx_thread: int | None = None  # the thread whose transaction holds _save_lock
        self._manifests: dict[str, Manifest] = {}
        self._cache_lock = threading.Lock()
        self._journal_seq = -1
        self._writer_name = f"{socket.gethostname()}:{os.getpid()}"

    @classmethod
    def open(
        cls,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry: RetryConfig | None = None,
        **kwargs: Any,
    ) -> Store:
        return cls(open_backend(url, storage_options, retry=retry), **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.backend.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------- reading
    def checkpoint_ids(self) -> list[str]:
        """Ids of committed checkpoints in step order (names only; nothing verified yet)."""
        ids = []
        for key in self.backend.keys(MANIFEST_PREFIX):
            name = key[len(MANIFEST_PREFIX) :]
            if name.endswith(".json") and is_checkpoint_id(name[:-5]):
                ids.append(name[:-5])
        ids.sort()
        return ids

    def manifest(self, checkpoint_id: str) -> Manifest:
        """The parsed, checksum-verified manifest (cached: manifests are immutable)."""
        with self._cache_lock:
            cached = self._manifests.get(checkpoint_id)
        if cached is not None:
            return cached
        if not is_checkpoint_id(checkpoint_id):
            raise ConfigError(f"{checkpoint_id!r} is not a checkpoint id")
        try:
            data = self.backend.get(manifest_key(checkpoint_id))
        except ObjectNotFoundError:
            raise NoCheckpointError(
                f"checkpoint {checkpoint_id} not found in {self.url}", checkpoint=checkpoint_id
            ) from None
        m = parse_manifest(data, expected_id=checkpoint_id)
        with self._cache_lock:
            self._manifests[checkpoint_id] = m
        return m

    def checkpoints(self, *, on_error: Callable[[str, CheckpointError], None] | None = None) -> list[CheckpointInfo]:
        """Every readable committed checkpoint, oldest first; unreadable manifests go to ``on_error``."""
        out = []
        for cid in self.checkpoint_ids():
            try:
                out.append(CheckpointInfo.of(self.manifest(cid)))
            except CheckpointError as e:
                if on_error is None:
                    log.warning("skipping checkpoint %s: %s", cid, e)
                else:
                    on_error(cid, e)
        out.sort(key=lambda i: (i.step, i.committed_at, i.id))
        return out

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint whose manifest reads (chunks not checked: see :meth:`load_latest`)."""
        for cid in self._newest_first():
            try:
                return CheckpointInfo.of(self.manifest(cid))
            except CheckpointError as e:
                log.warning("skipping checkpoint %s: %s", cid, e)
        return None

    def _newest_first(self) -> list[str]:
        ids = self.checkpoint_ids()
        # Same step: later commit first (a compaction re-commits a step as a full checkpoint).
        by_step: dict[int, list[str]] = {}
        for cid in ids:
            by_step.setdefault(step_of_id(cid), []).append(cid)
        out = []
        for step in sorted(by_step, reverse=True):
            group = by_step[step]
            if len(group) > 1:

                def when(c: str) -> float:
                    try:
                        return self.manifest(c).committed_at
                    except CheckpointError:
                        return -1.0

                group.sort(key=when, reverse=True)
            out.extend(group)
        return out

    def resolve(self, *, step: int | None = None, checkpoint_id: str | None = None) -> str:
        """The id for a step (the newest commit of it), an explicit id, or the latest checkpoint."""
        if checkpoint_id is not None:
            self.manifest(checkpoint_id)
            return checkpoint_id
        for cid in self._newest_first():
            if step is None or step_of_id(cid) == step:
                return cid
        where = f"at step {step} " if step is not None else ""
        raise NoCheckpointError(f"no checkpoint {where}in {self.url}")

    def chain(self, checkpoint_id: str) -> list[Manifest]:
        """Manifests from the base to ``checkpoint_id``; a missing link is a corrupt checkpoint."""
        out = []
        cid: str | None = checkpoint_id
        seen = set()
        while cid is not None:
            if cid in seen:
                raise CorruptCheckpointError(f"checkpoint {checkpoint_id}: parent cycle at {cid}", checkpoint=cid)
            seen.add(cid)
            try:
                m = self.manifest(cid)
            except NoCheckpointError:
                raise CorruptCheckpointError(
                    f"checkpoint {checkpoint_id}: its parent {cid} is missing, so it cannot be rebuilt",
                    checkpoint=checkpoint_id,
                ) from None
            out.append(m)
            cid = m.parent
        out.reverse()
        return out

    def load(
        self,
        checkpoint_id: str,
        names: Sequence[str] | None = None,
        *,
        verify_hash: bool = False,
    ) -> dict[str, np.ndarray]:
        """Materialise tensors of a checkpoint (base + deltas), verifying every chunk read.

        Raises :class:`CorruptCheckpointError` naming the checkpoint and chunk on any defect; nothing
        partially restored is returned.
        """
        chain = self.chain(checkpoint_id)
        target = chain[-1]
        wanted = list(target.tensors) if names is None else list(names)
        missing = [n for n in wanted if n not in target.tensors]
        if missing:
            raise NoCheckpointError(f"checkpoint {checkpoint_id} has no tensor(s) {missing}", checkpoint=checkpoint_id)
        return {name: self._materialise(chain, name, verify_hash) for name in wanted}

    def iter_tensors(self, checkpoint_id: str, *, verify_hash: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        """Tensors one at a time, so a large checkpoint is never all in memory at once."""
        chain = self.chain(checkpoint_id)
        for name in chain[-1].tensors:
            yield name, self._materialise(chain, name, verify_hash)

    def read_rows(
        self, checkpoint_id: str, name: str, start: int, stop: int, *, verify_hash: bool = False
    ) -> np.ndarray:
        """Rows ``[start, stop)`` of tensor ``name`` of a checkpoint, bit-identical to slicing :meth:`load`'s.

        How a PS that lost its node (and its memory tier) reads exactly the rows it owns: from the newest
        checkpoint of the chain whose entry covers the range with whole rows, only the chunks that overlap the
        range are read (a whole chunk holds ``size // row_bytes`` rows, so sizes alone locate them); later
        deltas' row segments are read and filtered to the range (a segment's values only when one of its ids
        falls in it). Every chunk read is checked (size, CRC32C; SHA-256 with ``verify_hash``).
        """
        chain = self.chain(checkpoint_id)
        if name not in chain[-1].tensors:
            raise NoCheckpointError(f"checkpoint {checkpoint_id} has no tensor {name!r}", checkpoint=checkpoint_id)
        return self._read_rows(chain, name, start, stop, verify_hash)

    def _read_rows(self, chain: Sequence[Manifest], name: str, start: int, stop: int, verify_hash: bool) -> np.ndarray:
        checkpoint_id = chain[-1].id
        target = chain[-1].tensors[name]
        if not target.shape:
            raise ConfigError(f"tensor {name!r} of checkpoint {checkpoint_id} is a scalar: it has no rows")
        if not 0 <= start <= stop <= target.shape[0]:
            raise ConfigError(f"rows [{start}, {stop}) are not within tensor {name!r}'s {target.shape[0]} rows")
        if target.dtype == STRING:  # strings are stored whole and cut by bytes, not rows
            return self._materialise(chain, name, verify_hash)[start:stop].copy()
        dtype = self._dtype_of(chain[-1], name, target)
        out = np.empty((stop - start, *target.shape[1:]), dtype=dtype)
        if start == stop:
            return out
        first = self._start_of(chain, name, lambda e: _whole_over(e, start, stop))
        for m in chain[first:]:
            entry = m.tensors[name]
            if entry.encoding == "full":
                self._fill_range(m, name, entry.chunks, 0, entry.shape[0], start, out, verify_hash)
            elif entry.encoding == "rows":
                self._scatter_range(m, name, entry.segments, 0, entry.shape[0], start, out, verify_hash, part=False)
            elif entry.encoding == "sharded":
                for p in entry.parts:
                    if p.offset >= stop or p.stop <= start:
                        continue
                    if p.encoding == "full":
                        self._fill_range(m, name, p.chunks, p.offset, p.rows, start, out, verify_hash)
                    elif p.encoding == "rows":
                        self._scatter_range(m, name, p.segments, p.offset, p.rows, start, out, verify_hash, part=True)
        return out

    def _fill_range(
        self,
        m: Manifest,
        name: str,
        chunks: Sequence[ChunkRef],
        base: int,
        nrows: int,
        start: int,
        out: np.ndarray,
        verify_hash: bool,
    ) -> None:
        """Copy the rows of ``out``'s range (``out`` holds rows ``[start, start + len(out))``) that the whole
        rows ``[base, base + nrows)`` stored in ``chunks`` have, reading only the chunks that overlap it: a chunk
        inside the range lands straight in ``out``, one across its edge is read whole and sliced."""
        rb = _row_nbytes(out.shape, out.dtype)
        if rb == 0:
            return
        stop = start + out.shape[0]
        if sum(c.size for c in chunks) != nrows * rb or any(c.size % rb for c in chunks):
            raise CorruptCheckpointError(
                f"checkpoint {m.id}: tensor {name!r}: its chunks do not hold {nrows} whole rows of {rb} bytes",
                checkpoint=m.id,
            )
        reader = ChunkReader(self.backend, checkpoint=m.id, verify_hash=verify_hash)
        view = byte_view(out)
        inside: list[tuple[ChunkRef, memoryview]] = []
        edges: list[tuple[Future[bytearray], int, int, int]] = []
        for ref, pos in _positions(chunks, 0):
            r0 = base + pos // rb
            r1 = r0 + ref.size // rb
            lo, hi = max(r0, start), min(r1, stop)
            if lo >= hi:
                continue
            if (lo, hi) == (r0, r1):
                inside.append((ref, view[(r0 - start) * rb : (r1 - start) * rb]))
            else:
                edges.append((self._pool.submit(reader.read, ref), r0, lo, hi))
        self._read_placed(reader, inside)
        _wait_all([f for f, *_ in edges])
        for f, r0, lo, hi in edges:
            view[(lo - start) * rb : (hi - start) * rb] = memoryview(f.result())[(lo - r0) * rb : (hi - r0) * rb]

    def _scatter_range(
        self,
        m: Manifest,
        name: str,
        segments: Sequence[Segment],
        base: int,
        nrows: int,
        start: int,
        out: np.ndarray,
        verify_hash: bool,
        *,
        part: bool,
    ) -> None:
        """Apply the changed rows of ``segments`` (ids relative to ``base``, within ``[0, nrows)``) that fall in
        ``out``'s range: every ids chunk is read, a values chunk only when one of its ids is in the range."""
        rb = _row_nbytes(out.shape, out.dtype)
        stop = start + out.shape[0]
        reader = ChunkReader(self.backend, checkpoint=m.id, verify_hash=verify_hash)
        for seg in segments:
            if seg.ids.size != 8 * seg.count or seg.values.size != rb * seg.count:
                raise CorruptCheckpointError(
                    f"checkpoint {m.id}: tensor {name!r}: a segment's chunk sizes do not match its row count",
                    checkpoint=m.id,
                )
        id_futures = [self._pool.submit(reader.read, seg.ids) for seg in segments]
        _wait_all(id_futures)
        hits = []
        for seg, f in zip(segments, id_futures, strict=True):
            ids = self._checked_ids(m, name, seg, f.result(), nrows, part) + base
            mask = (ids >= start) & (ids < stop)
            if mask.any():
                hits.append((seg, ids, mask, self._pool.submit(reader.read, seg.values)))
        _wait_all([f for *_, f in hits])
        for seg, ids, mask, f in hits:
            rows = np.frombuffer(f.result(), dtype=out.dtype).reshape((seg.count, *out.shape[1:]))
            out[ids[mask] - start] = rows[mask]

    def _materialise(self, chain: Sequence[Manifest], name: str, verify_hash: bool) -> np.ndarray:
        start = self._start_of(chain, name, lambda e: e.whole)
        value = self._read_whole(chain[start], name, verify_hash)
        for m in chain[start + 1 :]:
            self._apply_entry(m, name, value, verify_hash)
        return value

    def _start_of(self, chain: Sequence[Manifest], name: str, whole: Callable[[TensorEntry], bool]) -> int:
        return _full_start(chain, name, whole)

    def _read_whole(self, m: Manifest, name: str, verify_hash: bool) -> np.ndarray:
        """A whole entry's tensor: ``full``, or ``sharded`` with every part ``full`` (whose chunks, parts being
        sorted and contiguous, are the tensor's bytes in order)."""
        entry = m.tensors[name]
        if entry.encoding == "full":
            return self._read_full(m, name, verify_hash)
        if not entry.whole:
            raise CorruptCheckpointError(f"checkpoint {m.id}: tensor {name!r} is not whole here", checkpoint=m.id)
        reader = ChunkReader(self.backend, checkpoint=m.id, verify_hash=verify_hash)
        refs = [c for p in entry.parts for c in p.chunks]
        if sum(r.size for r in refs) > LARGE_READ_BYTES:  # claims only, so far: the store's real sizes first
            reader.check_claims(refs, self._pool)
        out = np.empty(entry.shape, dtype=self._dtype_of(m, name, entry))
        self._read_all(reader, refs, byte_view(out))
        return out

    def _apply_entry(self, m: Manifest, name: str, value: np.ndarray, verify_hash: bool) -> None:
        """Apply a later entry of the chain to ``value`` in place: ``full`` replaces, ``rows`` scatters,
        ``sharded`` does each part (full: its range; rows: at offset + ids; same: nothing)."""
        entry = m.tensors[name]
        if entry.encoding == "full":
            value[...] = self._read_full(m, name, verify_hash)
        elif entry.encoding == "rows":
            self._apply_rows(m, name, entry, value, verify_hash)
        elif entry.encoding == "sharded":
            reader = ChunkReader(self.backend, checkpoint=m.id, verify_hash=verify_hash)
            rb = _row_nbytes(value.shape, value.dtype)
            view = byte_view(value)
            full = [p for p in entry.parts if p.encoding == "full"]
            placed = [(c, view[pos : pos + c.size]) for p in full for c, pos in _positions(p.chunks, p.offset * rb)]
            self._read_placed(reader, placed)
            for p in entry.parts:
                if p.encoding == "rows":
                    part = value[p.offset : p.stop]
                    for ids, rows in self._segment_arrays(m, name, p.segments, p.rows, value, verify_hash, part=True):
                        part[ids] = rows

    def _dtype_of(self, m: Manifest, name: str, entry: TensorEntry) -> np.dtype[Any]:
        try:
            return dtype_from_name(entry.dtype)
        except ValueError as e:
            raise CorruptCheckpointError(f"checkpoint {m.id}: tensor {name!r}: {e}", checkpoint=m.id) from None

    def _read_full(self, m: Manifest, name: str, verify_hash: bool) -> np.ndarray:
        entry = m.tensors[name]
        reader = ChunkReader(self.backend, checkpoint=m.id, verify_hash=verify_hash)
        try:
            dtype = dtype_from_name(entry.dtype)
        except ValueError as e:
            raise CorruptCheckpointError(f"checkpoint {m.id}: tensor {name!r}: {e}", checkpoint=m.id) from None
        total = sum(c.size for c in entry.chunks)
        if total > LARGE_READ_BYTES:  # claims only, so far: the store's real sizes first, then allocate
            reader.check_claims(entry.chunks, self._pool)
        if entry.dtype == STRING:
            blob = bytearray(total)
            self._read_all(reader, entry.chunks, memoryview(blob))
            try:
                return deserialize_strings(memoryview(blob), entry.shape)
            except ValueError as e:
                raise CorruptCheckpointError(f"checkpoint {m.id}: tensor {name!r}: {e}", checkpoint=m.id) from None
        nbytes = logical_nbytes(entry.dtype, entry.shape)
        if nbytes != total:
            raise CorruptCheckpointError(
                f"checkpoint {m.id}: tensor {name!r} has {total} bytes of chunks for {nbytes} bytes of data",
                checkpoint=m.id,
            )
        out = np.empty(entry.shape, dtype=dtype)
        self._read_all(reader, entry.chunks, byte_view(out))
        return out

    def _read_all(self, reader: ChunkReader, refs: Sequence[ChunkRef], view: memoryview) -> None:
        self._read_placed(reader, [(r, view[pos : pos + r.size]) for r, pos in _positions(refs, 0)])

    def _read_placed(self, reader: ChunkReader, placed: Sequence[tuple[ChunkRef, memoryview]]) -> None:
        """Read chunks in parallel, each straight into its slot (size and CRC32C checked)."""
        _wait_all([self._pool.submit(reader.read_into, ref, slot) for ref, slot in placed])

    def _apply_rows(self, m: Manifest, name: str, entry: TensorEntry, value: np.ndarray, verify_hash: bool) -> None:
        for ids, rows in self._segment_arrays(m, name, entry.segments, value.shape[0], value, verify_hash):
            value[ids] = rows

    def _segment_arrays(
        self,
        m: Manifest,
        name: str,
        segments: Sequence[Segment],
        nrows: int,
        like: np.ndarray,
        verify_hash: bool,
        *,
        part: bool = False,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each segment's ids and rows (rows shaped and typed like ``like``'s), every chunk read and checked, ids
        within ``[0, nrows)``; a part's ids (``part``) must also be sorted and unique, as version 2 says."""
        reader = ChunkReader(self.backend, checkpoint=m.id, verify_hash=verify_hash)
        rb = _row_nbytes(like.shape, like.dtype)
        futures = []
        for seg in segments:
            if seg.ids.size != 8 * seg.count or seg.values.size != rb * seg.count:
                raise CorruptCheckpointError(
                    f"checkpoint {m.id}: tensor {name!r}: a segment's chunk sizes do not match its row count",
                    checkpoint=m.id,
                )
            futures.append((seg, self._pool.submit(reader.read, seg.ids), self._pool.submit(reader.read, seg.values)))
        _wait_all([f for _, a, b in futures for f in (a, b)])
        out = []
        for seg, f_ids, f_vals in futures:
            ids = self._checked_ids(m, name, seg, f_ids.result(), nrows, part)
            rows = np.frombuffer(f_vals.result(), dtype=like.dtype).reshape((seg.count, *like.shape[1:]))
            out.append((ids, rows))
        return out

    def _checked_ids(
        self, m: Manifest, name: str, seg: Segment, data: bytes | bytearray, nrows: int, part: bool
    ) -> np.ndarray:
        ids = np.frombuffer(data, dtype="<i8")
        if ids.size and (ids.min() < 0 or ids.max() >= nrows or (part and np.any(np.diff(ids) <= 0))):
            raise CorruptCheckpointError(
                f"checkpoint {m.id}: tensor {name!r}: row id out of range"
                + (f" of its {nrows}-row part, or not sorted and unique" if part else ""),
                checkpoint=m.id,
                chunk=seg.ids.hash,
            )
        return ids

    def updates(self, checkpoint_id: str, *, verify_hash: bool = False) -> tuple[dict[str, TensorUpdate], int]:
        """What ``checkpoint_id`` itself changed, per tensor, read from its own chunks only; and the bytes read.

        A full checkpoint gives every tensor whole (``Full``); a delta gives ``Rows`` for its changed rows,
        ``Full`` for tensors it stored whole and ``Same`` for the others. Followers apply these in step order on
        top of the state they hold, instead of rebuilding every tensor (:meth:`load`). Every chunk is verified;
        a defect raises :class:`CorruptCheckpointError` before anything is returned.
        """
        m = self.manifest(checkpoint_id)
        out: dict[str, TensorUpdate] = {}
        nbytes = 0
        for name, entry in m.tensors.items():
            try:
                dtype = dtype_from_name(entry.dtype)
            except ValueError as e:
                raise CorruptCheckpointError(f"checkpoint {m.id}: tensor {name!r}: {e}", checkpoint=m.id) from None
            if entry.encoding == "full":
                out[name] = Full(self._read_full(m, name, verify_hash))
                nbytes += sum(c.size for c in entry.chunks)
            elif entry.encoding == "rows":
                rb = dtype.itemsize * int(np.prod(entry.shape[1:], dtype=np.int64))
                ids_parts: list[np.ndarray] = []
                value_parts: list[np.ndarray] = []
                reader = ChunkReader(self.backend, checkpoint=m.id, verify_hash=verify_hash)
                if sum(r.size for r in entry.refs()) > LARGE_READ_BYTES:  # all kept at once: real sizes first
                    reader.check_claims(entry.refs(), self._pool)
                for seg in entry.segments:
                    if seg.ids.size != 8 * seg.count or seg.values.size != rb * seg.count:
                        raise CorruptCheckpointError(
                            f"checkpoint {m.id}: tensor {name!r}: a segment's chunk sizes do not match its row count",
                            checkpoint=m.id,
                        )
                    ids_parts.append(np.frombuffer(reader.read(seg.ids), dtype="<i8").astype(np.int64))
                    rows = np.frombuffer(reader.read(seg.values), dtype=dtype)
                    value_parts.append(rows.reshape((seg.count, *entry.shape[1:])))
                    nbytes += seg.ids.size + seg.values.size
                ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int64)
                if ids.size and (ids.min() < 0 or ids.max() >= entry.shape[0]):
                    raise CorruptCheckpointError(
                        f"checkpoint {m.id}: tensor {name!r}: row id out of range", checkpoint=m.id
                    )
                values = np.concatenate(value_parts) if value_parts else np.zeros((0, *entry.shape[1:]), dtype)
                out[name] = Rows(ids, values, entry.shape)
            elif entry.encoding == "sharded":
                out[name] = self._sharded_update(m, name, entry, dtype, verify_hash)
                nbytes += sum(r.size for r in entry.refs())
            else:
                out[name] = Same(entry.shape, dtype)
        return out, nbytes

    def _sharded_update(
        self, m: Manifest, name: str, entry: TensorEntry, dtype: np.dtype[Any], verify_hash: bool
    ) -> TensorUpdate:
        """A sharded entry as one update of the logical tensor: ``Full`` when every part is full, ``Same`` when
        every part is unchanged, else ``Rows`` over logical ids (a full part gives all of its rows)."""
        if entry.whole:
            return Full(self._read_whole(m, name, verify_hash))
        if all(p.encoding == "same" for p in entry.parts):
            return Same(entry.shape, dtype)
        like = np.empty((0, *entry.shape[1:]), dtype)
        reader = ChunkReader(self.backend, checkpoint=m.id, verify_hash=verify_hash)
        ids_parts: list[np.ndarray] = []
        value_parts: list[np.ndarray] = []
        for p in entry.parts:  # sorted by offset, ids sorted within a part: the logical ids come out sorted
            if p.encoding == "full":
                rows = np.empty((p.rows, *entry.shape[1:]), dtype)
                view = byte_view(rows)
                self._read_placed(reader, [(c, view[pos : pos + c.size]) for c, pos in _positions(p.chunks, 0)])
                ids_parts.append(np.arange(p.offset, p.stop, dtype=np.int64))
                value_parts.append(rows)
            elif p.encoding == "rows":
                for ids, rows in self._segment_arrays(m, name, p.segments, p.rows, like, verify_hash, part=True):
                    ids_parts.append(ids.astype(np.int64) + p.offset)
                    value_parts.append(rows)
        ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int64)
        values = np.concatenate(value_parts) if value_parts else like
        return Rows(ids, values, entry.shape)

    def load_latest(self, names: Sequence[str] | None = None) -> LoadResult:
        """Restore the newest checkpoint that verifies; fall back to older ones, saying which and why.

        Never returns data from a checkpoint that failed verification.
        """
        skipped: list[Problem] = []
        for cid in self._newest_first():
            try:
                tensors = self.load(cid, names)
                info = CheckpointInfo.of(self.manifest(cid))
            except (CorruptCheckpointError, UnsupportedFormatError) as e:
                log.warning("checkpoint %s is unusable (%s); falling back to an older checkpoint", cid, e)
                skipped.append(Problem(cid, e.chunk, str(e)))
                continue
            if skipped:
                log.warning(
                    "restored checkpoint %s (step %d) after skipping %d newer unusable checkpoint(s): %s",
                    cid,
                    info.step,
                    len(skipped),
                    ", ".join(p.checkpoint for p in skipped),
                )
            return LoadResult(info, tensors, tuple(skipped))
        detail = "; ".join(p.message for p in skipped)
        raise NoCheckpointError(
            f"no usable checkpoint in {self.url}" + (f" ({len(skipped)} unusable: {detail})" if skipped else "")
        )

    def verify(self, checkpoint_id: str) -> VerifyReport:
        """Read every chunk of the checkpoint's chain, checking size, CRC32C and SHA-256; report all defects."""
        return self._verify(checkpoint_id, None)

    def verify_all(self, checkpoint_ids: Sequence[str]) -> Iterator[VerifyReport]:
        """:meth:`verify` of each checkpoint, each report yielded as soon as it is known, every chunk read once
        per call: a chunk several chains share (a base under many deltas) is checked the first time and its
        verdict reused, a failure included, for every later checkpoint that uses it."""
        chunk_results: dict[str, str | None] = {}
        for cid in checkpoint_ids:
            yield self._verify(cid, chunk_results)

    def chain_bytes(self, checkpoint_ids: Sequence[str]) -> int:
        """The bytes of the distinct chunks the chains of ``checkpoint_ids`` reference (manifests only; a chain
        that cannot be read counts 0): what reading them all once costs."""
        sizes: dict[str, int] = {}
        for cid in checkpoint_ids:
            try:
                chain = self.chain(cid)
            except CheckpointError:
                continue
            for m in chain:
                sizes.update((ref.hash, ref.size) for ref in m.refs())
        return sum(sizes.values())

    def _verify(self, checkpoint_id: str, chunk_results: dict[str, str | None] | None) -> VerifyReport:
        """:meth:`verify`, reading each chunk once across calls sharing ``chunk_results`` (hash -> problem).

        gc verifies a delta chain's members one after another; with a shared cache that is linear, not
        quadratic, in the chain's length.
        """
        problems: list[Problem] = []
        try:
            chain = self.chain(checkpoint_id)
        except (CorruptCheckpointError, UnsupportedFormatError, NoCheckpointError) as e:
            return VerifyReport(checkpoint_id, (), 0, 0, (Problem(e.checkpoint or checkpoint_id, None, str(e)),))
        for name in chain[-1].tensors:  # what a restore would refuse before reading anything
            try:
                _full_start(chain, name)
            except CorruptCheckpointError as e:
                problems.append(Problem(checkpoint_id, None, str(e)))
        cache: dict[str, str | None] = chunk_results if chunk_results is not None else {}
        seen: set[str] = set()
        futures: list[tuple[Manifest, ChunkRef, Future[Any] | None]] = []
        for m in chain:
            reader = ChunkReader(self.backend, checkpoint=m.id, verify_hash=True)
            for ref in m.refs():
                if ref.hash in seen:
                    continue
                seen.add(ref.hash)
                futures.append((m, ref, None if ref.hash in cache else self._pool.submit(reader.verify, ref)))
        nbytes = 0
        for m, ref, fut in futures:
            if fut is not None:
                try:
                    fut.result()
                    cache[ref.hash] = None
                except CorruptCheckpointError as e:
                    cache[ref.hash] = str(e)
            message = cache[ref.hash]
            if message is None:
                nbytes += ref.size
            else:
                problems.append(Problem(m.id, ref.hash, message))
        return VerifyReport(checkpoint_id, tuple(m.id for m in chain), len(futures), nbytes, tuple(problems))

    # ----------------------------------------------------------------------------------------------- writing
    def save(
        self,
        step: int,
        tensors: Mapping[str, TensorUpdate | FullStream | np.ndarray],
        *,
        parent: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        dedup_against: str | None = None,
    ) -> CheckpointInfo:
        """Write a checkpoint and commit it. Full when ``parent`` is None (every tensor must be whole),
        else a delta over ``parent``. Blocks until committed; raises :class:`SaveError` (cause chained)
        if anything fails, in which case no checkpoint became visible.

        Chunks already stored for ``parent``'s chain (or ``dedup_against``'s, for a full checkpoint) are
        not uploaded again; the writer's lock keeps gc from deleting them meanwhile. A save is one
        :meth:`begin_save` transaction committed at once: one code path writes every manifest.
        """
        _check_metadata(metadata)  # before any lease: bad input costs no storage round trip
        with self.begin_save(step, parent=parent, dedup_against=dedup_against) as tx:
            return tx.commit(tensors, metadata=metadata, metrics=metrics)

    def begin_save(self, step: int, *, parent: str | None = None, dedup_against: str | None = None) -> SaveTransaction:
        """Open the transaction of one checkpoint: its id and writer lease now, its manifest at
        :meth:`SaveTransaction.commit`; leaving the ``with`` block without a commit aborts (lease released,
        nothing committed).

        While it is open, other processes (each PS's agent) write the chunks of their shards with
        :meth:`write_part` under its lease: gc deletes no chunk while a writer lease is live, whoever wrote
        the chunk. One transaction at a time per instance (another thread's ``begin_save`` waits).
        """
        reuse = dedup_against or parent
        if self._tx_thread == threading.get_ident():  # waiting for our own lock would never end
            raise ConfigError(f"a transaction is already open on {self.url} in this thread: commit or abort it first")
        self._save_lock.acquire()  # released when the transaction ends (commit or abort)
        self._tx_thread = threading.get_ident()
        try:
            try:
                cid = new_checkpoint_id(step)
                try:
                    parent_m = self.manifest(parent) if parent is not None else None
                except (NoCheckpointError, ObjectNotFoundError) as e:
                    raise ParentMissingError(f"step {step}: the parent checkpoint {parent} is gone: {e}") from e
                lease, keeper = self._acquire_writer_lock(cid, parent or reuse, dedup_against=reuse)
                try:
                    if reuse is not None and not self.backend.exists(manifest_key(reuse)):
                        raise ParentMissingError(
                            f"checkpoint {reuse} was deleted (by gc?) while step {step} was being written on it"
                        )
                    known = self._known_chunks(reuse) if reuse is not None else set()
                except BaseException:
                    keeper.stop()
                    lease.release()
                    raise
            except PsguardError:
                raise
            except Exception as e:
                raise SaveError(f"saving step {step} to {self.url} failed: {e}") from e
        except BaseException:
            self._tx_thread = None
            self._save_lock.release()
            raise
        return SaveTransaction(self, cid, step, parent, parent_m, lease, keeper, known)

    def write_part(
        self,
        name: str,
        update: TensorUpdate | FullStream | np.ndarray,
        *,
        shape: tuple[int, ...],
        offset: int,
        dedup_against: str | None = None,
    ) -> dict[str, Any]:
        """Write the chunks of one shard's update (rows ``[offset, offset + rows)`` of the logical tensor
        ``name`` shaped ``shape``) and return its part, for the coordinator's :meth:`SaveTransaction.commit`.

        ``update`` describes the shard as a tensor of shape ``[rows, *shape[1:]]``: ``Full`` (or an array) of
        the shard, ``Rows`` with ids relative to ``offset``, or ``Same``. The returned JSON is the part as the
        manifest will hold it (``offset``, ``rows``, ``encoding`` and its chunks or segments) plus what the
        coordinator needs and does not store in the part: ``dtype``, ``shape`` (the logical tensor's) and
        ``stats`` (bytes written and deduplicated). Chunks of ``dedup_against``'s chain are not uploaded again.

        No lease of its own: call it while the coordinator's transaction is open (after ``begin_save``
        returned, before ``commit``), whose writer lease keeps gc from deleting these chunks whoever wrote
        them; ``commit`` checks that every chunk a part names is in the store with its size.
        """
        try:
            return self._write_part(name, update, tuple(int(x) for x in shape), int(offset), dedup_against)
        except PsguardError:
            raise
        except Exception as e:
            raise SaveError(f"writing part of {name!r} at row {offset} to {self.url} failed: {e}") from e

    def _write_part(
        self,
        name: str,
        update: TensorUpdate | FullStream | np.ndarray,
        shape: tuple[int, ...],
        offset: int,
        dedup_against: str | None,
    ) -> dict[str, Any]:
        if isinstance(update, np.ndarray):
            update = Full(update)
        if isinstance(update, Full):
            dtype, part_shape = update.value.dtype, tuple(update.value.shape)
        elif isinstance(update, FullStream):
            dtype, part_shape = update.dtype, update.shape
        elif isinstance(update, Rows):
            dtype, part_shape = update.values.dtype, tuple(int(x) for x in update.shape)
        else:
            dtype, part_shape = np.dtype(update.dtype), tuple(int(x) for x in update.shape)
        what = f"part of {name!r} at row {offset}"
        if not shape or not part_shape:
            raise ConfigError(f"{what}: a sharded tensor has rank >= 1 (parts are row ranges)")
        if dtype_name(dtype) == STRING:
            raise ConfigError(f"{what}: string tensors are saved whole by the coordinator, not in parts")
        rows = part_shape[0]
        if part_shape[1:] != shape[1:] or offset < 0 or offset + rows > shape[0]:
            raise ConfigError(
                f"{what}: a shard of {list(part_shape)} does not fit rows of a tensor shaped {list(shape)}"
            )
        known: set[str] = set()
        if dedup_against is not None:
            if not self.backend.exists(manifest_key(dedup_against)):
                raise ParentMissingError(f"{what}: checkpoint {dedup_against} to deduplicate against is gone")
            known = self._known_chunks(dedup_against)
        writer = ChunkWriter(self.backend, self._pool, inflight_bytes=self.inflight_bytes, known=known)
        if isinstance(update, Full | FullStream):
            if isinstance(update, Full):
                futs = writer.submit_tensor(update.value, self.chunk_bytes)
            else:
                futs = writer.submit_stream(update, self.chunk_bytes)
            writer.wait()
            part = Part(offset, rows, "full", chunks=tuple(f.result() for f in futs))
        elif isinstance(update, Rows):
            ids = np.asarray(update.ids, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= rows or np.any(np.diff(ids) <= 0)):
                raise ConfigError(f"{what}: row ids must be sorted, unique and within the shard's [0, {rows})")
            segs = writer.submit_rows(ids, update.values, self.chunk_bytes)
            writer.wait()
            part = Part(offset, rows, "rows", segments=tuple(f.result() for f in segs))
        else:
            part = Part(offset, rows, "same")
        doc = part.to_json()
        doc.update(
            dtype=dtype_name(dtype),
            shape=list(shape),
            stats={
                "bytes_written": writer.stats.bytes_written,
                "chunks_written": writer.stats.chunks_written,
                "bytes_deduplicated": writer.stats.bytes_deduplicated,
                "chunks_deduplicated": writer.stats.chunks_deduplicated,
            },
        )
        return doc

    def _encode(
        self, name: str, update: TensorUpdate | FullStream, parent: Manifest | None, writer: ChunkWriter
    ) -> tuple[str, tuple[int, ...], str, list[Future[Any]]]:
        if isinstance(update, FullStream):
            dtype = _storable(name, dtype_name(update.dtype))
            return dtype, update.shape, "full", writer.submit_stream(update, self.chunk_bytes)
        if isinstance(update, Full):
            value = update.value
            _storable(name, dtype_name(value.dtype))
            return (
                dtype_name(value.dtype),
                tuple(value.shape),
                "full",
                writer.submit_tensor(value, self.chunk_bytes),
            )
        if parent is None:
            raise ConfigError(f"tensor {name!r}: a full checkpoint needs whole tensors, got {type(update).__name__}")
        prev = parent.tensors.get(name)
        dtype = _storable(name, dtype_name(np.dtype(update.dtype)))
        shape = tuple(int(x) for x in update.shape)
        if prev is None or (prev.dtype, prev.shape) != (dtype, shape):
            was = f"{prev.dtype}{list(prev.shape)}" if prev else "absent"
            raise ConfigError(
                f"tensor {name!r}: a {type(update).__name__} update of {dtype}{list(shape)} cannot apply to "
                f"the parent's ({was}); save it whole"
            )
        if isinstance(update, Same):
            return dtype, shape, "same", []
        if dtype == STRING:
            raise ConfigError(f"tensor {name!r}: string tensors are saved whole, not by rows")
        ids = np.asarray(update.ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= shape[0] or np.any(np.diff(ids) <= 0)):
            raise ConfigError(f"tensor {name!r}: row ids must be sorted, unique and within [0, {shape[0]})")
        return dtype, shape, "rows", list(writer.submit_rows(ids, update.values, self.chunk_bytes))

    def _known_chunks(self, parent: str) -> set[str]:
        known: set[str] = set()
        for m in self.chain(parent):
            known.update(r.hash for r in m.refs())
        return known

    def _append_journal(self, m: Manifest) -> None:
        """Record the commit in order. Best effort: the manifest already is the commit."""
        entry = json.dumps(
            {"id": m.id, "step": m.step, "kind": m.kind, "parent": m.parent, "committed_at": m.committed_at}
        ).encode()
        try:
            if self._journal_seq < 0:
                self._journal_seq = self._last_journal_seq()
            for _ in range(1000):
                self._journal_seq += 1
                try:
                    self.backend.put_new(f"{JOURNAL_PREFIX}{self._journal_seq:012d}.json", entry)
                    return
                except ObjectExistsError:
                    continue  # another writer took this sequence number
        except PsguardError as e:
            log.warning("could not journal checkpoint %s (it is committed): %s", m.id, e)

    def _last_journal_seq(self) -> int:
        keys = self.backend.keys(JOURNAL_PREFIX)
        seqs = [
            int(k[len(JOURNAL_PREFIX) : -5])
            for k in keys
            if k.endswith(".json") and k[len(JOURNAL_PREFIX) : -5].isdigit() and len(k) - len(JOURNAL_PREFIX) - 5 <= 18
        ]
        return max(seqs, default=-1)

    def journal(self) -> list[dict[str, Any]]:
        """Journal entries in commit order."""
        out = []
        for key in self.backend.keys(JOURNAL_PREFIX):
            seq = key[len(JOURNAL_PREFIX) : -5]
            if not (key.endswith(".json") and seq.isdigit() and len(seq) <= 18):
                continue
            try:
                doc = parse_journal_entry(self.backend.get(key), key)
            except (CorruptCheckpointError, ObjectNotFoundError) as e:
                log.warning("skipping journal entry %s (the manifests are the commits): %s", key, e)
                continue
            doc["seq"] = int(seq)
            out.append(doc)
        return out

    # ----------------------------------------------------------------------------------------------- locks
    def _acquire_writer_lock(
        self, cid: str, parent: str | None, *, dedup_against: str | None = None
    ) -> tuple[Lease, LeaseKeeper]:
        """Create this save's lease and start refreshing it; then wait for a live gc to finish.

        ``parent`` (the checkpoint the save builds on) and ``dedup_against`` (whose chunks it reuses) are in
        the lease, so gc keeps both while it is live."""
        key = f"{LOCK_PREFIX}writer-{cid}.json"
        extra = {"dedup_against": dedup_against} if dedup_against not in (None, parent) else {}
        lease = Lease(self.backend, key, self.lock_ttl, checkpoint=cid, parent=parent, **extra)
        lease.create()
        keeper = LeaseKeeper(lease).start()
        try:
            # A gc that started before our lock existed may not have seen it: wait for it to finish.
            deadline = time.monotonic() + max(self.lock_ttl, 30.0)
            while True:
                doc, written = self._read_lease_with_mtime(GC_LOCK)
                if doc is None or lease_stale(doc, written, self._storage_now(key), self.lock_ttl):
                    return lease, keeper
                if time.monotonic() > deadline:
                    raise SaveError(f"a gc on {self.url} held its lock for over {max(self.lock_ttl, 30.0):.0f}s")
                keeper.check()
                time.sleep(0.2)  # polling another process's lock in the store: there is no event to wait on
        except BaseException:
            keeper.stop()
            lease.release()
            raise

    def _storage_now(self, hint_key: str | None = None) -> float:
        """The storage's clock (never this host's; see :mod:`psguard.store.lease`), minus its resolution."""
        return storage_now(self.backend, hint_key=hint_key) - self.backend.mtime_resolution

    def _read_lease_with_mtime(self, key: str) -> tuple[dict[str, Any] | None, float]:
        """The lease and when the storage wrote it (read in that order: a refresh in between only makes the
        lease look younger, the safe side)."""
        doc = read_lease(self.backend, key)
        if doc is None:
            return None, 0.0
        try:
            return doc, self.backend.mtime(key)
        except ObjectNotFoundError:
            return None, 0.0

    def _remove_if_unchanged(self, key: str, doc: Mapping[str, Any], written: float) -> bool:
        """Delete a lease judged stale, unless it changed since it was judged (refreshed, or taken over).

        Read-check-delete: on storage without a conditional delete a holder's refresh may still land
        between the check and the delete; the holder's next refresh then finds its lease gone and fails.
        """
        again, written_again = self._read_lease_with_mtime(key)
        if again is None or again.get("token") != doc.get("token") or written_again != written:
            return False
        log.info("event=stale_lock_removed key=%s holder=%s:%s", key, doc.get("host"), doc.get("pid"))
        self.backend.delete(key)
        return True

    def _live_writer_locks(self, now: float, *, remove: bool = True) -> list[dict[str, Any]]:
        """Writer leases still alive at storage time ``now``; stale ones are removed (``remove``)."""
        live = []
        for key in self.backend.keys(LOCK_PREFIX):
            if not key.startswith(f"{LOCK_PREFIX}writer-"):
                continue
            doc, written = self._read_lease_with_mtime(key)
            if doc is None:
                continue
            if lease_stale(doc, written, now, self.lock_ttl):
                if remove:
                    self._remove_if_unchanged(key, doc, written)
            else:
                live.append(doc)
        return live

    # ----------------------------------------------------------------------------------------------- gc
    def retain(
        self,
        *,
        keep_last: int | None,
        keep_every_hours: float | None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] = "min",
    ) -> GcReport | None:
        """A writer's retention after each commit (``max_to_keep``, ``keep_checkpoint_every_n_hours``, or a
        policy file's ``retention:``, whose keys these are).

        Skips the gc (its locks and listing) when nothing can go: no rule, or no more checkpoints than
        ``keep_last`` (the other rules only keep more). ``None`` when skipped.
        """
        if keep_last is None and keep_every_hours is None and keep_best is None:
            return None
        if keep_last is not None and len(self.checkpoint_ids()) <= keep_last:
            return None
        return self.gc(
            keep_last=keep_last, keep_every_hours=keep_every_hours, keep_best=keep_best, metric=metric, mode=mode
        )

    def gc(
        self,
        *,
        keep_last: int | None = None,
        keep_every_hours: float | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] = "min",
        dry_run: bool = False,
    ) -> GcReport:
        """Apply retention: delete checkpoints not kept (manifests first), then unreferenced chunks.

        Every parent a kept checkpoint needs is kept. Chunk deletion is deferred while a writer is active.
        """
        if keep_last is None and keep_every_hours is None and keep_best is None:
            raise ConfigError("gc needs a retention rule: keep_last, keep_every_hours or keep_best")
        if keep_every_hours is not None and not (math.isfinite(keep_every_hours) and keep_every_hours > 0):
            raise ConfigError(f"keep_every_hours must be a number of hours > 0, got {keep_every_hours}")
        for rule, n in (("keep_last", keep_last), ("keep_best", keep_best)):
            if n is not None and n < 0:
                raise ConfigError(f"{rule} must be >= 0, got {n}")
        if keep_last is not None and keep_last < 1 and keep_every_hours is None and keep_best is None:
            raise ConfigError("keep_last must be at least 1 (retention that keeps nothing is refused)")
        lease = Lease(self.backend, GC_LOCK, self.lock_ttl, op="gc")
        try:
            lease.create_new()
        except ObjectExistsError:
            doc, written = self._read_lease_with_mtime(GC_LOCK)
            if doc is not None:
                if not lease_stale(doc, written, self._storage_now(), self.lock_ttl):
                    raise PsguardError(
                        f"another gc is running on {self.url} ({doc.get('host')}:{doc.get('pid')}, "
                        f"since {doc.get('created_at')} by its clock); wait for it, it keeps its lock alive"
                    ) from None
                self._remove_if_unchanged(GC_LOCK, doc, written)
            try:
                lease.create_new()
            except ObjectExistsError:
                raise PsguardError(f"another gc started on {self.url} just now; run this one later") from None
        keeper = LeaseKeeper(lease).start()
        try:
            now = self._storage_now(GC_LOCK)
            return self._gc(keep_last, keep_every_hours, keep_best, metric, mode, dry_run, keeper, now)
        except LeaseLostError as e:
            raise PsguardError(f"gc on {self.url} stopped: {e}. Nothing more was deleted; run gc again") from e
        finally:
            keeper.stop()
            lease.release()

    def _select(
        self,
        infos: Sequence[CheckpointInfo],
        keep_last: int | None,
        keep_every_hours: float | None,
        keep_best: int | None,
        metric: str | None,
        mode: Literal["min", "max"],
    ) -> tuple[set[str], dict[str, VerifyReport]]:
        """The checkpoints to keep, chosen among those that verify; and every verification done.

        Only the candidates a rule would keep are verified (cached per id, chunks read once across a chain);
        one that fails is dropped and the rule chooses again, so keep-last N keeps N *restorable*
        checkpoints and the newest restorable one is always among them. When nothing verifies, everything
        is kept: gc never deletes what might be the only copy an operator can still salvage.
        """
        reports: dict[str, VerifyReport] = {}
        chunk_results: dict[str, str | None] = {}

        def restorable(cid: str) -> bool:
            if cid not in reports:
                reports[cid] = self._verify(cid, chunk_results)
            return reports[cid].ok

        # A chain folded by compaction is superseded by its full copy, if that copy is sound: it then no
        # longer counts towards keep-last.
        present = {i.id for i in infos}
        superseded = {
            str(i.metadata["compacted_from"])
            for i in infos
            if i.metadata.get("compacted_from") in present and restorable(i.id)
        }
        pool = [Candidate(i.id, i.step, i.committed_at, i.metrics) for i in infos if i.id not in superseded]
        bad: set[str] = set()
        while True:
            chosen = select_kept(
                [c for c in pool if c.id not in bad],
                keep_last=keep_last,
                keep_every_hours=keep_every_hours,
                keep_best=keep_best,
                metric=metric,
                mode=mode,
            )
            failed = {cid for cid in chosen if not restorable(cid)}
            if not failed:
                break
            bad |= failed
        if pool and not chosen:
            log.error("event=gc_nothing_restorable store=%s action='keeping every checkpoint'", self.url)
            chosen = {i.id for i in infos}
        return chosen, reports

    def _gc(
        self,
        keep_last: int | None,
        keep_every_hours: float | None,
        keep_best: int | None,
        metric: str | None,
        mode: Literal["min", "max"],
        dry_run: bool,
        keeper: LeaseKeeper,
        now: float,
    ) -> GcReport:
        unreadable: list[str] = []
        infos = self.checkpoints(on_error=lambda cid, e: unreadable.append(cid))
        chosen, reports = self._select(infos, keep_last, keep_every_hours, keep_best, metric, mode)
        corrupt = tuple(p for r in reports.values() if not r.ok for p in r.problems)
        for r in reports.values():
            if not r.ok:
                log.warning(
                    "event=gc_corrupt_checkpoint checkpoint=%s problem=%r action='not counted by retention'",
                    r.checkpoint,
                    r.problems[0].message,
                )
        writers = self._live_writer_locks(now, remove=not dry_run)
        # A live writer's parent and the checkpoint it deduplicates against (v2 leases name both) stay.
        chosen.update(
            str(w[k]) for w in writers for k in ("parent", "dedup_against") if is_checkpoint_id(str(w.get(k) or ""))
        )
        kept = self._with_parents(chosen)
        doomed = [i.id for i in infos if i.id not in kept]
        if unreadable:
            log.warning("gc leaves %d unreadable manifest(s) alone: %s", len(unreadable), unreadable)
        if not dry_run:
            keeper.check()
            for cid in doomed:
                self.backend.delete(manifest_key(cid))
                with self._cache_lock:
                    self._manifests.pop(cid, None)
        deleted_chunks = young = 0
        late: list[str] = []
        # A live writer may be about to reference any chunk; an unreadable manifest may reference any chunk.
        deferred = bool(writers) or bool(unreadable)
        if not deferred:
            keeper.confirm()  # still our lease, just refreshed: no other gc runs beside this one
            # A second look, after the deletions: commits and writers that appeared since the first listing.
            listed = {i.id for i in infos}
            late = [cid for cid in self.checkpoint_ids() if cid not in listed]
            deferred = bool(self._live_writer_locks(now, remove=not dry_run))
        if not deferred:
            referenced: set[str] = set()
            for cid in kept:
                referenced.update(r.hash for r in self.manifest(cid).refs())
            for cid in late:
                try:
                    for m in self.chain(cid):
                        referenced.update(r.hash for r in m.refs())
                except CheckpointError as e:
                    log.warning("event=gc_late_commit_unreadable checkpoint=%s error=%r", cid, str(e))
            # Whatever the locks say, a chunk the storage wrote less than a lease ago may belong to a save in
            # progress (one whose lease was lost, or written by a host whose clock is off): leave it.
            grace = self.chunk_grace + self.backend.mtime_resolution
            for key, written in self.backend.mtimes(CHUNK_PREFIX).items():
                if key.rsplit("/", 1)[-1] in referenced:
                    continue
                if self.chunk_grace > 0 and now - written < grace:
                    young += 1
                    continue
                if not dry_run:
                    self.backend.delete(key)
                deleted_chunks += 1
            # With no live writer, a temporary object older than a lease is a killed writer's leftover.
            for key in self.backend.leftovers():
                try:
                    if now - self.backend.mtime(key) < grace:
                        continue
                except PsguardError:
                    continue
                if not dry_run:
                    self.backend.delete(key)
        log.info(
            "gc kept %d, deleted %d checkpoint(s) and %d chunk(s)%s%s",
            len(kept),
            len(doomed),
            deleted_chunks,
            " (chunk deletion deferred)" if deferred else "",
            f" ({young} unreferenced chunk(s) younger than a lease left)" if young else "",
        )
        return GcReport(tuple(sorted(kept)), tuple(doomed), deleted_chunks, deferred, dry_run, corrupt, young)

    def _with_parents(self, chosen: set[str]) -> set[str]:
        kept: set[str] = set()
        for cid in chosen:
            cur: str | None = cid
            while cur is not None and cur not in kept:
                kept.add(cur)
                try:
                    cur = self.manifest(cur).parent
                except CheckpointError:
                    break
        return kept

    # ----------------------------------------------------------------------------------------------- compaction
    def compact(self, checkpoint_id: str | None = None) -> CheckpointInfo | None:
        """Fold a delta chain into a new full checkpoint of the same step (same contents).

        Returns None when the checkpoint already is full. Memory holds one tensor at a time.
        """
        cid = checkpoint_id or self.resolve()
        m = self.manifest(cid)
        if m.kind == "full":
            return None
        chain = self.chain(cid)
        metadata = dict(m.metadata)
        metadata["compacted_from"] = cid
        lazy = _LazyTensors(self, chain)
        info = self.save(m.step, lazy, metadata=metadata, metrics=m.metrics, dedup_against=cid)
        log.info("compacted chain of %d ending at %s into full checkpoint %s", len(chain), cid, info.id)
        return info


#: The keys a part carries from :meth:`Store.write_part` to the commit that the manifest's part does not keep.
PART_TRANSPORT_KEYS = ("dtype", "shape", "stats")
_STAT_KEYS = ("bytes_written", "chunks_written", "bytes_deduplicated", "chunks_deduplicated")
_NO_PARTS: Mapping[str, Sequence[Mapping[str, Any]]] = MappingProxyType({})


def _check_metadata(metadata: Mapping[str, Any] | None) -> None:
    try:
        json.dumps(dict(metadata or {}), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint metadata must be plain JSON: {e}") from None


class SaveTransaction:
    """One checkpoint being written: its id and writer lease from :meth:`Store.begin_save`, its manifest (the
    single commit point) at :meth:`commit`.

    The coordinator (the chief's agent) opens it, the PS agents write their shards' chunks with
    :meth:`Store.write_part` and send back their parts, and :meth:`commit` writes one manifest holding the
    small tensors it encodes itself and the parts; a reader never sees a checkpoint with a part missing. A
    context manager: leaving it without a commit aborts (lease released, nothing committed).
    """

    def __init__(
        self,
        store: Store,
        checkpoint_id: str,
        step: int,
        parent: str | None,
        parent_manifest: Manifest | None,
        lease: Lease,
        keeper: LeaseKeeper,
        known: set[str],
    ) -> None:
        self.store = store
        self.checkpoint_id = checkpoint_id
        self.step = step
        self.parent = parent
        self._parent_m = parent_manifest
        self._lease = lease
        self._keeper = keeper
        self._known = known
        self._open = True

    @property
    def kind(self) -> str:
        return "full" if self.parent is None else "delta"

    def __enter__(self) -> SaveTransaction:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def abort(self) -> None:
        """Release the lease and commit nothing (the chunks written stay for gc); idempotent."""
        if self._open:
            self._open = False
            try:
                self._keeper.stop()
                self._lease.release()
            finally:
                self.store._tx_thread = None
                self.store._save_lock.release()

    def commit(
        self,
        tensors: Mapping[str, TensorUpdate | FullStream | np.ndarray],
        *,
        parts: Mapping[str, Sequence[Mapping[str, Any]]] = _NO_PARTS,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> CheckpointInfo:
        """Write ``tensors`` (encoded here, as :meth:`Store.save` does) and commit the manifest with them and
        with ``parts`` (tensor name -> the parts :meth:`Store.write_part` returned, in any order).

        The parts are validated exactly as a reader validates a manifest (sorted, contiguous, covering the
        tensor, chunk sizes matching rows) and every chunk they name must be in the store with its size (a
        stat, no read). The lease is confirmed right before the create-only manifest write. Any failure raises
        (:class:`SaveError` for an unexpected one) and commits nothing; the transaction is over either way.
        """
        if not self._open:
            raise ConfigError(f"checkpoint {self.checkpoint_id}: the transaction was already committed or aborted")
        try:
            manifest = self._commit(tensors, parts, metadata, metrics)
        except PsguardError:
            raise
        except Exception as e:
            raise SaveError(f"saving step {self.step} to {self.store.url} failed: {e}") from e
        finally:
            self.abort()
        store = self.store
        with store._cache_lock:
            store._manifests[manifest.id] = manifest
        store._append_journal(manifest)
        log.info(
            "committed checkpoint %s step=%d kind=%s tensors=%d written=%d bytes",
            manifest.id,
            manifest.step,
            manifest.kind,
            len(manifest.tensors),
            manifest.stats["bytes_written"],
        )
        return CheckpointInfo.of(manifest)

    def _commit(
        self,
        tensors: Mapping[str, TensorUpdate | FullStream | np.ndarray],
        parts: Mapping[str, Sequence[Mapping[str, Any]]],
        metadata_in: Mapping[str, Any] | None,
        metrics_in: Mapping[str, float] | None,
    ) -> Manifest:
        store, cid, step, parent, parent_m = self.store, self.checkpoint_id, self.step, self.parent, self._parent_m
        _check_metadata(metadata_in)
        metadata = dict(metadata_in or {})
        metrics = dict(metrics_in or {})
        both = sorted(set(tensors) & set(parts))
        if both:
            raise ConfigError(f"tensor(s) given both whole and in parts: {both[:10]}")
        sharded, part_stats = self._sharded_entries(parts)
        self._check_chunks_present(sharded)
        writer = ChunkWriter(store.backend, store._pool, inflight_bytes=store.inflight_bytes, known=self._known)
        pending: dict[str, tuple[str, tuple[int, ...], str, list[Future[Any]]]] = {}
        logical = sum(logical_nbytes(e.dtype, e.shape) for e in sharded.values())
        for name, update in tensors.items():
            if isinstance(update, np.ndarray):
                update = Full(update)
            dtype, shape, enc, futs = store._encode(name, update, parent_m, writer)
            pending[name] = (dtype, shape, enc, futs)
            logical += logical_nbytes(dtype, shape) if dtype != STRING else 0
            del update
        if parent_m is not None:
            absent = sorted(set(parent_m.tensors) - set(pending) - set(sharded))
            if absent:
                raise ConfigError(f"a delta must list every tensor of its parent; missing: {absent[:10]}")
        writer.wait()
        entries: dict[str, TensorEntry] = {}
        for name, (dtype, shape, enc, futs) in pending.items():
            results = [f.result() for f in futs]
            if enc == "full":
                entries[name] = TensorEntry(dtype, shape, "full", chunks=tuple(results))
                if dtype == STRING:
                    logical += sum(r.size for r in results)
            elif enc == "rows":
                entries[name] = TensorEntry(dtype, shape, "rows", segments=tuple(results))
            else:
                entries[name] = TensorEntry(dtype, shape, "same")
        entries.update(sharded)
        stats = {
            "logical_bytes": logical,
            "bytes_written": writer.stats.bytes_written + part_stats["bytes_written"],
            "chunks_written": writer.stats.chunks_written + part_stats["chunks_written"],
            "bytes_deduplicated": writer.stats.bytes_deduplicated + part_stats["bytes_deduplicated"],
            "chunks_deduplicated": writer.stats.chunks_deduplicated + part_stats["chunks_deduplicated"],
        }
        manifest = Manifest(
            id=cid,
            step=step,
            kind="full" if parent_m is None else "delta",
            parent=parent,
            base=cid if parent_m is None else parent_m.base,
            chain_length=0 if parent_m is None else parent_m.chain_length + 1,
            committed_at=time.time(),
            tensors=entries,
            metadata=metadata,
            metrics=metrics,
            stats=stats,
            writer=store._writer_name,
        )
        try:
            self._keeper.confirm()  # the lease still ours, just refreshed: gc cannot have taken our chunks
        except LeaseLostError as e:
            raise SaveError(
                f"step {step}: the save's lock lease on {store.url} was lost while it ran ({e}); gc may have "
                "deleted its chunks, so nothing was committed. Save again"
            ) from e
        store.backend.put_new(manifest_key(cid), manifest.to_bytes())  # the commit
        return manifest

    def _sharded_entries(
        self, parts: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> tuple[dict[str, TensorEntry], dict[str, int]]:
        """The sharded entries the parts make, validated as a reader would (before any chunk is checked or a
        tensor uploaded); and the write statistics the PS agents reported."""
        entries: dict[str, TensorEntry] = {}
        stats = dict.fromkeys(_STAT_KEYS, 0)
        for name, plist in parts.items():
            plist = list(plist)
            if not isinstance(name, str) or not plist or not all(isinstance(p, Mapping) for p in plist):
                raise ConfigError(f"tensor {str(name)[:80]!r}: parts must be a non-empty list of write_part results")
            described = {(str(p.get("dtype")), json.dumps(p.get("shape"))) for p in plist}
            if len(described) != 1:
                raise ConfigError(f"tensor {name!r}: its parts disagree on dtype or shape: {sorted(described)[:4]}")
            dtype, shape_raw = plist[0].get("dtype"), plist[0].get("shape")
            if (
                not isinstance(dtype, str)
                or not isinstance(shape_raw, list)
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape_raw)
            ):
                raise ConfigError(f"tensor {name!r}: a part lacks the dtype and logical shape write_part gives it")
            shape = tuple(shape_raw)
            if self._parent_m is not None:
                prev = self._parent_m.tensors.get(name)
                if prev is None or (prev.dtype, prev.shape) != (dtype, shape):
                    was = f"{prev.dtype}{list(prev.shape)}" if prev else "absent"
                    raise ConfigError(
                        f"tensor {name!r}: parts of {dtype}{list(shape)} cannot apply to the parent's ({was})"
                    )
            stripped = [{k: v for k, v in p.items() if k not in PART_TRANSPORT_KEYS} for p in plist]
            stripped.sort(key=lambda p: p["offset"] if isinstance(p.get("offset"), int) else -1)
            entries[name] = sharded_entry_from_parts(self.checkpoint_id, self.kind, name, dtype, shape, stripped)
            for p in plist:
                reported = p.get("stats")
                if isinstance(reported, Mapping):
                    for k in _STAT_KEYS:
                        v = reported.get(k)
                        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                            stats[k] += v
        return entries, stats

    def _check_chunks_present(self, entries: Mapping[str, TensorEntry]) -> None:
        """Every chunk the parts name is in the store with its size: a stat each, in parallel, no read (other
        processes wrote them; their CRC32C is checked on every later read and by ``verify``)."""
        store = self.store
        refs: dict[str, tuple[str, ChunkRef]] = {}
        for name, entry in entries.items():
            for ref in entry.refs():
                refs.setdefault(ref.hash, (name, ref))

        def size(key: str) -> int | None:
            try:
                return store.backend.size(key)
            except ObjectNotFoundError:
                return None

        futures = [(name, ref, store._pool.submit(size, chunk_key(ref.hash))) for name, ref in refs.values()]
        _wait_all([f for *_, f in futures])
        for name, ref, f in futures:
            found = f.result()
            if found != ref.size:
                has = "is not in" if found is None else f"has {found} bytes (its part says {ref.size}) in"
                raise SaveError(
                    f"step {self.step}: tensor {name!r}: chunk {ref.hash} of a part {has} {store.url}; "
                    "nothing was committed"
                )


def _full_start(chain: Sequence[Manifest], name: str, whole: Callable[[TensorEntry], bool] = lambda e: e.whole) -> int:
    """Where tensor ``name`` of ``chain[-1]`` is rebuilt from: the index of the newest entry in the chain that is
    ``whole`` (by default: ``full``, or ``sharded`` with every part ``full``; a row-range read asks whether the
    entry holds all of its rows).

    Every manifest from there on must list the tensor with the same dtype and shape, else the checkpoint cannot
    be restored (:class:`CorruptCheckpointError`). Reads nothing: ``verify`` asks this of every tensor too.
    """
    target = chain[-1].tensors[name]
    for i in range(len(chain) - 1, -1, -1):
        entry = chain[i].tensors.get(name)
        if entry is None:
            raise CorruptCheckpointError(
                f"checkpoint {chain[-1].id}: tensor {name!r} is absent from its ancestor {chain[i].id}",
                checkpoint=chain[-1].id,
            )
        if (entry.dtype, entry.shape) != (target.dtype, target.shape):
            raise CorruptCheckpointError(
                f"checkpoint {chain[-1].id}: tensor {name!r} changes dtype/shape along the chain at {chain[i].id}",
                checkpoint=chain[-1].id,
            )
        if whole(entry):
            return i
    raise CorruptCheckpointError(
        f"checkpoint {chain[-1].id}: tensor {name!r} has no full value in its chain", checkpoint=chain[-1].id
    )


class _LazyTensors(Mapping[str, TensorUpdate | FullStream | np.ndarray]):
    """Materialises each tensor only when the writer asks for it; a sharded one a part at a time."""

    def __init__(self, store: Store, chain: list[Manifest]) -> None:
        self.store = store
        self.chain = chain
        self.names = list(chain[-1].tensors)

    def __getitem__(self, name: str) -> np.ndarray | FullStream:
        entry = self.chain[-1].tensors[name]
        if entry.encoding == "sharded" and entry.shape and entry.dtype != STRING and len(entry.parts) > 1:
            dtype = self.store._dtype_of(self.chain[-1], name, entry)
            return FullStream(tuple(entry.shape), dtype, _PartByPart(self.store, self.chain, name, entry).read)
        return self.store._materialise(self.chain, name, False)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class _PartByPart:
    """Rows of a sharded tensor of a chain, read for a writer in order, one part (a PS's shard, in the newest
    entry's partitioning) materialised at a time: compacting a format-2 chain holds one shard, not the table
    (a job of 100 PS x 10 GB: 10 GB, not 1 TB)."""

    def __init__(self, store: Store, chain: Sequence[Manifest], name: str, entry: TensorEntry) -> None:
        self.store, self.chain, self.name = store, chain, name
        self.bounds = sorted((p.offset, p.stop) for p in entry.parts)
        self._part: tuple[int, int, np.ndarray] | None = None

    def read(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        row = start
        while row < stop:
            lo, hi = next((a, b) for a, b in self.bounds if a <= row < b)
            if self._part is None or self._part[0] != lo:
                self._part = None  # the previous part goes before the next is read
                self._part = (lo, hi, self.store._read_rows(self.chain, self.name, lo, hi, False))
            end = min(stop, hi)
            pieces.append(self._part[2][row - lo : end - lo].copy())
            row = end
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _storable(name: str, dtype: str) -> str:
    """Refuse to write a dtype no reader would restore (``DTYPE_NAMES``): better now than at restore time."""
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"tensor {name!r}: dtype {dtype} cannot be checkpointed (supported: {sorted(DTYPE_NAMES)})")
    return dtype


def _wait_all(futures: Sequence[Future[Any]]) -> None:
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


def _row_nbytes(shape: Sequence[int], dtype: np.dtype[Any]) -> int:
    """Bytes of one row (axis 0) of a tensor shaped ``shape``: 0 for a ``[n, 0]`` tensor."""
    return int(dtype.itemsize * math.prod(shape[1:]))


def _positions(refs: Sequence[ChunkRef], start: int) -> Iterator[tuple[ChunkRef, int]]:
    """Each chunk with its byte position when the chunks are laid end to end from ``start``."""
    pos = start
    for ref in refs:
        yield ref, pos
        pos += ref.size


def _whole_over(entry: TensorEntry, start: int, stop: int) -> bool:
    """Whether ``entry`` alone gives rows ``[start, stop)``: it is ``full``, or every part overlapping the
    range is ``full`` (a row-range read starts there, not at an older whole value)."""
    if entry.encoding == "full":
        return True
    if entry.encoding != "sharded":
        return False
    return all(p.encoding == "full" for p in entry.parts if p.offset < stop and p.stop > start)
