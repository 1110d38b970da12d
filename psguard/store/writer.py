"""The writer: chunks uploaded, then one manifest committed per checkpoint, then the commit journaled.

A checkpoint exists exactly when its manifest does; the manifest is written create-only after all its
chunks, so readers never see a torn checkpoint and no checkpoint is ever overwritten. A save holds a writer
lease (:mod:`psguard.store.lease`) from before its first chunk until its commit, so gc deletes none of the
chunks it wrote or reuses; the lease is confirmed right before the manifest is written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

import numpy as np

from psguard.codec.dtypes import DTYPE_NAMES, STRING, dtype_name, logical_nbytes
from psguard.errors import (
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    ObjectExistsError,
    ObjectNotFoundError,
    ParentMissingError,
    PsguardError,
    SaveError,
)
from psguard.store.chunks import ChunkWriter, wait_all
from psguard.store.index import CheckpointInfo, Index, IndexJob
from psguard.store.lease import REFRESH_EVERY, Lease, LeaseKeeper, LeaseLostError, acquire_writer_lease
from psguard.store.manifest import (
    JOURNAL_PREFIX,
    ChunkRef,
    Manifest,
    Part,
    PartEncoding,
    TensorEntry,
    check_tensor_name,
    chunk_key,
    manifest_key,
    new_checkpoint_id,
    parse_journal_entry,
    sharded_entry_from_parts,
)
from psguard.tensors import Full, FullStream, Rows, Same, TensorUpdate

log = logging.getLogger(__name__)

#: The keys a part carries from :meth:`Store.write_part` to the commit that the manifest's part does not keep.
PART_TRANSPORT_KEYS = ("dtype", "shape", "stats")
_STAT_KEYS = ("bytes_written", "chunks_written", "bytes_deduplicated", "chunks_deduplicated")
#: Tensor name -> the parts :meth:`Writer.write_part` returned for it (one per PS agent's shard range).
Parts = Mapping[str, Sequence[Mapping[str, Any]]]
_NO_PARTS: Parts = MappingProxyType({})


def check_metadata(metadata: Mapping[str, Any] | None) -> None:
    try:
        json.dumps(dict(metadata or {}), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint metadata must be plain JSON: {e}") from None


class Writer(IndexJob):
    """Saves checkpoints through an :class:`Index`, uploading on a pool of I/O threads: whole saves, the
    transactions of sharded ones and their parts. One transaction at a time per instance."""

    def __init__(
        self, index: Index, pool: ThreadPoolExecutor, *, chunk_bytes: int, inflight_bytes: int, lock_ttl: float
    ) -> None:
        self.index = index
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        self.inflight_bytes = inflight_bytes
        self.lock_ttl = lock_ttl
        self.journal = Journal(index)
        self.name = f"{socket.gethostname()}:{os.getpid()}"  # the manifest's ``writer``
        self._save_lock = threading.Lock()
        self._tx_thread: int | None = None  # the thread whose transaction holds _save_lock

    @property
    def url(self) -> str:
        return self.index.url

    def save(
        self,
        step: int,
        tensors: Mapping[str, TensorUpdate | FullStream | np.ndarray],
        *,
        parent: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        dedup_against: str | None = None,
        journal: bool = True,
    ) -> CheckpointInfo:
        """Write a checkpoint and commit it: full when ``parent`` is None, else a delta over ``parent``. Chunks of
        ``parent``'s (or ``dedup_against``'s) chain are not uploaded again. One :meth:`begin_save` transaction; on any
        failure (:class:`SaveError`, cause chained) no checkpoint became visible. ``journal``: as in
        :meth:`SaveTransaction.commit`."""
        check_metadata(metadata)  # before any lease: bad input costs no storage round trip
        with self.begin_save(step, parent=parent, dedup_against=dedup_against) as tx:
            return tx.commit(tensors, metadata=metadata, metrics=metrics, journal=journal)

    def begin_save(self, step: int, *, parent: str | None = None, dedup_against: str | None = None) -> SaveTransaction:
        """Open the transaction of one checkpoint: its id and writer lease now, its manifest at
        :meth:`SaveTransaction.commit`. While it is open, each PS's agent may write its shards' chunks with
        :meth:`write_part` under its lease. One transaction at a time per instance (another thread's waits)."""
        reuse = dedup_against or parent
        if self._tx_thread == threading.get_ident():  # waiting for our own lock would never end
            raise ConfigError(f"a transaction is already open on {self.url} in this thread: commit or abort it first")
        self._save_lock.acquire()  # released when the transaction ends (commit or abort)
        self._tx_thread = threading.get_ident()
        try:
            try:
                cid = new_checkpoint_id(step)
                try:
                    parent_m = self.index.manifest(parent) if parent is not None else None
                except (NoCheckpointError, ObjectNotFoundError) as e:
                    raise ParentMissingError(f"step {step}: the parent checkpoint {parent} is gone: {e}") from e
                lease, keeper = acquire_writer_lease(
                    self.backend, cid, parent or reuse, self.lock_ttl, dedup_against=reuse
                )
                try:
                    if reuse is not None and not self.backend.exists(manifest_key(reuse)):
                        raise ParentMissingError(
                            f"checkpoint {reuse} was deleted (by gc?) while step {step} was being written on it"
                        )
                    known = self.known_chunks(reuse) if reuse is not None else set()
                except BaseException:
                    keeper.stop()
                    lease.release()
                    raise
            except PsguardError:
                raise
            except Exception as e:
                raise SaveError(f"saving step {step} to {self.url} failed: {e}") from e
        except BaseException:
            self.end_transaction()
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
        """Write the chunks of one shard's update (rows ``[offset, offset + rows)`` of tensor ``name`` shaped
        ``shape``: ``Full``, ``Rows`` with ids relative to ``offset``, or ``Same``) and return its part for
        :meth:`SaveTransaction.commit`, with the ``dtype``, logical ``shape`` and write ``stats`` the coordinator needs.

        No lease of its own: call it while the coordinator's transaction is open, whose writer lease keeps gc from these
        chunks; ``commit`` checks every chunk a part names is stored with its size. Any failure: :class:`SaveError`."""
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
        check_tensor_name(name)
        if isinstance(update, np.ndarray):
            update = Full(update)
        described = update.value if isinstance(update, Full) else update
        dtype, part_shape = np.dtype(described.dtype), tuple(int(x) for x in described.shape)
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
        if dedup_against is not None and not self.backend.exists(manifest_key(dedup_against)):
            raise ParentMissingError(f"{what}: checkpoint {dedup_against} to deduplicate against is gone")
        known = self.known_chunks(dedup_against) if dedup_against is not None else set()
        writer = ChunkWriter(self.backend, self.pool, inflight_bytes=self.inflight_bytes, known=known)
        enc, futs = self._submit(writer, update, rows, f"{what}: row ids must be sorted, unique and within the shard's")
        writer.wait()
        doc = Part(offset, rows, enc, **_payload(enc, futs)).to_json()
        doc.update(dtype=dtype_name(dtype), shape=list(shape), stats={k: getattr(writer.stats, k) for k in _STAT_KEYS})
        return doc

    def encode(
        self, name: str, update: TensorUpdate | FullStream, parent: Manifest | None, writer: ChunkWriter
    ) -> tuple[str, tuple[int, ...], PartEncoding, list[Future[Any]]]:
        check_tensor_name(name)
        described = update.value if isinstance(update, Full) else update
        dtype = _storable(name, dtype_name(np.dtype(described.dtype)))
        shape = tuple(int(x) for x in described.shape)
        if isinstance(update, Rows | Same):
            kind = type(update).__name__
            if parent is None:
                raise ConfigError(f"tensor {name!r}: a full checkpoint needs whole tensors, got {kind}")
            _check_fits(parent, name, dtype, shape, f"a {kind} update", "; save it whole")
            if isinstance(update, Rows) and dtype == STRING:
                raise ConfigError(f"tensor {name!r}: string tensors are saved whole, not by rows")
        ids_error = f"tensor {name!r}: row ids must be sorted, unique and within"
        return dtype, shape, *self._submit(writer, update, shape[0] if shape else 0, ids_error)

    def _submit(
        self, writer: ChunkWriter, update: TensorUpdate | FullStream, rows: int, ids_error: str
    ) -> tuple[PartEncoding, list[Future[Any]]]:
        """Hand ``update``'s chunks to ``writer``: its encoding and the futures of its chunks (or segments)."""
        if isinstance(update, FullStream):
            return "full", list(writer.submit_stream(update, self.chunk_bytes))
        if isinstance(update, Full):
            return "full", list(writer.submit_tensor(update.value, self.chunk_bytes))
        if isinstance(update, Same):
            return "same", []
        ids = _checked_ids(update.ids, rows, ids_error)
        return "rows", list(writer.submit_rows(ids, update.values, self.chunk_bytes))

    def known_chunks(self, parent: str) -> set[str]:
        """The hashes of every chunk of ``parent``'s chain: what a save on it need not upload again."""
        return {r.hash for m in self.index.chain(parent) for r in m.refs()}

    def end_transaction(self) -> None:
        """The open transaction is over (committed or aborted): the next ``begin_save`` may start."""
        self._tx_thread = None
        self._save_lock.release()


class Journal(IndexJob):
    """``journal/<seq>.json``: the commits in the order they happened, one create-only object each.

    Best effort: the manifests are the commits, so a commit whose journal entry could not be written is still
    committed, and a journal entry that does not parse is skipped with a warning.
    """

    def __init__(self, index: Index) -> None:
        self.index = index
        self._seq = -1  # the last sequence number this writer took (or saw taken)

    def append(self, m: Manifest | CheckpointInfo) -> None:
        """Record the commit ``m`` in order. Best effort: the manifest already is the commit."""
        entry = json.dumps(
            {"id": m.id, "step": m.step, "kind": m.kind, "parent": m.parent, "committed_at": m.committed_at}
        ).encode()
        try:
            if self._seq < 0:
                self._seq = max((seq for _, seq in self._seqs()), default=-1)
            for _ in range(1000):
                self._seq += 1
                try:
                    self.backend.put_new(f"{JOURNAL_PREFIX}{self._seq:012d}.json", entry)
                    return
                except ObjectExistsError:
                    continue  # another writer took this sequence number
        except PsguardError as e:
            log.warning("could not journal checkpoint %s (it is committed): %s", m.id, e)

    def _seqs(self) -> list[tuple[str, int]]:
        """The journal's keys with their sequence numbers (at most 18 digits: a stray huge name is ignored)."""
        keys = ((key, key[len(JOURNAL_PREFIX) : -5]) for key in self.backend.keys(JOURNAL_PREFIX))
        return [(key, int(seq)) for key, seq in keys if key.endswith(".json") and seq.isdigit() and len(seq) <= 18]

    def entries(self) -> list[dict[str, Any]]:
        """Journal entries in commit order."""
        out = []
        for key, seq in self._seqs():
            try:
                doc = parse_journal_entry(self.backend.get(key), key)
            except (CorruptCheckpointError, ObjectNotFoundError) as e:
                log.warning("skipping journal entry %s (the manifests are the commits): %s", key, e)
                continue
            doc["seq"] = seq
            out.append(doc)
        return out


class SaveTransaction:
    """One checkpoint being written: its id and writer lease from :meth:`Store.begin_save`, its manifest (the
    single commit point) at :meth:`commit`, holding the tensors it encodes itself and the parts the PS agents wrote
    with :meth:`Store.write_part`. Leaving the ``with`` block without a commit aborts."""

    def __init__(
        self,
        writer: Writer,
        checkpoint_id: str,
        step: int,
        parent: str | None,
        parent_manifest: Manifest | None,
        lease: Lease,
        keeper: LeaseKeeper,
        known: set[str],
    ) -> None:
        self.writer = writer
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
                self.writer.end_transaction()

    def commit(
        self,
        tensors: Mapping[str, TensorUpdate | FullStream | np.ndarray],
        *,
        parts: Parts | Callable[[], Parts] = _NO_PARTS,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        journal: bool = True,
    ) -> CheckpointInfo:
        """Encode ``tensors`` and commit the manifest with them and with ``parts`` (tensor name -> the parts
        :meth:`Store.write_part` returned). Parts are validated as a reader validates a manifest and every chunk they
        name must be stored with its size; the lease is confirmed right before the create-only manifest write. Any
        failure commits nothing; the transaction is over either way.

        ``parts`` may be a call that has the PS agents write their parts and returns them: it is made once this
        writer's own chunks are on their way, so the two uploads overlap (each is a round of writes, half a
        second on HDFS) instead of following one another. ``journal=False`` leaves the commit's journal entry to the
        caller (:meth:`Journal.append`, after it acknowledged the commit: one write less on the acknowledged path)."""
        if not self._open:
            raise ConfigError(f"checkpoint {self.checkpoint_id}: the transaction was already committed or aborted")
        try:
            manifest = self._commit(tensors, parts, metadata, metrics)
        except PsguardError:
            raise
        except Exception as e:
            raise SaveError(f"saving step {self.step} to {self.writer.url} failed: {e}") from e
        finally:
            self.abort()
        self.writer.index.remember(manifest)
        if journal:
            self.writer.journal.append(manifest)
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
        parts: Parts | Callable[[], Parts],
        metadata_in: Mapping[str, Any] | None,
        metrics_in: Mapping[str, float] | None,
    ) -> Manifest:
        owner, cid, step, parent, parent_m = self.writer, self.checkpoint_id, self.step, self.parent, self._parent_m
        check_metadata(metadata_in)
        if not callable(parts):  # given: refused before anything is uploaded
            sharded, part_stats = self._checked_parts(tensors, parts)
        writer = ChunkWriter(owner.backend, owner.pool, inflight_bytes=owner.inflight_bytes, known=self._known)
        pending: dict[str, tuple[str, tuple[int, ...], PartEncoding, list[Future[Any]]]] = {}
        logical = 0
        try:
            for name, update in tensors.items():
                if isinstance(update, np.ndarray):
                    update = Full(update)
                dtype, shape, enc, futs = owner.encode(name, update, parent_m, writer)
                pending[name] = (dtype, shape, enc, futs)
                logical += logical_nbytes(dtype, shape) if dtype != STRING else 0
                del update
            if callable(parts):  # the agents write theirs while ours upload
                sharded, part_stats = self._checked_parts(tensors, parts())
        except BaseException:
            with contextlib.suppress(Exception):
                writer.wait()  # nothing of this transaction still writing once it is over
            raise
        logical += sum(logical_nbytes(e.dtype, e.shape) for e in sharded.values())
        if parent_m is not None:
            absent = sorted(set(parent_m.tensors) - set(pending) - set(sharded))
            if absent:
                raise ConfigError(f"a delta must list every tensor of its parent; missing: {absent[:10]}")
        writer.wait()
        entries: dict[str, TensorEntry] = {}
        for name, (dtype, shape, enc, futs) in pending.items():
            entries[name] = TensorEntry(dtype, shape, enc, **_payload(enc, futs))
            if enc == "full" and dtype == STRING:
                logical += sum(r.size for r in entries[name].chunks)
        entries.update(sharded)
        stats = {"logical_bytes": logical, **{k: getattr(writer.stats, k) + part_stats[k] for k in _STAT_KEYS}}
        manifest = Manifest(
            id=cid,
            step=step,
            kind="full" if parent_m is None else "delta",
            parent=parent,
            base=cid if parent_m is None else parent_m.base,
            chain_length=0 if parent_m is None else parent_m.chain_length + 1,
            committed_at=time.time(),
            tensors=entries,
            metadata=dict(metadata_in or {}),
            metrics=dict(metrics_in or {}),
            stats=stats,
            writer=owner.name,
        )
        try:
            # The lease still ours and fresh (written within a fifth of its TTL, else rewritten now): gc cannot
            # have taken our chunks, and cannot before the manifest is written.
            self._keeper.confirm(fresh=self._lease.ttl * REFRESH_EVERY)
        except LeaseLostError as e:
            raise SaveError(
                f"step {step}: the save's lock lease on {owner.url} was lost while it ran ({e}); gc may have "
                "deleted its chunks, so nothing was committed. Save again"
            ) from e
        owner.backend.put_new(manifest_key(cid), manifest.to_bytes())  # the commit
        return manifest

    def _checked_parts(self, tensors: Mapping[str, Any], parts: Parts) -> tuple[dict[str, TensorEntry], dict[str, int]]:
        """The parts' entries, validated, with every chunk they name checked present; and their statistics."""
        both = sorted(set(tensors) & set(parts))
        if both:
            raise ConfigError(f"tensor(s) given both whole and in parts: {both[:10]}")
        sharded, stats = self._sharded_entries(parts)
        self._check_chunks_present(sharded)
        return sharded, stats

    def _sharded_entries(self, parts: Parts) -> tuple[dict[str, TensorEntry], dict[str, int]]:
        """The sharded entries the parts make, validated as a reader would (before any of their chunks is checked;
        given parts, also before this writer uploads a tensor); and the write statistics the PS agents reported."""
        entries: dict[str, TensorEntry] = {}
        stats = dict.fromkeys(_STAT_KEYS, 0)
        for name, plist in parts.items():
            plist = list(plist)
            check_tensor_name(name)
            if not plist or not all(isinstance(p, Mapping) for p in plist):
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
                _check_fits(self._parent_m, name, dtype, shape, "parts")
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
        owner = self.writer
        refs: dict[str, tuple[str, ChunkRef]] = {}
        for name, entry in entries.items():
            for ref in entry.refs():
                refs.setdefault(ref.hash, (name, ref))

        def size(key: str) -> int | None:
            try:
                return owner.backend.size(key)
            except ObjectNotFoundError:
                return None

        futures = [(name, ref, owner.pool.submit(size, chunk_key(ref.hash))) for name, ref in refs.values()]
        wait_all([f for *_, f in futures])
        for name, ref, f in futures:
            found = f.result()
            if found != ref.size:
                has = "is not in" if found is None else f"has {found} bytes (its part says {ref.size}) in"
                raise SaveError(
                    f"step {self.step}: tensor {name!r}: chunk {ref.hash} of a part {has} {owner.url}; "
                    "nothing was committed"
                )


def _check_fits(parent: Manifest, name: str, dtype: str, shape: tuple[int, ...], what: str, fix: str = "") -> None:
    """Refuse ``what`` (a row update, parts) of tensor ``name`` unless the parent holds it with this dtype and shape."""
    prev = parent.tensors.get(name)
    if prev is None or (prev.dtype, prev.shape) != (dtype, shape):
        was = f"{prev.dtype}{list(prev.shape)}" if prev else "absent"
        raise ConfigError(f"tensor {name!r}: {what} of {dtype}{list(shape)} cannot apply to the parent's ({was}){fix}")


def _payload(encoding: str, futures: Sequence[Future[Any]]) -> dict[str, Any]:
    """The chunks of a ``full`` entry or part, or the segments of a ``rows`` one, from their uploads' futures."""
    results = tuple(f.result() for f in futures)
    return {"full": {"chunks": results}, "rows": {"segments": results}}.get(encoding, {})


def _checked_ids(ids: np.ndarray, rows: int, message: str) -> np.ndarray:
    out = np.asarray(ids, dtype=np.int64)
    if out.size and (out.min() < 0 or out.max() >= rows or np.any(np.diff(out) <= 0)):
        raise ConfigError(f"{message} [0, {rows})")
    return out


def _storable(name: str, dtype: str) -> str:
    """Refuse to write a dtype no reader would restore (``DTYPE_NAMES``): better now than at restore time."""
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"tensor {name!r}: dtype {dtype} cannot be checkpointed (supported: {sorted(DTYPE_NAMES)})")
    return dtype
