"""The durable checkpoint log: full checkpoints and chains of deltas over content-addressed chunks.

Layout under the store's root (specified in docs/storage-format.md)::

    chunks/ab/<sha256>          tensor bytes, named by their hash; shared by every checkpoint using them
    manifests/<id>.json         one per checkpoint; created last, create-only: the commit
    journal/<seq>.json          commits in the order they happened (create-only, one object each)
    locks/writer-<nonce>.json   a save in progress (protects its chunks and parent from gc)
    locks/gc.json               a gc in progress

:class:`Store` is a facade: each job is a module of its own, walked one at a time --
:mod:`~psguard.store.index` (listing, manifests, chains), :mod:`~psguard.store.reader` (restoring tensors),
:mod:`~psguard.store.writer` (saves, their transactions and the journal), :mod:`~psguard.store.verify`,
:mod:`~psguard.store.gc` (retention, gc and compaction) and :mod:`~psguard.store.lease` (the locks).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from psguard.errors import CheckpointError, ConfigError
from psguard.storage import Backend, RetryConfig, open_backend
from psguard.store.gc import Collector, GcReport, compact
from psguard.store.index import CheckpointInfo, Index
from psguard.store.lease import check_ttl
from psguard.store.manifest import Manifest
from psguard.store.reader import LoadResult, Reader
from psguard.store.verify import VerifyReport, chain_bytes, verify_all, verify_checkpoint
from psguard.store.writer import SaveTransaction, Writer
from psguard.tensors import FullStream, TensorUpdate

DEFAULT_CHUNK_BYTES = 8 << 20


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
        lock_ttl = check_ttl(lock_ttl)
        self.url = backend.url
        #: gc leaves unreferenced chunks younger than this (storage clock) alone; defaults to ``lock_ttl``.
        #: 0 turns the guard off: only for a test that knows its chunks are garbage.
        self.chunk_grace = lock_ttl if chunk_grace is None else chunk_grace
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="psguard-io")
        self._index = Index(backend)
        self._reader = Reader(self._index, self._pool)
        self._writer = Writer(
            self._index, self._pool, chunk_bytes=chunk_bytes, inflight_bytes=inflight_bytes, lock_ttl=lock_ttl
        )

    # The settings below live in the job that uses them; set here, they apply from the next call on.
    @property
    def backend(self) -> Backend:
        """The storage; may be replaced by a wrapper of it (the CLI meters reads that way)."""
        return self._index.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self._index.backend = backend

    @property
    def chunk_bytes(self) -> int:
        """The largest chunk a save cuts (one row at least)."""
        return self._writer.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self._writer.chunk_bytes = value

    @property
    def inflight_bytes(self) -> int:
        """The bytes a save holds read ahead of their upload."""
        return self._writer.inflight_bytes

    @inflight_bytes.setter
    def inflight_bytes(self, value: int) -> None:
        self._writer.inflight_bytes = value

    @property
    def lock_ttl(self) -> float:
        """The lease of a save or gc: refreshed every fifth of it while the work runs; a lease the storage
        has not seen refreshed for this long is stale. Short values stand for long saves in tests; at most
        :data:`~psguard.store.lease.MAX_TTL` (a day)."""
        return self._writer.lock_ttl

    @lock_ttl.setter
    def lock_ttl(self, value: float) -> None:
        self._writer.lock_ttl = check_ttl(value)

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
        return self._index.checkpoint_ids()

    def manifest(self, checkpoint_id: str) -> Manifest:
        """The parsed, checksum-verified manifest (cached: manifests are immutable)."""
        return self._index.manifest(checkpoint_id)

    def checkpoints(self, *, on_error: Callable[[str, CheckpointError], None] | None = None) -> list[CheckpointInfo]:
        """Every readable committed checkpoint, oldest first; unreadable manifests go to ``on_error``."""
        return self._index.checkpoints(on_error=on_error)

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint whose manifest reads (chunks not checked: see :meth:`load_latest`)."""
        return self._index.latest()

    def resolve(self, *, step: int | None = None, checkpoint_id: str | None = None) -> str:
        """The id for a step (the newest commit of it), an explicit id, or the latest checkpoint."""
        return self._index.resolve(step=step, checkpoint_id=checkpoint_id)

    def chain(self, checkpoint_id: str) -> list[Manifest]:
        """Manifests from the base to ``checkpoint_id``; a missing link, or a delta that does not list every
        tensor of its parent (as the format says a delta does), is a corrupt checkpoint. Every read, ``verify``
        and gc go through this."""
        return self._index.chain(checkpoint_id)

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
        return self._reader.load(checkpoint_id, names, verify_hash=verify_hash)

    def iter_tensors(self, checkpoint_id: str, *, verify_hash: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        """Tensors one at a time, so a large checkpoint is never all in memory at once."""
        return self._reader.iter_tensors(checkpoint_id, verify_hash=verify_hash)

    def read_rows(
        self, checkpoint_id: str, name: str, start: int, stop: int, *, verify_hash: bool = False
    ) -> np.ndarray:
        """Rows ``[start, stop)`` of tensor ``name`` of a checkpoint, bit-identical to slicing :meth:`load`'s.

        How a PS that lost its node (and its memory tier) reads exactly the rows it owns, without reading the
        whole tensor. Every chunk read is checked (size, CRC32C; SHA-256 with ``verify_hash``).
        """
        return self._reader.read_rows(checkpoint_id, name, start, stop, verify_hash=verify_hash)

    def updates(
        self, checkpoint_id: str, names: Collection[str] | None = None, *, verify_hash: bool = False
    ) -> tuple[dict[str, TensorUpdate], int]:
        """What ``checkpoint_id`` itself changed, per tensor (of ``names`` only, when given: a follower reads no
        chunk of a tensor it does not hold), read from its own chunks only; and the bytes read.

        A full checkpoint gives every tensor whole (``Full``); a delta gives ``Rows`` for its changed rows,
        ``Full`` for tensors it stored whole and ``Same`` for the others. Followers apply these in step order on
        top of the state they hold, instead of rebuilding every tensor (:meth:`load`). Every chunk is verified;
        a defect raises :class:`CorruptCheckpointError` before anything is returned.
        """
        return self._reader.updates(checkpoint_id, names, verify_hash=verify_hash)

    def load_latest(self, names: Sequence[str] | None = None) -> LoadResult:
        """Restore the newest checkpoint that verifies; fall back to older ones, saying which and why.

        Never returns data from a checkpoint that failed verification. A checkpoint with a chunk the storage
        fails to read is passed over like a corrupt one; :class:`NoCheckpointError` only when every checkpoint
        was read and none is usable (:class:`StorageError` when some could not be read).
        """
        return self._reader.load_latest(names)

    def verify(self, checkpoint_id: str) -> VerifyReport:
        """Read every chunk of the checkpoint's chain, checking size, CRC32C and SHA-256; report all defects."""
        return verify_checkpoint(self._index, self._pool, checkpoint_id)

    def verify_all(self, checkpoint_ids: Sequence[str]) -> Iterator[VerifyReport]:
        """:meth:`verify` of each checkpoint, each report yielded as soon as it is known, every chunk read once
        per call: a chunk several chains share (a base under many deltas) is checked the first time and its
        verdict reused, a failure included, for every later checkpoint that uses it."""
        return verify_all(self._index, self._pool, checkpoint_ids)

    def chain_bytes(self, checkpoint_ids: Sequence[str]) -> int:
        """The bytes of the distinct chunks the chains of ``checkpoint_ids`` reference (manifests only; a chain
        that cannot be read counts 0): what reading them all once costs."""
        return chain_bytes(self._index, checkpoint_ids)

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
        not uploaded again; the writer's lock keeps gc from deleting them meanwhile.
        """
        return self._writer.save(
            step, tensors, parent=parent, metadata=metadata, metrics=metrics, dedup_against=dedup_against
        )

    def begin_save(self, step: int, *, parent: str | None = None, dedup_against: str | None = None) -> SaveTransaction:
        """Open the transaction of one checkpoint: its id and writer lease now, its manifest at
        :meth:`SaveTransaction.commit`; leaving the ``with`` block without a commit aborts (lease released,
        nothing committed).

        While it is open, other processes (each PS's agent) write the chunks of their shards with
        :meth:`write_part` under its lease: gc deletes no chunk while a writer lease is live, whoever wrote
        the chunk. One transaction at a time per instance (another thread's ``begin_save`` waits).
        """
        return self._writer.begin_save(step, parent=parent, dedup_against=dedup_against)

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
        return self._writer.write_part(name, update, shape=shape, offset=offset, dedup_against=dedup_against)

    def journal(self) -> list[dict[str, Any]]:
        """Journal entries in commit order."""
        return self._writer.journal.entries()

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
        return self._collector().retain(
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
        return self._collector().gc(
            keep_last=keep_last,
            keep_every_hours=keep_every_hours,
            keep_best=keep_best,
            metric=metric,
            mode=mode,
            dry_run=dry_run,
        )

    def _collector(self) -> Collector:
        return Collector(self._index, self._pool, lock_ttl=self.lock_ttl, chunk_grace=self.chunk_grace)

    # ----------------------------------------------------------------------------------------------- compaction
    def compact(self, checkpoint_id: str | None = None) -> CheckpointInfo | None:
        """Fold a delta chain into a new full checkpoint of the same step (same contents).

        Returns None when the checkpoint already is full. Memory holds one tensor at a time.
        """
        return compact(self._index, self._reader, self._writer, checkpoint_id)
