"""What a store keeps, and how it shrinks: gc under retention rules, and compaction of delta chains.

``gc`` removes manifests first and chunks last, keeps every checkpoint a kept one needs, and leaves chunks
alone while a writer is active, so it is safe to run beside training. The rules themselves (which
checkpoints to keep) are :mod:`psguard.store.retention`'s; gc only counts checkpoints that verify.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from psguard.codec.dtypes import STRING
from psguard.codec.strict_json import JsonFields
from psguard.errors import CheckpointError, ConfigError, PsguardError
from psguard.store.index import CheckpointInfo, Index, IndexJob
from psguard.store.lease import GC_LOCK, LeaseKeeper, LeaseLostError, acquire_gc_lease, judging_now, live_writer_leases
from psguard.store.manifest import CHUNK_PREFIX, Manifest, TensorEntry, is_checkpoint_id, manifest_key
from psguard.store.reader import Reader
from psguard.store.retention import Candidate, select_kept
from psguard.store.verify import Problem, VerifyReport, verify_checkpoint
from psguard.store.writer import Writer
from psguard.tensors import FullStream, TensorUpdate

log = logging.getLogger(__name__)

#: How long retention after a commit trusts a chunk this store verified (content-addressed, so only storage damage
#: can change it): each commit's retention then reads the chunks it has not seen, not the whole chain again.
TRUST_VERIFIED_SECONDS = 3600.0


@dataclass(frozen=True)
class GcReport(JsonFields):
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


class Collector(IndexJob):
    """gc of one store, through its :class:`Index`, verifying on a pool of I/O threads.

    ``lock_ttl`` is the lease gc holds and judges writers' leases by; unreferenced chunks younger than
    ``chunk_grace`` (storage clock) are left alone. ``verified``: the store's chunks that verified, with when
    (monotonic), which :meth:`retain` trusts for ``TRUST_VERIFIED_SECONDS``; an explicit :meth:`gc` reads all.
    """

    def __init__(
        self,
        index: Index,
        pool: ThreadPoolExecutor,
        *,
        lock_ttl: float,
        chunk_grace: float,
        verified: dict[str, float] | None = None,
    ) -> None:
        self.index = index
        self.pool = pool
        self.lock_ttl = lock_ttl
        self.chunk_grace = chunk_grace
        self.verified = verified if verified is not None else {}

    def retain(
        self,
        *,
        keep_last: int | None,
        keep_every_hours: float | None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] = "min",
    ) -> GcReport | None:
        """A writer's retention after each commit (a policy file's ``retention:`` keys). Skips the gc when nothing
        can go (no rule, or no more checkpoints than ``keep_last``); ``None`` then. Its cost follows the commit,
        not the store: chunks verified within ``TRUST_VERIFIED_SECONDS`` are not read again, and the chunk sweep
        (a listing of every chunk) runs only when a checkpoint went; leftovers wait for that, or an explicit gc."""
        if keep_last is None and keep_every_hours is None and keep_best is None:
            return None
        if keep_last is not None and len(self.index.checkpoint_ids()) <= keep_last:
            return None
        rules = self._rules(keep_last, keep_every_hours, keep_best, metric, mode)
        return self._leased(rules, dry_run=False, after_commit=True)

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
        """Apply retention: delete checkpoints not kept (manifests first), then unreferenced chunks. Verifies every
        chunk a kept checkpoint needs.

        Every parent a kept checkpoint needs is kept. Chunk deletion is deferred while a writer is active.
        """
        return self._leased(self._rules(keep_last, keep_every_hours, keep_best, metric, mode), dry_run, False)

    @staticmethod
    def _rules(
        keep_last: int | None,
        keep_every_hours: float | None,
        keep_best: int | None,
        metric: str | None,
        mode: Literal["min", "max"],
    ) -> dict[str, Any]:
        if keep_last is None and keep_every_hours is None and keep_best is None:
            raise ConfigError("gc needs a retention rule: keep_last, keep_every_hours or keep_best")
        if keep_every_hours is not None and not (math.isfinite(keep_every_hours) and keep_every_hours > 0):
            raise ConfigError(f"keep_every_hours must be a number of hours > 0, got {keep_every_hours}")
        for rule, n in (("keep_last", keep_last), ("keep_best", keep_best)):
            if n is not None and n < 0:
                raise ConfigError(f"{rule} must be >= 0, got {n}")
        if keep_best is not None and not metric:
            raise ConfigError("keep_best needs the name of a reported metric (metric=...)")
        if keep_last is not None and keep_last < 1 and keep_every_hours is None and keep_best is None:
            raise ConfigError("keep_last must be at least 1 (retention that keeps nothing is refused)")
        rules: dict[str, Any] = {"keep_last": keep_last, "keep_every_hours": keep_every_hours, "keep_best": keep_best}
        rules.update(metric=metric, mode=mode)
        return rules

    def _leased(self, rules: Mapping[str, Any], dry_run: bool, after_commit: bool) -> GcReport:
        lease = acquire_gc_lease(self.backend, self.lock_ttl)
        keeper = LeaseKeeper(lease).start()
        try:
            return self._collect(rules, dry_run, keeper, judging_now(self.backend, GC_LOCK), after_commit)
        except LeaseLostError as e:
            raise PsguardError(f"gc on {self.index.url} stopped: {e}. Nothing more was deleted; run gc again") from e
        finally:
            keeper.stop()
            lease.release()

    def _select(
        self, infos: Sequence[CheckpointInfo], rules: Mapping[str, Any], trust: bool = False
    ) -> tuple[set[str], dict[str, VerifyReport]]:
        """The checkpoints to keep, chosen among those that verify; and every verification done.

        A candidate the rules keep that fails verification is dropped and the rules choose again, so keep-last N keeps
        N *restorable* checkpoints. When nothing verifies, everything is kept: it may be the only copy to salvage."""
        reports: dict[str, VerifyReport] = {}
        since = time.monotonic() - TRUST_VERIFIED_SECONDS
        for h in [h for h, at in self.verified.items() if at < since]:
            del self.verified[h]
        chunk_results: dict[str, str | None] = dict.fromkeys(self.verified) if trust else {}

        def restorable(cid: str) -> bool:
            if cid not in reports:
                reports[cid] = verify_checkpoint(self.index, self.pool, cid, chunk_results)
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
            chosen = select_kept([c for c in pool if c.id not in bad], **rules)
            failed = {cid for cid in chosen if not restorable(cid)}
            if not failed:
                break
            bad |= failed
        if pool and not chosen:
            log.error("event=gc_nothing_restorable store=%s action='keeping every checkpoint'", self.index.url)
            chosen = {i.id for i in infos}
        now = time.monotonic()
        self.verified.update(
            (h, now) for h, problem in chunk_results.items() if problem is None and h not in self.verified
        )
        return chosen, reports

    def _collect(
        self, rules: Mapping[str, Any], dry_run: bool, keeper: LeaseKeeper, now: float, after_commit: bool = False
    ) -> GcReport:
        unreadable: list[str] = []
        infos = self.index.checkpoints(on_error=lambda cid, e: unreadable.append(cid))
        chosen, reports = self._select(infos, rules, trust=after_commit)
        corrupt = tuple(p for r in reports.values() if not r.ok for p in r.problems)
        for r in (r for r in reports.values() if not r.ok):
            log.warning(
                "event=gc_corrupt_checkpoint checkpoint=%s problem=%r action='not counted by retention'",
                r.checkpoint,
                r.problems[0].message,
            )
        writers = live_writer_leases(self.backend, now, remove=not dry_run)
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
            self._delete_checkpoints(doomed, {i.id: i.chain_length for i in infos})
        deleted_chunks = young = 0
        late: list[str] = []
        # A live writer may be about to reference any chunk; an unreadable manifest may reference any chunk. After
        # a commit that made nothing go, only leftovers could: they wait for the next deletion.
        deferred = bool(writers) or bool(unreadable) or (after_commit and not doomed)
        if not deferred:
            keeper.confirm()  # still our lease, just refreshed: no other gc runs beside this one
            # A second look, after the deletions: commits and writers that appeared since the first listing.
            listed = {i.id for i in infos}
            late = [cid for cid in self.index.checkpoint_ids() if cid not in listed]
            deferred = bool(live_writer_leases(self.backend, now, remove=not dry_run))
        if not deferred:
            deleted_chunks, young = self._sweep_chunks(kept, late, now, dry_run)
        log.info(
            "gc kept %d, deleted %d checkpoint(s) and %d chunk(s)%s%s",
            len(kept),
            len(doomed),
            deleted_chunks,
            " (chunk deletion deferred)" if deferred else "",
            f" ({young} unreferenced chunk(s) younger than a lease left)" if young else "",
        )
        return GcReport(tuple(sorted(kept)), tuple(doomed), deleted_chunks, deferred, dry_run, corrupt, young)

    def _delete_checkpoints(self, doomed: list[str], depth: dict[str, int]) -> None:
        """Delete the manifests of ``doomed``, deltas before what they build on (a child's chain is one longer than
        its parent's): a gc that dies between two deletions leaves whole chains only, never a delta whose parent is
        gone."""
        for cid in sorted(doomed, key=lambda c: -depth[c]):
            self.backend.delete(manifest_key(cid))
            self.index.forget(cid)

    def _sweep_chunks(self, kept: set[str], late: list[str], now: float, dry_run: bool) -> tuple[int, int]:
        """Delete the chunks no kept or ``late`` checkpoint references, and killed writers' leftovers, none younger
        than a lease; how many chunks were deleted and how many unreferenced ones were left as too young."""
        deleted_chunks = young = 0
        referenced = {r.hash for cid in kept for r in self.index.manifest(cid).refs()}
        for cid in late:
            try:
                for m in self.index.chain(cid):
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
        # With no live writer, a temporary object older than a lease is a killed writer's leftover (the same
        # age rule as chunks: with chunk_grace=0 the caller says the lease has passed, whatever the mtime).
        for key in self.backend.leftovers():
            try:
                if self.chunk_grace > 0 and now - self.backend.mtime(key) < grace:
                    continue
            except PsguardError:
                continue
            if not dry_run:
                self.backend.delete(key)
        return deleted_chunks, young

    def _with_parents(self, chosen: set[str]) -> set[str]:
        kept: set[str] = set()
        for cid in chosen:
            cur: str | None = cid
            while cur is not None and cur not in kept:
                kept.add(cur)
                try:
                    cur = self.index.manifest(cur).parent
                except CheckpointError:
                    break
        return kept


def compact(index: Index, reader: Reader, writer: Writer, checkpoint_id: str | None = None) -> CheckpointInfo | None:
    """:meth:`psguard.store.Store.compact` (documented there for its callers)."""
    cid = checkpoint_id or index.resolve()
    m = index.manifest(cid)
    if m.kind == "full":
        return None
    chain = index.chain(cid)
    metadata = {**m.metadata, "compacted_from": cid}
    info = writer.save(m.step, _LazyTensors(reader, chain), metadata=metadata, metrics=m.metrics, dedup_against=cid)
    log.info("compacted chain of %d ending at %s into full checkpoint %s", len(chain), cid, info.id)
    return info


class _LazyTensors(Mapping[str, TensorUpdate | FullStream | np.ndarray]):
    """Materialises each tensor only when the writer asks for it; a sharded one a part at a time."""

    def __init__(self, reader: Reader, chain: list[Manifest]) -> None:
        self.reader = reader
        self.chain = chain
        self.names = list(chain[-1].tensors)

    def __getitem__(self, name: str) -> np.ndarray | FullStream:
        entry = self.chain[-1].tensors[name]
        if entry.encoding == "sharded" and entry.shape and entry.dtype != STRING and len(entry.parts) > 1:
            dtype = self.reader.dtype_of(self.chain[-1], name, entry)
            return FullStream(tuple(entry.shape), dtype, _PartByPart(self.reader, self.chain, name, entry).read)
        return self.reader.materialise(self.chain, name, False)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class _PartByPart:
    """Rows of a sharded tensor of a chain, read for a writer in order, one part (a PS's shard, in the newest
    entry's partitioning) materialised at a time: compacting a format-2 chain holds one shard, not the table
    (a job of 100 PS x 10 GB: 10 GB, not 1 TB)."""

    def __init__(self, reader: Reader, chain: Sequence[Manifest], name: str, entry: TensorEntry) -> None:
        self.reader, self.chain, self.name = reader, chain, name
        self.bounds = sorted((p.offset, p.stop) for p in entry.parts)
        self._part: tuple[int, int, np.ndarray] | None = None

    def read(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        row = start
        while row < stop:
            lo, hi = next((a, b) for a, b in self.bounds if a <= row < b)
            if self._part is None or self._part[0] != lo:
                self._part = None  # the previous part goes before the next is read
                self._part = (lo, hi, self.reader.read_chain_rows(self.chain, self.name, lo, hi, False))
            end = min(stop, hi)
            pieces.append(self._part[2][row - lo : end - lo].copy())
            row = end
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
