"""The reader: tensors of a checkpoint rebuilt from its chain (base + deltas), every chunk read checked.

A tensor is rebuilt from the newest entry of the chain that holds it whole, then every later delta's entry is
applied in order (``full`` replaces, ``rows`` scatters, ``sharded`` does each part). Each chunk read is checked
(size and CRC32C; SHA-256 with ``verify_hash``) and any defect raises :class:`CorruptCheckpointError` naming the
checkpoint and chunk: nothing partially restored is ever returned.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from psguard.codec.dtypes import STRING, dtype_from_name, logical_nbytes
from psguard.codec.tensor_bytes import byte_view, deserialize_strings
from psguard.errors import (
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    StorageError,
    UnreadableChunkError,
    UnsupportedFormatError,
)
from psguard.store.chunks import LARGE_READ_BYTES, ChunkReader, wait_all
from psguard.store.index import CheckpointInfo, Index, IndexJob, full_start
from psguard.store.manifest import ChunkRef, Manifest, Segment, TensorEntry
from psguard.store.verify import Problem
from psguard.tensors import Full, Rows, Same, TensorUpdate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """A restored checkpoint: its info, its tensors, and the newer checkpoints skipped as unusable."""

    info: CheckpointInfo
    tensors: dict[str, np.ndarray]
    skipped: tuple[Problem, ...] = ()


class Reader(IndexJob):
    """Reads checkpoints through an :class:`Index`, on a pool of I/O threads. Thread-safe; holds no state."""

    def __init__(self, index: Index, pool: ThreadPoolExecutor) -> None:
        self.index = index
        self.pool = pool

    def load(
        self, checkpoint_id: str, names: Sequence[str] | None = None, *, verify_hash: bool = False
    ) -> dict[str, np.ndarray]:
        """Materialise tensors of a checkpoint (base + deltas), verifying every chunk read.

        Raises :class:`CorruptCheckpointError` naming the checkpoint and chunk on any defect; nothing
        partially restored is returned.
        """
        chain = self.index.chain(checkpoint_id)
        target = chain[-1]
        wanted = list(target.tensors) if names is None else list(names)
        missing = [n for n in wanted if n not in target.tensors]
        if missing:
            raise NoCheckpointError(f"checkpoint {checkpoint_id} has no tensor(s) {missing}", checkpoint=checkpoint_id)
        return {name: self.materialise(chain, name, verify_hash) for name in wanted}

    def iter_tensors(self, checkpoint_id: str, *, verify_hash: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        """Tensors one at a time, so a large checkpoint is never all in memory at once."""
        chain = self.index.chain(checkpoint_id)
        for name in chain[-1].tensors:
            yield name, self.materialise(chain, name, verify_hash)

    def read_rows(
        self, checkpoint_id: str, name: str, start: int, stop: int, *, verify_hash: bool = False
    ) -> np.ndarray:
        """Rows ``[start, stop)`` of tensor ``name`` of a checkpoint, bit-identical to slicing :meth:`load`'s: how a PS
        that lost its node reads only the rows it owns. From the newest entry of the chain that covers the range with
        whole rows, only the chunks overlapping the range are read; later deltas' segments are filtered to it."""
        chain = self.index.chain(checkpoint_id)
        if name not in chain[-1].tensors:
            raise NoCheckpointError(f"checkpoint {checkpoint_id} has no tensor {name!r}", checkpoint=checkpoint_id)
        return self.read_chain_rows(chain, name, start, stop, verify_hash)

    def read_chain_rows(
        self, chain: Sequence[Manifest], name: str, start: int, stop: int, verify_hash: bool
    ) -> np.ndarray:
        """:meth:`read_rows` of a chain already read (compaction reads a sharded tensor a part at a time)."""
        checkpoint_id = chain[-1].id
        target = chain[-1].tensors[name]
        if not target.shape:
            raise ConfigError(f"tensor {name!r} of checkpoint {checkpoint_id} is a scalar: it has no rows")
        if not 0 <= start <= stop <= target.shape[0]:
            raise ConfigError(f"rows [{start}, {stop}) are not within tensor {name!r}'s {target.shape[0]} rows")
        if target.dtype == STRING:  # strings are stored whole and cut by bytes, not rows
            return self.materialise(chain, name, verify_hash)[start:stop].copy()
        dtype = self.dtype_of(chain[-1], name, target)
        out = np.empty((stop - start, *target.shape[1:]), dtype=dtype)
        if start == stop:
            return out
        first = full_start(chain, name, lambda e: _whole_over(e, start, stop))
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
                edges.append((self.pool.submit(reader.read, ref), r0, lo, hi))
        self._read_placed(reader, inside)
        wait_all([f for f, *_ in edges])
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
        _check_segments(m, name, segments, rb)
        id_futures = [self.pool.submit(reader.read, seg.ids) for seg in segments]
        wait_all(id_futures)
        hits = []
        for seg, f in zip(segments, id_futures, strict=True):
            ids = self._checked_ids(m, name, seg, f.result(), nrows, part) + base
            mask = (ids >= start) & (ids < stop)
            if mask.any():
                hits.append((seg, ids, mask, self.pool.submit(reader.read, seg.values)))
        wait_all([f for *_, f in hits])
        for seg, ids, mask, f in hits:
            rows = np.frombuffer(f.result(), dtype=out.dtype).reshape((seg.count, *out.shape[1:]))
            out[ids[mask] - start] = rows[mask]

    def materialise(self, chain: Sequence[Manifest], name: str, verify_hash: bool) -> np.ndarray:
        """Tensor ``name`` of ``chain[-1]``: its newest whole value in the chain, then every later entry applied."""
        start = full_start(chain, name)
        value = self._read_whole(chain[start], name, verify_hash)
        for m in chain[start + 1 :]:
            self._apply_entry(m, name, value, verify_hash)
        return value

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
            reader.check_claims(refs, self.pool)
        out = np.empty(entry.shape, dtype=self.dtype_of(m, name, entry))
        self._read_all(reader, refs, byte_view(out))
        return out

    def _apply_entry(self, m: Manifest, name: str, value: np.ndarray, verify_hash: bool) -> None:
        """Apply a later entry of the chain to ``value`` in place: ``full`` replaces, ``rows`` scatters,
        ``sharded`` does each part (full: its range; rows: at offset + ids; same: nothing)."""
        entry = m.tensors[name]
        if entry.encoding == "full":
            value[...] = self._read_full(m, name, verify_hash)
        elif entry.encoding == "rows":
            for ids, rows in self._segment_arrays(m, name, entry.segments, value.shape[0], value, verify_hash):
                value[ids] = rows
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

    def dtype_of(self, m: Manifest, name: str, entry: TensorEntry) -> np.dtype[Any]:
        """The entry's dtype; one no reader knows makes the checkpoint corrupt."""
        try:
            return dtype_from_name(entry.dtype)
        except ValueError as e:
            raise CorruptCheckpointError(f"checkpoint {m.id}: tensor {name!r}: {e}", checkpoint=m.id) from None

    def _read_full(self, m: Manifest, name: str, verify_hash: bool) -> np.ndarray:
        entry = m.tensors[name]
        reader = ChunkReader(self.backend, checkpoint=m.id, verify_hash=verify_hash)
        dtype = self.dtype_of(m, name, entry)
        total = sum(c.size for c in entry.chunks)
        if total > LARGE_READ_BYTES:  # claims only, so far: the store's real sizes first, then allocate
            reader.check_claims(entry.chunks, self.pool)
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
        wait_all([self.pool.submit(reader.read_into, ref, slot) for ref, slot in placed])

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
        _check_segments(m, name, segments, rb)
        futures = [
            (seg, self.pool.submit(reader.read, seg.ids), self.pool.submit(reader.read, seg.values)) for seg in segments
        ]
        wait_all([f for _, a, b in futures for f in (a, b)])
        return [
            (
                self._checked_ids(m, name, seg, f_ids.result(), nrows, part),
                np.frombuffer(f_vals.result(), dtype=like.dtype).reshape((seg.count, *like.shape[1:])),
            )
            for seg, f_ids, f_vals in futures
        ]

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

    def updates(
        self, checkpoint_id: str, names: Collection[str] | None = None, *, verify_hash: bool = False
    ) -> tuple[dict[str, TensorUpdate], int]:
        """What ``checkpoint_id`` itself changed, per tensor (of ``names`` only, when given), read from its own
        chunks only, and the bytes read: ``Full``, ``Rows`` or ``Same`` per tensor, which followers apply in step order
        instead of rebuilding every tensor. Every chunk is verified before anything is returned."""
        m = self.index.manifest(checkpoint_id)
        out: dict[str, TensorUpdate] = {}
        nbytes = 0
        for name, entry in m.tensors.items():
            if names is not None and name not in names:
                continue
            dtype = self.dtype_of(m, name, entry)
            nbytes += sum(r.size for r in entry.refs())
            if entry.encoding == "full":
                out[name] = Full(self._read_full(m, name, verify_hash))
            elif entry.encoding == "rows":
                if sum(r.size for r in entry.refs()) > LARGE_READ_BYTES:  # all kept at once: real sizes first
                    ChunkReader(self.backend, checkpoint=m.id).check_claims(entry.refs(), self.pool)
                like = np.empty((0, *entry.shape[1:]), dtype)
                pairs = self._segment_arrays(m, name, entry.segments, entry.shape[0], like, verify_hash)
                out[name] = _joined_rows(pairs, like, entry.shape)
            elif entry.encoding == "sharded":
                out[name] = self._sharded_update(m, name, entry, dtype, verify_hash)
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
        pairs: list[tuple[np.ndarray, np.ndarray]] = []
        for p in entry.parts:  # sorted by offset, ids sorted within a part: the logical ids come out sorted
            if p.encoding == "full":
                rows = np.empty((p.rows, *entry.shape[1:]), dtype)
                self._read_all(reader, p.chunks, byte_view(rows))
                pairs.append((np.arange(p.offset, p.stop, dtype=np.int64), rows))
            elif p.encoding == "rows":
                segments = self._segment_arrays(m, name, p.segments, p.rows, like, verify_hash, part=True)
                pairs += [(ids + p.offset, rows) for ids, rows in segments]
        return _joined_rows(pairs, like, entry.shape)

    def load_latest(self, names: Sequence[str] | None = None) -> LoadResult:
        """Restore the newest checkpoint that verifies; fall back to older ones, saying which and why.

        A corrupt, newer-format or unreadable checkpoint is skipped with a warning (an older one needing a chunk already
        found unreadable is skipped without trying again; the store must still answer a listing). Only when every
        checkpoint was read and none is usable is it :class:`NoCheckpointError`; if one was only unreadable, the call
        fails with :class:`StorageError`, since callers start from scratch on :class:`NoCheckpointError`."""
        skipped: list[Problem] = []
        unreadable: dict[str, UnreadableChunkError] = {}  # chunk hash -> the storage's failure to read it
        for cid in self.index.newest_first():
            try:
                known = self._needs_unreadable_chunk(cid, names, unreadable)
                if known is not None:
                    raise known
                tensors = self.load(cid, names)
                info = CheckpointInfo.of(self.index.manifest(cid))
            except UnreadableChunkError as e:
                self.index.checkpoint_ids()  # the store still answers (else its error goes to the caller)
                log.warning("checkpoint %s is unreadable (%s); falling back to an older checkpoint", cid, e)
                unreadable.setdefault(e.chunk, e)
                skipped.append(Problem(cid, e.chunk, str(e)))
                continue
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
        if unreadable:
            raise StorageError(
                f"no checkpoint in {self.index.url} could be restored, and the storage failed to read some "
                f"({len(skipped)} skipped: {detail}); they may be sound: fix the storage and restore again"
            ) from next(iter(unreadable.values()))
        raise NoCheckpointError(
            f"no usable checkpoint in {self.index.url}" + (f" ({len(skipped)} unusable: {detail})" if skipped else "")
        )

    def _needs_unreadable_chunk(
        self, checkpoint_id: str, names: Sequence[str] | None, unreadable: Mapping[str, UnreadableChunkError]
    ) -> UnreadableChunkError | None:
        """An :class:`UnreadableChunkError` when loading ``names`` of ``checkpoint_id`` would read a chunk the
        storage already failed to read (``unreadable``, by hash): a base under many deltas costs one retry
        deadline, not one per delta. Only unreadable chunks count: a chunk found corrupt may only have been
        described wrongly by a hostile manifest, and an older one may describe it rightly."""
        if not unreadable:
            return None
        chain = self.index.chain(checkpoint_id)
        wanted = list(chain[-1].tensors) if names is None else list(names)
        for m in chain:
            for name in wanted:
                entry = m.tensors.get(name)
                for ref in entry.refs() if entry is not None else ():
                    if ref.hash in unreadable:
                        return UnreadableChunkError(
                            f"checkpoint {checkpoint_id} needs chunk {ref.hash}, which the storage failed to read: "
                            f"{unreadable[ref.hash]}",
                            checkpoint=checkpoint_id,
                            chunk=ref.hash,
                        )
        return None


def _joined_rows(pairs: Sequence[tuple[np.ndarray, np.ndarray]], like: np.ndarray, shape: Sequence[int]) -> Rows:
    """One ``Rows`` update of the (ids, rows) pairs in order (none: no row, shaped as ``like``)."""
    ids = np.concatenate([i.astype(np.int64) for i, _ in pairs]) if pairs else np.zeros(0, np.int64)
    return Rows(ids, np.concatenate([r for _, r in pairs]) if pairs else like, tuple(shape))


def _check_segments(m: Manifest, name: str, segments: Sequence[Segment], rb: int) -> None:
    if any(seg.ids.size != 8 * seg.count or seg.values.size != rb * seg.count for seg in segments):
        raise CorruptCheckpointError(
            f"checkpoint {m.id}: tensor {name!r}: a segment's chunk sizes do not match its row count", checkpoint=m.id
        )


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
