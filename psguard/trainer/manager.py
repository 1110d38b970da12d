"""``psguard.CheckpointManager``: a drop-in for ``tf.train.CheckpointManager`` that saves incrementally,
asynchronously and verifiably, to a local folder, S3 or HDFS.

Switching an existing job is one line (``tf.train.CheckpointManager`` -> ``psguard.CheckpointManager``); the
differences a caller sees:

- ``save()`` returns a :class:`SaveHandle` at once: training stalls only while the changed rows are read
  from the PS into host memory (the capture); writing happens on a background thread. ``handle.result()``
  re-raises a failure, ``wait()`` blocks until every pending save is durable.
- ``directory`` is any store URL; ``latest_checkpoint`` and ``checkpoints`` are checkpoint ids of that store.
- Restores verify every chunk and fall back to the newest checkpoint that verifies, and they are complete:
  every saved tensor must land in a variable (optimizer slots included), or nothing is assigned and the
  error lists every mismatch.

Bounded memory: one save is written while at most one more waits; a save requested while both places are
taken is folded into the waiting one (its rows merged, the later values winning), so a slow or unavailable
store never queues an unbounded number of captures. A failed write keeps its rows and folds them into the
next save: nothing captured is lost while the store is down. Two captures never interleave.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from psguard.errors import NoCheckpointError, PsguardError, SaveError
from psguard.handoff.contract import Tier
from psguard.policy.engine import SaveContext, Schedule
from psguard.store.log import CheckpointInfo, Store
from psguard.tensors import Full, Rows, Same, TensorUpdate, merge_updates
from psguard.trainer.export import OBJECT_GRAPH_KEY, object_graph_bytes
from psguard.trainer.preemption import PreemptionHandler

log = logging.getLogger(__name__)

# The highest step each store directory's managers in this process saw (maybe_save/save). A manager built
# after a failure (in-process rejoin) or the failing trainer's last report (exit_for_restart) compares it with
# the step it restores to tell the agent how many steps were lost: the only party that knows both.
_seen_lock = threading.Lock()
_seen_steps: dict[str, int] = {}


#: How long the interpreter's exit waits for saves still being written by a manager nobody closed.
EXIT_WAIT_SECONDS = 600.0
_open_managers: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def _drain_at_exit() -> None:
    """Finish pending writes of managers never closed before the interpreter exits.

    ``tf.train.CheckpointManager.save`` is durable when it returns, so scripts written for it end without a
    ``close()``; our writer is a daemon thread, and without this the exit would cut the last saves off.
    """
    for manager in list(_open_managers):
        if not manager._writer.in_flight:
            continue
        log.warning("the process is exiting: waiting up to %.0fs for pending checkpoint writes", EXIT_WAIT_SECONDS)
        try:
            errors = manager._writer.wait(EXIT_WAIT_SECONDS)
        except TimeoutError:
            log.error("pending checkpoint writes did not finish within %.0fs: they are lost", EXIT_WAIT_SECONDS)
            continue
        for e in errors:
            log.error("a checkpoint write failed before exit: %s", e)


# Before concurrent.futures stops taking work at shutdown (its own hook, registered the same way when it was
# imported, runs after ours: last in, first out); a plain atexit hook would run too late to write anything.
_register_exit_hook = getattr(threading, "_register_atexit", atexit.register)
_register_exit_hook(_drain_at_exit)


def last_seen_step(directory: str | None = None) -> int | None:
    """The highest step a manager of this process saw, for ``directory`` or any; ``None`` before any."""
    with _seen_lock:
        if directory is not None:
            return _seen_steps.get(directory)
        return max(_seen_steps.values(), default=None)


def _note_step(directory: str, step: int) -> None:
    with _seen_lock:
        if step > _seen_steps.get(directory, -1):
            _seen_steps[directory] = step


@dataclass(frozen=True)
class RestoreInfo:
    """What :meth:`CheckpointManager.restore_or_initialize` restored, and from which tier."""

    id: str  # the durable checkpoint id, or ``memory:<token>`` for the sidecar's memory tier
    step: int
    metadata: Mapping[str, Any]
    source: str  # "memory" or "durable"


class SaveHandle:
    """The pending result of one :meth:`CheckpointManager.save`.

    ``result(timeout)`` returns the committed :class:`~psguard.store.log.CheckpointInfo` or re-raises why the save
    failed. When saves were folded together (the store was slower than the save cadence), every folded handle
    resolves to the checkpoint that contains them, whose step is the latest folded one.
    """

    def __init__(self, step: int, stall_seconds: float) -> None:
        self.step = step
        self.stall_seconds = stall_seconds
        self._future: Future[CheckpointInfo] = Future()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"save of step {self.step} not durable within {timeout}s") from None

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SaveHandle(step={self.step}, {state})"


class _SpoolSaveHandle(SaveHandle):
    """A save handed to the sidecar: restorable once the agent acks it, durable once its persister commits.

    ``result()`` waits for the strongest tier the save was for: the durable checkpoint's info for a durable
    save, ``None`` for a memory-only save (then it is restorable from the sidecar's memory tier).
    """

    def __init__(self, step: int, stall_seconds: float, spooled: Any, store: Store) -> None:
        super().__init__(step, stall_seconds)
        self._spooled = spooled
        self._store = store

    def restorable(self, timeout: float | None = None) -> None:
        self._spooled.result(timeout)

    def result(self, timeout: float | None = None) -> CheckpointInfo:  # type: ignore[override]
        deadline = None if timeout is None else time.monotonic() + timeout
        self._spooled.result(timeout)
        if Tier.DURABLE not in self._spooled.tiers:
            return None  # type: ignore[return-value]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ack = self._spooled.durable(left)
        return CheckpointInfo.of(self._store.manifest(str(ack.checkpoint)))

    def done(self) -> bool:
        return bool(self._spooled.done())

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except BaseException as e:
            return e
        return None


@dataclass
class _Job:
    step: int
    updates: dict[str, TensorUpdate]
    metadata: dict[str, Any]
    metrics: dict[str, float]
    handles: list[SaveHandle] = field(default_factory=list)

    def fold(self, newer: _Job) -> _Job:
        """This job followed by ``newer``, as one."""
        merged = dict(self.updates)
        for name, update in newer.updates.items():
            merged[name] = merge_updates(merged[name], update) if name in merged else update
        return _Job(newer.step, merged, newer.metadata, newer.metrics, [*self.handles, *newer.handles])

    @property
    def full(self) -> bool:
        return all(isinstance(u, Full) for u in self.updates.values())


class _Writer:
    """The background thread that persists captures in order, with one job writing and one waiting."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.m = manager
        self._cond = threading.Condition()
        self._waiting: _Job | None = None
        self._carry: _Job | None = None  # rows of a failed write, folded into the next job
        self._busy = False
        self._stop = False
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="psguard-writer", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        with self._cond:
            if self._stop:
                raise SaveError("the checkpoint manager is closed")
            self._waiting = self._waiting.fold(job) if self._waiting is not None else job
            self._cond.notify_all()

    @property
    def in_flight(self) -> bool:
        with self._cond:
            return self._busy or self._waiting is not None

    def wait(self, timeout: float | None) -> list[BaseException]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._busy or self._waiting is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"pending saves not durable within {timeout}s")
                self._cond.wait(left)
            errors, self._errors = self._errors, []
            return errors

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._stop:
                    self._cond.wait()
                if self._waiting is None:
                    return
                job, self._waiting = self._waiting, None
                if self._carry is not None:
                    job, self._carry = self._carry.fold(job), None
                self._busy = True
            try:
                info = self.m._persist(job)
            except BaseException as e:  # the handle carries it to the caller
                keep = self.m._after_failure(e)
                for h in job.handles:
                    h._future.set_exception(e)
                with self._cond:
                    if keep:
                        self._carry = _Job(job.step, job.updates, job.metadata, job.metrics)
                    self._errors.append(e)
            else:
                for h in job.handles:
                    h._future.set_result(info)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class CheckpointManager:
    """Incremental, asynchronous, verified checkpoints of a ``tf.train.Checkpoint`` (see the module doc).

    Arguments as ``tf.train.CheckpointManager`` where they exist:

    - ``checkpoint``: a ``tf.train.Checkpoint`` (or any trackable) whose variables to save.
    - ``directory``: a store URL (path, ``s3://``, ``hdfs://`` ...); ``storage_options`` go to its client.
    - ``max_to_keep`` / ``keep_checkpoint_every_n_hours``: retention, applied after each save (a kept delta
      keeps the checkpoints it is built on).
    - ``step_counter``: a variable whose value numbers saves when ``save()`` gets no ``checkpoint_number``.
    - ``coordinator``: the job's ``ClusterCoordinator``; captures drain it first so that weights, slots and
      counters all come from the same step.
    - ``policy``: a :class:`~psguard.policy.engine.Schedule`, a policy file or preset name, used by
      :meth:`maybe_save`. ``new_base_after``: fold the delta chain into a new full checkpoint (in the
      background, from storage, no stall) after this many deltas.
    - ``data_position``: a callable returning JSON (e.g. the number of batches consumed), stored with each
      checkpoint and returned by :attr:`restored_data_position` after a restore.
    - ``preemption``: install a SIGTERM handler: the next :meth:`maybe_save` saves at once, waits until it
      is durable (or, with a sidecar, in its memory tier) and exits the process (code 143).
    - ``spool``: the sidecar's spool folder (default: ``$PSGUARD_SPOOL``, which ``psguard agent`` sets for
      the trainer it runs). With a sidecar, saves are handed to it (it keeps a memory tier and writes the
      durable log in the background) and restores take its memory tier when that is at least as new as the
      durable log; ``restore_timeout`` bounds the wait for its answer.
    """

    def __init__(
        self,
        checkpoint: Any,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = None,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        *,
        coordinator: Any = None,
        policy: Schedule | str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        data_position: Callable[[], Any] | None = None,
        new_base_after: int = 16,
        preemption: bool = False,
        store: Store | None = None,
        capturer_options: Mapping[str, Any] | None = None,
        spool: str | os.PathLike[str] | None = None,
        restore_timeout: float = 120.0,
    ) -> None:
        from psguard.trainer.capture import Capturer

        if max_to_keep is not None and max_to_keep < 1:
            raise PsguardError("max_to_keep must be >= 1 or None (keep everything)")
        self._checkpoint = checkpoint
        self._directory = str(directory)
        self.checkpoint_name = checkpoint_name
        self._max_to_keep = max_to_keep
        self._keep_hours = keep_checkpoint_every_n_hours
        self._step_counter = step_counter
        self.coordinator = coordinator
        self.new_base_after = new_base_after
        self._data_position = data_position
        self.store = store or Store.open(self._directory, storage_options)
        self._owns_store = store is None
        self.capturer = Capturer(checkpoint, coordinator=coordinator, **dict(capturer_options or {}))
        self.schedule = _load_schedule(policy)
        self.context = SaveContext(started_at=time.time(), observed_since=time.time())
        self._preemption = PreemptionHandler().install() if preemption else None
        self._capture_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._last_id: str | None = None
        self._saves = 0
        self._graph: bytes | None = None
        self.restored: RestoreInfo | None = None
        self.restore_timeout = restore_timeout
        spool_dir = spool if spool is not None else os.environ.get("PSGUARD_SPOOL")
        self._spool: Any = None
        if spool_dir:
            from psguard.trainer.spool_writer import SpoolWriter

            self._spool = SpoolWriter(str(spool_dir))
        self._last_spooled: Any = None
        self.last_stall_seconds = 0.0
        # tf.train.Checkpoint creates save_counter lazily on its first save; create it now so it is part of
        # every capture (and of exports), and number saves by it as TF's manager does.
        self._save_counter = getattr(checkpoint, "save_counter", None)
        self._writer = _Writer(self)
        _open_managers.add(self)

    # ------------------------------------------------------------------------------------ tf.train API
    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self) -> Any:
        return self._checkpoint

    @property
    def max_to_keep(self) -> int | None:
        return self._max_to_keep

    @property
    def latest_checkpoint(self) -> str | None:
        """Id of the newest committed checkpoint in the store (``None`` when there is none)."""
        info = self.store.latest()
        return info.id if info else None

    @property
    def checkpoints(self) -> list[str]:
        """Ids of the committed checkpoints, oldest first."""
        return [i.id for i in self.store.checkpoints()]

    @property
    def data_position(self) -> Callable[[], Any] | None:
        """The callable whose JSON result is stored with each checkpoint (settable, e.g. by a Keras callback)."""
        return self._data_position

    @data_position.setter
    def data_position(self, fn: Callable[[], Any] | None) -> None:
        self._data_position = fn

    @property
    def restored_data_position(self) -> Any:
        """The data position saved with the checkpoint the last restore used (``None`` if none)."""
        return self.restored.metadata.get("data_position") if self.restored else None

    def save(
        self,
        checkpoint_number: int | None = None,
        *,
        metrics: Mapping[str, float] | None = None,
        tiers: frozenset[Tier] | None = None,
    ) -> SaveHandle:
        """Capture now (the only stall) and persist in the background; see :class:`SaveHandle`.

        ``tiers`` matters with a sidecar only: ``{Tier.MEMORY}`` makes a save restorable from its memory tier
        without asking for a durable write (the default is both).
        """
        with self._capture_lock:
            if self._save_counter is not None:
                self._save_counter.assign_add(1)
            if checkpoint_number is None and self.coordinator is not None:
                self.coordinator.join()  # read the step counter at the state the capture will see
            step = self._step_for(checkpoint_number)
            _note_step(self.directory, step)
            t0 = time.perf_counter()
            full = self._spool is not None and self._spool.parent is None
            updates = self.capturer.capture(full=full)
            stall = time.perf_counter() - t0
            self._add_object_graph(updates)
            handle = SaveHandle(step, stall)
            metadata: dict[str, Any] = {
                "partitioning": {n: list(i.partitioning) for n, i in self.capturer.tensors.items()},
                "writer": f"{socket.gethostname()}:{os.getpid()}",
                "checkpoint_name": self.checkpoint_name,
            }
            if self._data_position is not None:
                metadata["data_position"] = self._data_position()
            if self._spool is not None:
                # The agent writes the durable log: it applies our retention, and reports the stall.
                metadata["capture_stall_seconds"] = round(stall, 6)
                if self._max_to_keep is not None or self._keep_hours is not None:
                    from psguard.handoff.contract import RETENTION_KEY

                    metadata[RETENTION_KEY] = {"keep_last": self._max_to_keep, "keep_every_hours": self._keep_hours}
            self.last_stall_seconds = stall
            self._saves += 1
            if self._spool is not None:
                from psguard.handoff.spool import Capture

                wanted = tiers or frozenset({Tier.MEMORY, Tier.DURABLE})
                spooled = self._spool.submit(Capture(step, updates, metadata, wanted, dict(metrics or {})))
                self._last_spooled = spooled
                handle = _SpoolSaveHandle(step, time.perf_counter() - t0, spooled, self.store)
            else:
                self._writer.submit(_Job(step, updates, metadata, dict(metrics or {}), [handle]))
        log.info("captured step %d in %.3fs (%s)", step, stall, _summary(updates))
        return handle

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is durable; raise :class:`SaveError` if any failed since last time."""
        errors = self._writer.wait(timeout)
        if errors:
            raise SaveError(f"{len(errors)} save(s) failed; the last: {errors[-1]}") from errors[-1]

    def restore_or_initialize(self, init_fn: Callable[[], Any] | None = None) -> str | None:
        """Restore the newest checkpoint that verifies, or run ``init_fn`` when there is none.

        Returns the restored checkpoint's id, or ``None``. Every saved tensor must land in a variable of the
        model (build the optimizer first: its slots must exist), else :class:`TensorMismatchError` lists the
        mismatches and nothing is assigned.
        """
        memory = self._restore_from_memory_tier()
        durable_latest = self.store.latest() if memory is not None else None
        token: str | None
        if memory is not None and (durable_latest is None or memory.step >= durable_latest.step):
            tensors = dict(memory.tensors)
            info = RestoreInfo(f"memory:{memory.token}", memory.step, memory.metadata, "memory")
            token = memory.token
        else:
            if memory is not None and durable_latest is not None:
                log.warning(
                    "the memory tier (step %d) is older than the durable log (step %d): restoring from the log",
                    memory.step,
                    durable_latest.step,
                )
            try:
                result = self.store.load_latest()
            except NoCheckpointError:
                if init_fn is not None:
                    init_fn()
                return None
            tensors = dict(result.tensors)
            info = RestoreInfo(result.info.id, result.info.step, result.info.metadata, "durable")
            from psguard.handoff.contract import TOKEN_KEY

            raw = result.info.metadata.get(TOKEN_KEY)
            token = str(raw) if raw else None
        tensors.pop(OBJECT_GRAPH_KEY, None)
        with self._capture_lock:
            self.capturer.restore(tensors)
            with self._state_lock:
                self._last_id = info.id if info.source == "durable" else None
            if self._spool is not None:
                self._spool.parent = token  # the next delta applies to exactly this state (None: send it whole)
            self.restored = info
            self._graph = None  # the restored manifest's graph may differ: send ours with the next save
        now = time.time()
        self.context = self.context.with_save((Tier.MEMORY, Tier.DURABLE), step=info.step, at=now)
        log.info("restored %s (step %d) from the %s tier", info.id, info.step, info.source)
        if self._spool is not None:  # under an agent: it counts the lost steps (psguard_lost_steps_total)
            from psguard.handoff.client import report_recovery

            report_recovery(info.step, seen_step=last_seen_step(self.directory), source=info.source)
        return info.id

    def _restore_from_memory_tier(self) -> Any:
        """The sidecar's memory-tier snapshot, verified; ``None`` when there is no sidecar or it has nothing."""
        if self._spool is None:
            return None
        if not self._spool.agent_alive():
            log.warning("no psguard agent holds spool %s: restoring from the durable log", self._spool.root)
            return None
        try:
            return self._spool.request_restore().result(self.restore_timeout)
        except NoCheckpointError:
            return None
        except (TimeoutError, PsguardError) as e:
            log.warning("the memory tier could not be used (%s): restoring from the durable log", e)
            return None

    def maybe_save(self, step: int | None = None, *, metrics: Mapping[str, float] | None = None) -> SaveHandle | None:
        """Ask the policy; save when it says so. Without a policy, never saves (call :meth:`save`)."""
        if self.schedule is None:
            return None
        step = self._step_for(step)
        _note_step(self.directory, step)
        now = time.time()
        ctx = self.context
        if self._preemption is not None:
            ctx = self._preemption.apply(ctx)
        if self._spool is not None:
            busy = self._last_spooled is not None and not self._last_spooled.done()
            ctx = _dc_replace(ctx, in_flight=frozenset({Tier.MEMORY}) if busy else frozenset())
        else:
            ctx = _dc_replace(ctx, in_flight=frozenset({Tier.DURABLE}) if self._writer.in_flight else frozenset())
        decision = self.schedule.decide(step, now, ctx)
        if not decision:
            return None
        if self._spool is None and Tier.DURABLE not in decision.tiers and not decision.urgent:
            # Without a sidecar there is no memory tier: memory-only saves wait for the durable cadence.
            return None
        handle = self.save(step, metrics=metrics, tiers=decision.tiers)
        self.context = ctx.with_save(decision.tiers, step=step, at=now, stall=handle.stall_seconds)
        log.info("save at step %d: %s", step, decision.reason)
        if decision.urgent and self._preemption is not None:
            remaining = self._preemption.remaining()
            try:
                if isinstance(handle, _SpoolSaveHandle):
                    handle.restorable(timeout=remaining)  # in the sidecar's memory: survives this process
                else:
                    handle.result(timeout=remaining)
            finally:
                self._preemption.done()
                self.close()
            sys.exit(self._preemption.exit_code)
        return handle

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending saves (re-raising failures), then stop the writer and release the store."""
        _open_managers.discard(self)
        try:
            self._writer.wait(timeout)
        finally:
            self._writer.close()
            if self._spool is not None:
                self._spool.close()
            if self._preemption is not None:
                self._preemption.uninstall()
            if self._owns_store:
                self.store.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ internals
    def _step_for(self, number: int | None) -> int:
        if number is not None:
            return int(number)
        if self._step_counter is not None:
            return int(
                np.asarray(self._step_counter.numpy() if hasattr(self._step_counter, "numpy") else self._step_counter)
            )
        return self._saves + 1

    def _add_object_graph(self, updates: dict[str, TensorUpdate]) -> None:
        graph = object_graph_bytes(self._checkpoint)
        if graph == self._graph:
            updates[OBJECT_GRAPH_KEY] = Same((), np.dtype(object))
        else:
            updates[OBJECT_GRAPH_KEY] = Full(np.array(graph, dtype=object))
            self._graph = graph

    def _persist(self, job: _Job) -> CheckpointInfo:
        """Runs on the writer thread."""
        with self._state_lock:
            parent = None if job.full else self._last_id
        if not job.full and parent is None:
            raise SaveError(f"step {job.step}: a delta without a checkpoint to build on (the next save is full)")
        info = self.store.save(job.step, job.updates, parent=parent, metadata=job.metadata, metrics=job.metrics)
        with self._state_lock:
            self._last_id = info.id
        if (
            info.kind == "delta"
            and info.parent is not None
            and self.new_base_after
            and (self.store.manifest(info.id).chain_length >= self.new_base_after)
        ):
            try:
                compacted = self.store.compact(info.id)
                if compacted is not None:
                    with self._state_lock:
                        self._last_id = compacted.id
            except PsguardError as e:
                log.warning("compaction after %s failed (the chain grows on): %s", info.id, e)
        self._apply_retention()
        return info

    def _after_failure(self, e: BaseException) -> bool:
        """Decide what a failed write means for the next one; True keeps its rows for the next save."""
        log.error("checkpoint write failed: %s", e)
        if isinstance(e, SaveError) and ("deleted" in str(e) or "without a checkpoint" in str(e)):
            with self._state_lock:
                self._last_id = None
            self.capturer.invalidate()
            self._graph = None
            return False
        return True

    def _apply_retention(self) -> None:
        try:
            self.store.retain(keep_last=self._max_to_keep, keep_every_hours=self._keep_hours)
        except PsguardError as e:
            log.warning("retention failed (will retry after the next save): %s", e)


def _dc_replace(ctx: SaveContext, **changes: Any) -> SaveContext:
    import dataclasses

    return dataclasses.replace(ctx, **changes)


def _load_schedule(policy: Schedule | str | os.PathLike[str] | None) -> Schedule | None:
    if policy is None or isinstance(policy, Schedule):
        return policy
    from psguard.policy.files import load_policy

    return load_policy(str(policy) if isinstance(policy, Path) else policy).schedule


def _summary(updates: Mapping[str, TensorUpdate]) -> str:
    full = sum(isinstance(u, Full) for u in updates.values())
    rows = sum(len(u.ids) for u in updates.values() if isinstance(u, Rows))
    return f"{full} whole, {rows} changed rows"
