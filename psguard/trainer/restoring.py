"""The restore side of :class:`~psguard.trainer.manager.CheckpointManager`: which tier a restore takes, and
loading it all or nothing.

A restore takes the newest state that loads: the sidecar's memory tier when it is at least as new as the log,
else the log (each PS agent reading its own rows when the agents keep the shards). A source that fails to load on
a PS is skipped, the variables untouched. A base class of the manager, not an object it holds: a restore resets
the state a save uses (capturer, chain, object graph, save context) under the same capture lock.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from psguard.dependencies import import_optional
from psguard.errors import NoCheckpointError, PsguardError, StorageError, TensorMismatchError
from psguard.handoff.client import report_recovery
from psguard.handoff.contract import TOKEN_KEY, Tier
from psguard.handoff.plan import Durable, Facts, Memory, Source, plan
from psguard.handoff.spool import NewerInMemoryError, Restored
from psguard.policy.engine import SaveContext, TierState
from psguard.storage.retry import RetryingBackend
from psguard.storage.waiting import StoreWait
from psguard.store import CheckpointInfo, Store
from psguard.trainer.capture import Capturer
from psguard.trainer.export import OBJECT_GRAPH_KEY
from psguard.trainer.recovery import is_cluster_failure
from psguard.trainer.registry import process_managers
from psguard.trainer.restore_status import DeferredRestore, RestoreStatus, read_pending_parts
from psguard.trainer.sinks import AgentSink, Sink
from psguard.trainer.variables import assign_existing, to_int

tf: Any = import_optional("tensorflow")

log = logging.getLogger(__name__)

#: How long a restore holding the memory tier's snapshot waits for the log to say whether it has anything newer.
STORE_CHECK_SECONDS = 5.0


@dataclass(frozen=True)
class RestoreInfo:
    """What :meth:`CheckpointManager.restore_or_initialize` restored, and from which tier."""

    id: str  # the durable checkpoint id, or ``memory:<token>`` for the sidecar's memory tier
    step: int
    metadata: Mapping[str, Any]
    source: str  # "memory" or "durable"

    @classmethod
    def durable(cls, checkpoint: CheckpointInfo) -> RestoreInfo:
        return cls(checkpoint.id, checkpoint.step, checkpoint.metadata, "durable")


def hook_restore(manager: RestoreSide) -> tuple[Any, Any]:
    """Put ``manager.restore`` in front of its checkpoint's ``restore`` (``checkpoint.restore(manager.
    latest_checkpoint)`` names an id TF cannot read); return TF's own restore (unbound) and the one the checkpoint
    had before (bound), which takes every other path, and every path once the weakly held manager is gone."""
    checkpoint = manager._checkpoint
    tf_restore = getattr(type(checkpoint), "restore", None)
    before = getattr(checkpoint, "restore", None)
    if tf_restore is None or before is None:
        return tf_restore, before
    ref = weakref.ref(manager)

    def restore(save_path: Any, options: Any = None) -> Any:
        owner = ref()
        if owner is None or owner._closed:
            return before(save_path, options=options)
        return owner.restore(save_path, options=options)

    restore.__doc__ = RestoreSide.restore.__doc__
    object.__setattr__(checkpoint, "restore", restore)  # past Trackable's attribute tracking
    return tf_restore, before


class RestoreSide:
    """The restores of :class:`~psguard.trainer.manager.CheckpointManager` (see the module doc); the manager
    sets every attribute declared here in its constructor."""

    store: Store
    capturer: Capturer
    restore_timeout: float
    restored: RestoreInfo | None
    context: SaveContext
    _sink: Sink
    _checkpoint: Any
    _directory: str
    _capture_lock: threading.Lock
    _deferred: DeferredRestore | None
    _snapshot_for: tuple[str, Restored] | None
    _shards_mapped: tuple[int, int] | None
    _graph: bytes | None
    _init_fn: Callable[[], Any] | None
    _step_counter: Any
    _checkpoint_interval: int | None
    _last_checkpoint_step: int | None
    _tf_restore: Any
    _restore_before: Any
    _closed: bool

    if TYPE_CHECKING:  # the manager's properties

        @property
        def coordinator(self) -> Any: ...

        @property
        def latest_checkpoint(self) -> str | None: ...

    def restore_or_initialize(self, init_fn: Callable[[], Any] | None = None) -> str | None:
        """Restore the newest checkpoint that verifies and return its id, or run ``init_fn`` (default: the
        constructor's) and return ``None``. Every variable gets a value or :class:`TensorMismatchError` lists
        the mismatches; saved values whose variables do not exist yet wait for them, as with TF."""
        restored = self._restore_newest()
        if restored is None:
            fn = init_fn if init_fn is not None else self._init_fn
            if fn is not None:
                fn()
            self.capturer.warm()  # the first save of a fresh job finds its capture traced, as after a restore
            return None
        if self._checkpoint_interval is not None:
            self._last_checkpoint_step = to_int(self._step_counter)
        return restored[0].id

    def restore(self, save_path: str, options: Any = None) -> Any:
        """``checkpoint.restore(save_path)`` with an id of this manager (any other path goes to TF): the newest id
        restores the newest state as :meth:`restore_or_initialize`, an older one that checkpoint from the log.
        Returns a :class:`RestoreStatus`."""
        path = os.fspath(save_path) if save_path is not None else None
        if path is None or not self._is_own(path):
            if self._restore_before is None:
                raise NoCheckpointError(f"{save_path!r} is not a checkpoint of {self._directory}")
            return self._restore_before(save_path, options=options)  # TF's (or another manager's)
        if self._snapshot_for is not None and self._snapshot_for[0] == path:
            memory, self._snapshot_for = self._snapshot_for[1], None
            if self._load_memory(memory, status=True) is None:
                raise NoCheckpointError(f"{path} did not load on the PS; call manager.restore_or_initialize()")
        elif path.startswith("memory:") or path == self.latest_checkpoint:
            if self._restore_newest(status=True) is None:
                raise NoCheckpointError(f"no checkpoint to restore in {self._directory}")
        else:  # an older durable checkpoint, whatever newer ones exist
            checkpoint, by_task = CheckpointInfo.of(self.store.manifest(path)), self.capturer.spilled_by_task()
            info, snap = RestoreInfo.durable(checkpoint), None
            if by_task and isinstance(self._sink, AgentSink):
                snap = self._sink.durable_snapshot(path, by_task, self.restore_timeout, force=True)
            if snap is not None and self._load(info, snap, status=True):
                self._restored(info)
            else:
                self._restore_loaded(checkpoint, self.store.load(path), status=True)
        assert self._deferred is not None and self.restored is not None
        return RestoreStatus(
            self._deferred, checkpoint_id=self.restored.id, step=self.restored.step, source=self.restored.source
        )

    def _is_own(self, path: str) -> bool:
        if path.startswith("memory:"):
            return True
        try:
            return path in set(self.store.checkpoint_ids())
        except StorageError:
            return False

    def _restore_newest(self, *, status: bool = False) -> tuple[RestoreInfo, Restored] | None:
        """The state the recovery plan (:mod:`psguard.handoff.plan`) restores, planned again as the trainer learns
        more: the memory tier, else the log's newest commit that loads, else nothing."""
        asked = self._ask_durable_latest() if self._sink.supervised else None
        snapshot = self._sink.memory_snapshot(self.restore_timeout)
        memory = None  # as the plan reads it: not held when it lacks the shards the capturer spilled
        if snapshot is not None:
            absent = [] if snapshot.parts else sorted(n for n in self.capturer.spilled if n not in snapshot.tensors)
            if absent:
                log.warning("the memory tier lacks the shards of %s: restoring from the durable log", absent[:3])
            memory = Memory(snapshot.step, snapshot.token, held=not absent)
        durable, latest = Durable(), None
        if memory is not None and memory.held is not False:
            assert snapshot is not None
            try:  # None when no answer came in time
                latest = (asked or self._ask_durable_latest()).result()
            except StorageError as e:
                at = f"step {snapshot.step}; the last durable commit: step {snapshot.durable_step}"
                why = f"the durable log did not answer within {STORE_CHECK_SECONDS:.0f}s ({e})"
                log.warning("%s: restoring the memory tier (%s)", why, at)
            durable = Durable.at(latest.step, latest.id) if latest is not None else Durable()
        while True:
            restore = plan(Facts(memory=memory, durable=durable)).restore
            if restore.source is Source.INITIAL:
                return None
            if restore.source is Source.MEMORY:
                if snapshot is None:  # the agents refused the log: every PS still gives the memory tier's state
                    snapshot = self._sink.memory_snapshot(self.restore_timeout)
                    if snapshot is None:
                        raise PsguardError(
                            f"{restore.why}; but the memory tier could not be exported: not restoring now"
                        )
                if (loaded := self._load_memory(snapshot, status=status, durable=latest)) is not None:
                    return loaded
                assert memory is not None
                memory = replace(memory, loads=False)
                continue
            if memory is not None:
                log.warning("restoring from the durable log: %s", restore.why)
            try:  # waiting for a store that does not answer: nothing else holds the state
                load = functools.partial(self._restore_from_the_log, force=restore.force, status=status)
                restored = StoreWait(self.store.backend).call(load, probe=self.store.checkpoint_ids)
            except NewerInMemoryError as refusal:  # its first export failed for a reason that was not the tiers'
                log.warning("%s: asking the memory tier again", refusal)
                memory, snapshot = Memory(None, held=True), None
                continue
            if restored is not None:
                return restored
            durable = Durable.none()

    def _restore_from_the_log(self, *, force: bool, status: bool) -> tuple[RestoreInfo, Restored] | None:
        """The newest durable checkpoint that loads, or None; ``force``: replace the memory tier's state (else the
        agents may refuse with :class:`NewerInMemoryError`)."""
        from_ps = self._durable_on_the_ps(force=force)
        if from_ps is not None and self._load(*from_ps, status=status):
            self._restored(from_ps[0])
            return from_ps
        try:
            result = self.store.load_latest()
        except NoCheckpointError:
            return None
        return self._restore_loaded(result.info, dict(result.tensors), status=status)

    def _load_memory(
        self, memory: Restored, *, status: bool, durable: CheckpointInfo | None = None
    ) -> tuple[RestoreInfo, Restored] | None:
        """Restore the memory tier's snapshot ``memory``; None when it did not load on the PS (nothing assigned).
        ``durable``: the log's newest commit, where the durable cadence goes on counting from."""
        info = RestoreInfo(f"memory:{memory.token}", memory.step, memory.metadata, "memory")
        if not self._load(info, memory, status=status):
            return None
        self._restored(info, durable=durable)
        return info, memory

    def _restore_loaded(
        self, checkpoint: CheckpointInfo, tensors: dict[str, np.ndarray], *, status: bool
    ) -> tuple[RestoreInfo, Restored]:
        info = RestoreInfo.durable(checkpoint)
        raw = checkpoint.metadata.get(TOKEN_KEY)
        snap = Restored(info.step, tensors, dict(info.metadata), str(raw) if raw else None)
        self._load(info, snap, status=status)
        self._restored(info)
        return info, snap

    def _load(self, info: RestoreInfo, snap: Restored, *, status: bool = False) -> bool:
        """Restore ``snap`` (the chief's tensors, and each PS's shards from files on its node); all or nothing.

        False, nothing assigned, when a PS could not load its files: the caller goes to an older or slower source
        rather than crash-looping. Without shard files, or on a cluster failure (the checkpoint is not at fault),
        it raises. Tensors without variables go to TF's deferred restoration (``status``: even when none do).
        """
        tensors = dict(snap.tensors)
        graph = tensors.pop(OBJECT_GRAPH_KEY, None)
        with self._capture_lock:
            self.capturer.coordinator = self.coordinator  # found now: the capturer drains it before assigning
            names = self.capturer.names()
            pending = {n: tensors.pop(n) for n in list(tensors) if n not in names}
            parts = {k: p for k, p in snap.parts.items() if k.name in names}
            pending_parts = {k: p for k, p in snap.parts.items() if k.name not in names}
            try:
                if pending_parts:  # read before anything is assigned: a damaged file fails the whole load
                    pending.update(read_pending_parts(pending_parts, snap.part_homes))
                if info.source == "durable":  # what the snapshot lacks and the model has no variable for
                    have = set(snap.tensors) | {k.name for k in snap.parts}
                    manifest = self.store.manifest(info.id)
                    wanted = [n for n in manifest.tensors if n not in have and n not in names]
                    pending.update(self.store.load(info.id, wanted) if wanted else {})
                waiting = {n: (tuple(np.shape(v)), np.asarray(v).dtype) for n, v in pending.items()}
                self._shards_mapped = None
                if snap.parts:  # each PS loads its shards on its own node
                    homes = {k: task for k, (task, _) in snap.part_homes.items() if task}
                    fps = {k: p for k, p in snap.part_fps.items() if k in parts}
                    self._shards_mapped = self.capturer.restore_parts(
                        tensors, parts, deferred=waiting, homes=homes, fingerprints=fps, mappable=snap.part_linked
                    )
                else:
                    self.capturer.restore(tensors, deferred=waiting)
            except (PsguardError, tf.errors.OpError, ValueError) as e:
                if not snap.parts or is_cluster_failure(e):
                    raise
                why = " ".join(str(e).split())[:400]
                log.warning("%s (step %d) did not load on the PS (%s): nothing assigned", info.id, info.step, why)
                return False
            self._sink.rebase(info.id if info.source == "durable" else None, snap.token)
            self._defer(pending, graph, info, status=status)
        return True

    def _defer(self, pending: dict[str, np.ndarray], graph: Any, info: RestoreInfo, *, status: bool) -> None:
        """Hand ``pending`` to TF's deferred restoration (replacing what an earlier restore left pending)."""
        self._close_deferred()
        if not pending and not status:
            return
        if graph is None:
            raise TensorMismatchError(
                f"{info.id} has no object graph, so its {len(pending)} tensor(s) without a variable in the model "
                f"cannot wait for one ({sorted(pending)[:5]}): build the optimizer before restoring"
            )
        raw = np.asarray(graph).item() if isinstance(graph, np.ndarray) else graph
        self._deferred = DeferredRestore(self._checkpoint, bytes(raw), pending, self._tf_restore)
        # TF creates some during its restore, a partitioned one's shards all from the first rows: assign again.
        made = assign_existing(self._checkpoint, pending)
        pending = {n: v for n, v in pending.items() if n not in made}
        if pending:
            names = ", ".join(sorted(pending)[:3]) + (", ..." if len(pending) > 3 else "")
            log.info(
                "restore of %s: %d tensor(s) wait for variables not created yet (%s)", info.id, len(pending), names
            )

    def _close_deferred(self) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            deferred.close()

    def _restored(self, info: RestoreInfo, *, durable: CheckpointInfo | None = None) -> None:
        with self._capture_lock:
            self.restored = info
            self._graph = None  # the restored manifest's graph may differ: send ours with the next save
        # A state restored from the memory tier is not durable: the durable cadence counts from the log's newest
        # commit (a new trainer process would otherwise count from step 0 and save the restored state at once,
        # holding its first steps for a durable commit of what the tier already holds).
        now = time.time()
        restored_tiers = (Tier.MEMORY, Tier.DURABLE) if info.source == "durable" else (Tier.MEMORY,)
        self.context = self.context.with_save(restored_tiers, step=info.step, at=now)
        if durable is not None and info.source == "memory" and durable.step <= info.step:
            self.context = replace(self.context, durable=TierState(durable.step, min(now, durable.committed_at)))
        mapped = self._shards_mapped
        shards = f"; the PS mapped {mapped[0]} of its {mapped[1]} shard file(s)" if mapped else ""
        log.info("restored %s (step %d) from the %s tier%s", info.id, info.step, info.source, shards)
        if self._sink.supervised:  # under an agent: it counts the lost steps (psguard_lost_steps_total)
            seen = process_managers.last_seen_step(self._directory)
            report_recovery(info.step, seen_step=seen, source=info.source, shards_mapped=mapped)

    def _durable_on_the_ps(self, *, force: bool = False) -> tuple[RestoreInfo, Restored] | None:
        """The newest durable checkpoint that loads, each PS's agent reading its own rows from the log (None
        when the PS agents keep no shards); one that fails is skipped for the next older, but the agents'
        refusal (:class:`NewerInMemoryError`) is raised at once."""
        by_task = self.capturer.spilled_by_task()
        if not by_task or not isinstance(self._sink, AgentSink):
            return None
        for checkpoint in sorted(self.store.checkpoints(), key=lambda c: (c.step, c.committed_at), reverse=True):
            try:
                snap = self._sink.durable_snapshot(checkpoint.id, by_task, self.restore_timeout, force=force)
            except NewerInMemoryError:
                raise
            except (PsguardError, TimeoutError) as e:
                log.warning(
                    "checkpoint %s could not be loaded on the PS agents (%s); trying an older one", checkpoint.id, e
                )
                continue
            return RestoreInfo.durable(checkpoint), snap
        return None

    def _ask_durable_latest(self) -> Future[CheckpointInfo | None]:
        """The durable log's newest checkpoint, asked on a thread beside the memory tier's export, bounded by
        ``STORE_CHECK_SECONDS``: a store that is down must not hold a restore that has its state in hand."""
        asked: Future[CheckpointInfo | None] = Future()
        backend = self.store.backend

        def ask() -> None:
            capped = backend.capped(STORE_CHECK_SECONDS) if isinstance(backend, RetryingBackend) else nullcontext()
            try:
                with capped:
                    asked.set_result(self.store.latest())
            except BaseException as e:  # handed to the restore, which decides
                asked.set_exception(e)

        threading.Thread(target=ask, name="psguard-durable-latest", daemon=True).start()
        return asked
