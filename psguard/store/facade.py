"""The durable checkpoint log: full checkpoints and chains of deltas over content-addressed chunks.

Layout under the store's root (specified in docs/storage-format.md)::

    chunks/ab/<sha256>          tensor bytes, named by their hash; shared by every checkpoint using them
    manifests/<id>.json         one per checkpoint; created last, create-only: the commit
    journal/<seq>.json          commits in the order they happened (create-only, one object each)
    locks/writer-<nonce>.json   a save in progress (protects its chunks and parent from gc)
    locks/gc.json               a gc in progress

:class:`Store` is a facade over one module per job (index, reader, writer, verify, gc, lease); a method that only
routes to a job takes that job's signature and docstring (:func:`_routed`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar

from psguard.errors import ConfigError
from psguard.storage import Backend, RetryConfig, open_backend
from psguard.store.gc import Collector, compact
from psguard.store.index import CheckpointInfo, Index
from psguard.store.lease import check_ttl
from psguard.store.reader import Reader
from psguard.store.verify import VerifyReport, chain_bytes, verify_all, verify_checkpoint
from psguard.store.writer import Journal, Writer

DEFAULT_CHUNK_BYTES = 8 << 20

P = ParamSpec("P")
R = TypeVar("R")
Job = TypeVar("Job")


def _routed(
    job: Callable[[Store], Job], method: Callable[Concatenate[Job, P], R]
) -> Callable[Concatenate[Store, P], R]:
    """``method`` as a method of :class:`Store`, called on the store's ``job``: its signature and docstring are
    declared once, where the work is done, and the facade only routes."""

    @functools.wraps(method)
    def routed(store: Store, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(job(store), *args, **kwargs)

    return routed


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
        # The bytes read ahead of their upload: by default two chunks per I/O thread (one uploading, one ready);
        # more would only wait in the pool's queue, and are memory a PS agent holds beyond its shards.
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
        self._verified: dict[str, float] = {}  # chunks gc verified, for retention after commits (Collector)
        self._reader = Reader(self._index, self._pool)
        self._writer = Writer(
            self._index, self._pool, chunk_bytes=chunk_bytes, inflight_bytes=inflight_bytes, lock_ttl=lock_ttl
        )

    # The settings below live in the job that uses them.
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
    def lock_ttl(self) -> float:
        """The lease of a save or gc: refreshed every fifth of it while the work runs; a lease the storage
        has not seen refreshed for this long is stale. Short values stand for long saves in tests; at most
        :data:`~psguard.store.lease.MAX_TTL` (a day)."""
        return self._writer.lock_ttl

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
    checkpoint_ids = _routed(lambda store: store._index, Index.checkpoint_ids)
    manifest = _routed(lambda store: store._index, Index.manifest)
    checkpoints = _routed(lambda store: store._index, Index.checkpoints)
    latest = _routed(lambda store: store._index, Index.latest)
    resolve = _routed(lambda store: store._index, Index.resolve)
    chain = _routed(lambda store: store._index, Index.chain)
    load = _routed(lambda store: store._reader, Reader.load)
    iter_tensors = _routed(lambda store: store._reader, Reader.iter_tensors)
    read_rows = _routed(lambda store: store._reader, Reader.read_rows)
    updates = _routed(lambda store: store._reader, Reader.updates)
    load_latest = _routed(lambda store: store._reader, Reader.load_latest)

    def verify(self, checkpoint_id: str) -> VerifyReport:
        """Read every chunk of the checkpoint's chain, checking size, CRC32C and SHA-256; report all defects."""
        return verify_checkpoint(self._index, self._pool, checkpoint_id)

    def verify_all(self, checkpoint_ids: Sequence[str]) -> Iterator[VerifyReport]:
        """:meth:`verify` of each checkpoint, each report yielded as soon as it is known, every chunk read once
        per call: a chunk several chains share (a base under many deltas) is checked the first time and its
        verdict reused, a failure included, for every later checkpoint that uses it."""
        return verify_all(self._index, self._pool, checkpoint_ids)

    chain_bytes = _routed(lambda store: store._index, chain_bytes)

    # ----------------------------------------------------------------------------------------------- writing
    save = _routed(lambda store: store._writer, Writer.save)
    begin_save = _routed(lambda store: store._writer, Writer.begin_save)
    write_part = _routed(lambda store: store._writer, Writer.write_part)

    journal = _routed(lambda store: store._writer.journal, Journal.entries)
    append_journal = _routed(lambda store: store._writer.journal, Journal.append)

    # ----------------------------------------------------------------------------------------------- gc
    retain = _routed(lambda store: store._collector(), Collector.retain)
    gc = _routed(lambda store: store._collector(), Collector.gc)

    def _collector(self) -> Collector:
        return Collector(
            self._index, self._pool, lock_ttl=self.lock_ttl, chunk_grace=self.chunk_grace, verified=self._verified
        )

    # ----------------------------------------------------------------------------------------------- compaction
    def compact(self, checkpoint_id: str | None = None) -> CheckpointInfo | None:
        """Fold a delta chain into a new full checkpoint of the same step (same contents); None when the checkpoint
        already is full. Memory holds one tensor at a time (a sharded one, one part)."""
        return compact(self._index, self._reader, self._writer, checkpoint_id)
