"""The index: which checkpoints are committed, their manifests, and the chains they form.

A checkpoint exists exactly when its manifest does, so listing ``manifests/`` is listing the checkpoints; the
manifests are immutable once written (create-only), so each is read, checksum-verified and parsed once and then
served from memory. Nothing here reads a chunk.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from psguard.codec.strict_json import JsonFields
from psguard.errors import CheckpointError, ConfigError, CorruptCheckpointError, NoCheckpointError, ObjectNotFoundError
from psguard.storage import Backend
from psguard.store.manifest import (
    MANIFEST_PREFIX,
    Manifest,
    TensorEntry,
    is_checkpoint_id,
    manifest_key,
    parse_manifest,
    step_of_id,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo(JsonFields):
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


#: Manifests kept parsed per store, least recently used dropped first: another process's retention deletes
#: checkpoints unheard of, and chains are bounded by the new-base rule far below this.
MANIFEST_CACHE_ENTRIES = 128


class Index:
    """The committed checkpoints of one store, listed from its backend (the current one: the CLI may wrap it);
    at most :data:`MANIFEST_CACHE_ENTRIES` manifests cached, as they never change. Thread-safe."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.url = backend.url
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()
        self._cache_lock = threading.Lock()

    def checkpoint_ids(self) -> list[str]:
        """Ids of committed checkpoints in step order (names only; nothing verified yet)."""
        names = (key[len(MANIFEST_PREFIX) :] for key in self.backend.keys(MANIFEST_PREFIX))
        return sorted(n[:-5] for n in names if n.endswith(".json") and is_checkpoint_id(n[:-5]))

    def manifest(self, checkpoint_id: str) -> Manifest:
        """The parsed, checksum-verified manifest (cached: manifests are immutable)."""
        with self._cache_lock:
            cached = self._manifests.get(checkpoint_id)
            if cached is not None:
                self._manifests.move_to_end(checkpoint_id)
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
        self.remember(m)
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
        """The newest checkpoint whose manifest reads (chunks not checked: see :meth:`Store.load_latest`)."""
        for cid in self.newest_first():
            try:
                return CheckpointInfo.of(self.manifest(cid))
            except CheckpointError as e:
                log.warning("skipping checkpoint %s: %s", cid, e)
        return None

    def newest_first(self) -> list[str]:
        """Checkpoint ids, newest step first (same step: later commit first, as a compaction re-commits a step):
        the order a restore tries them in."""
        ids = self.checkpoint_ids()
        per_step = Counter(step_of_id(cid) for cid in ids)

        def key(cid: str) -> tuple[int, float]:
            step = step_of_id(cid)
            if per_step[step] == 1:
                return step, 0.0
            try:
                return step, self.manifest(cid).committed_at
            except CheckpointError:
                return step, -1.0

        return sorted(ids, key=key, reverse=True)

    def resolve(self, *, step: int | None = None, checkpoint_id: str | None = None) -> str:
        """The id for a step (the newest commit of it), an explicit id, or the latest checkpoint."""
        if checkpoint_id is not None:
            self.manifest(checkpoint_id)
            return checkpoint_id
        for cid in self.newest_first():
            if step is None or step_of_id(cid) == step:
                return cid
        where = f"at step {step} " if step is not None else ""
        raise NoCheckpointError(f"no checkpoint {where}in {self.url}")

    def chain(self, checkpoint_id: str) -> list[Manifest]:
        """Manifests from the base to ``checkpoint_id``; a missing link, or a delta that does not list every
        tensor of its parent (as the format says a delta does), is a corrupt checkpoint. Every read, ``verify``
        and gc go through this."""
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
        for parent, child in itertools.pairwise(out):
            missing = sorted(set(parent.tensors) - set(child.tensors))
            if missing:
                more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
                raise CorruptCheckpointError(
                    f"checkpoint {checkpoint_id}: delta {child.id} does not list tensor {missing[0][:200]!r}{more} "
                    f"of its parent {parent.id}; a delta lists every tensor of its parent, so this one was altered",
                    checkpoint=checkpoint_id,
                )
        return out

    def remember(self, m: Manifest) -> None:
        """Cache a manifest this process just committed (it is what a later read would parse)."""
        with self._cache_lock:  # most recently used last, the least recently used dropped
            self._manifests[m.id] = m
            self._manifests.move_to_end(m.id)
            while len(self._manifests) > MANIFEST_CACHE_ENTRIES:
                self._manifests.popitem(last=False)

    def forget(self, checkpoint_id: str) -> None:
        """Drop a deleted checkpoint's manifest from the cache."""
        with self._cache_lock:
            self._manifests.pop(checkpoint_id, None)


class IndexJob:
    """A job done through an :class:`Index`: its storage is the index's, whatever wrapper is current."""

    index: Index

    @property
    def backend(self) -> Backend:
        return self.index.backend


def full_start(chain: Sequence[Manifest], name: str, whole: Callable[[TensorEntry], bool] = lambda e: e.whole) -> int:
    """Where tensor ``name`` of ``chain[-1]`` is rebuilt from: the index of the newest entry in the chain that is
    ``whole`` (by default ``full``, or ``sharded`` with every part ``full``). Every manifest from there on must list
    the tensor with the same dtype and shape (:class:`CorruptCheckpointError`). Reads nothing."""
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
