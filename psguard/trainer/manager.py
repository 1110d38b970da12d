"""``psguard.CheckpointManager``: a drop-in for ``tf.train.CheckpointManager`` that saves incrementally,
asynchronously and verifiably to any store URL.

``save()`` stalls training only for the capture (the changed rows read into host memory) and returns a
:class:`SaveHandle`; the write happens in the background (:mod:`psguard.trainer.sinks`). Restores verify every
chunk, fall back to the newest checkpoint that verifies, and assign every variable or none
(:mod:`psguard.trainer.restoring`).
"""

from __future__ import annotations

import atexit
import collections
import faulthandler
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, Unpack

import numpy as np

from psguard.dependencies import import_optional
from psguard.errors import ConfigError, PsguardError, SaveError
from psguard.handoff.contract import ENV_PARTS, HANG_DUMP_SIGNAL, Tier
from psguard.handoff.spool import DeltaWithoutParentError, Restored
from psguard.policy.engine import Retention, SaveContext, Schedule
from psguard.policy.files import HangSpec, PolicySpec, PolicyWatcher, load_policy
from psguard.policy.lag import LagBound
from psguard.store import Store
from psguard.tensors import Full, Same, TensorUpdate
from psguard.trainer.capture import Capturer
from psguard.trainer.capture_graph import join_warming
from psguard.trainer.durable_lag import LagGuard, LagStatus
from psguard.trainer.export import OBJECT_GRAPH_KEY, object_graph_bytes
from psguard.trainer.options import MANAGER_MOVES, DeprecatedManagerArgs, ManagerOptions, apply_deprecated
from psguard.trainer.preemption import PreemptionHandler
from psguard.trainer.registry import process_managers
from psguard.trainer.restore_status import DeferredRestore, RestoreStatus
from psguard.trainer.restoring import RestoreInfo, RestoreSide, hook_restore
from psguard.trainer.sinks import (
    AgentSink,
    Job,
    MemoryCheckpoint,
    SaveHandle,
    Sink,
    SinkChoice,
    SinkKind,
    StoreSink,
    choose_sink,
    summary,
)
from psguard.trainer.spool_writer import SpoolWriter
from psguard.trainer.summaries import Summaries, handed_off_bytes
from psguard.trainer.variables import gather_variables, to_int, unwrap

__all__ = ["CheckpointManager", "MemoryCheckpoint", "RestoreInfo", "RestoreStatus", "SaveHandle"]

tf: Any = import_optional("tensorflow")
#: The manager is a ``tf.train.CheckpointManager``: libraries (orbit's ``Controller``) check the type.
_TFCheckpointManager: Any = tf.train.CheckpointManager

log = logging.getLogger(__name__)

T = TypeVar("T")

#: At most one heartbeat a second reaches the agent, however fast the steps.
HEARTBEAT_SECONDS = 1.0

#: How long the interpreter's exit waits for saves still being written by a manager nobody closed.
EXIT_WAIT_SECONDS = 600.0
# How long the exit waits for a capture function's warm-up after a restore (capture_graph.join_warming): 0.1-0.2 s
# when its PS are up; an unreachable PS must not hold the exit up longer.
WARM_EXIT_WAIT_SECONDS = 3.0


def _drain_at_exit() -> None:
    """Finish pending writes of managers never closed: scripts written for TF's manager end without ``close()``."""
    process_managers.drain_at_exit(EXIT_WAIT_SECONDS)
    join_warming(WARM_EXIT_WAIT_SECONDS)


# Before concurrent.futures stops taking work at shutdown; a plain atexit hook would run too late to write.
_register_exit_hook = getattr(threading, "_register_atexit", atexit.register)
_register_exit_hook(_drain_at_exit)


class _StepClock:
    """The median time of a step, and when the last heartbeat went to the agent."""

    def __init__(self, window: int = 64) -> None:
        self._per_step: collections.deque[float] = collections.deque(maxlen=window)
        self._last: tuple[int, float] | None = None
        self.sent_at = float("-inf")

    def observe(self, step: int, now: float) -> None:
        if self._last is not None and step > self._last[0]:
            self._per_step.append((now - self._last[1]) / (step - self._last[0]))
        if self._last is None or step != self._last[0]:
            self._last = (step, now)  # a step back (a restore) starts the clock again from there

    @property
    def median(self) -> float | None:
        return statistics.median(self._per_step) if self._per_step else None


def _part_dirs() -> dict[str, str]:
    """The PS agents' part folders the chief's agent announced (``ENV_PARTS``); empty when it did not."""
    raw = os.environ.get(ENV_PARTS)
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
        raise ConfigError(f"${ENV_PARTS} is not a JSON object of PS task -> folder: {raw[:200]!r}")
    return doc


class _Policy:
    """The manager's schedule and retention; a policy file is watched, so a valid edit takes effect."""

    def __init__(self, policy: Schedule | str | os.PathLike[str] | None, *, watch: bool) -> None:
        self._fixed: Schedule | None = None
        self._spec: PolicySpec | None = None
        self.watcher: PolicyWatcher | None = None
        if policy is None or isinstance(policy, Schedule):
            self._fixed = policy
        elif watch and Path(policy).is_file():
            self.watcher = PolicyWatcher(policy).start()
        else:
            self._spec = load_policy(os.fspath(policy))

    @property
    def spec(self) -> PolicySpec | None:
        return self.watcher.spec if self.watcher is not None else self._spec

    @property
    def schedule(self) -> Schedule | None:
        spec = self.spec
        return spec.schedule if spec is not None else self._fixed

    @schedule.setter
    def schedule(self, schedule: Schedule | None) -> None:
        self.close()
        self._fixed, self._spec = schedule, None

    def close(self) -> None:
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            watcher.stop()


class CheckpointManager(RestoreSide, _TFCheckpointManager):  # type: ignore[misc]
    """Incremental, asynchronous, verified checkpoints of a ``tf.train.Checkpoint``.

    A ``tf.train.CheckpointManager`` (orbit's ``Controller`` checks the type) that replaces every method. TF's
    arguments keep TF's order and meaning (``directory`` is a store URL; ``max_to_keep`` and
    ``keep_checkpoint_every_n_hours`` are the retention, else ``options.retention``, else a policy file's); then
    ``policy`` (a :class:`~psguard.policy.engine.Schedule`, policy file or preset, for :meth:`maybe_save`),
    ``options`` (:class:`~psguard.trainer.options.ManagerOptions`) and ``sink`` (``"store"``: this process writes
    the log; ``"agent"``: captures go to the sidecar's spool; ``None``: the agent's when ``$PSGUARD_SPOOL`` or
    ``options.spool`` names one). The keyword arguments taken before ``options`` still work, with a warning.
    """

    def __init__(
        self,
        checkpoint: Any,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = None,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
        last_checkpoint_step: int | None = None,
        *,
        policy: Schedule | str | os.PathLike[str] | None = None,
        options: ManagerOptions | None = None,
        sink: SinkKind | None = None,
        **deprecated: Unpack[DeprecatedManagerArgs],
    ) -> None:
        import_optional("tensorflow")  # without it, say which extra brings it (psguard[cpu] or psguard[gpu])
        opts = apply_deprecated(options or ManagerOptions(), deprecated, MANAGER_MOVES, callee="CheckpointManager")
        self.options = opts
        self._retention_arg = _retention_of(max_to_keep, keep_checkpoint_every_n_hours, opts.retention)
        if checkpoint_interval is not None and step_counter is None:
            raise ConfigError("checkpoint_interval counts steps of step_counter: pass step_counter= too (as TF's)")
        self._checkpoint, self._directory = checkpoint, str(directory)
        #: Which sink this manager uses and why (``repr`` shows it); chosen before the store is opened.
        self.sink: SinkChoice = choose_sink(sink, opts.spool, self._directory)
        self.checkpoint_name = checkpoint_name
        self._max_to_keep = max_to_keep
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._last_checkpoint_step = last_checkpoint_step
        self._init_fn = init_fn
        self._coordinator = opts.coordinator
        #: The callable whose JSON result is stored with each checkpoint (a Keras callback sets it).
        self.data_position = opts.data_position
        self.store = opts.store or Store.open(self._directory, opts.storage_options)
        self._owns_store = opts.store is None
        capture = opts.capture.capturer_kwargs()
        if self.sink.kind == "agent" and "spill_dirs" not in capture:
            capture["spill_dirs"] = _part_dirs()  # under an agent whose PS agents keep their shards
        self.capturer = Capturer(checkpoint, coordinator=opts.coordinator, **capture)
        self._deferred: DeferredRestore | None = None  # values waiting for variables the job creates later
        self._snapshot_for: tuple[str, Restored] | None = None  # what latest_checkpoint fetched for the restore
        self._shards_mapped: tuple[int, int] | None = None  # the last load's shards mapped by their PS, and loaded
        self._policy = _Policy(policy, watch=opts.watch_policy)
        self.context = SaveContext(started_at=time.time(), observed_since=time.time())
        self._preemption = PreemptionHandler().install() if opts.preemption else None
        self._capture_lock = threading.Lock()
        self._saves = 0
        self._graph: bytes | None = None
        self._graph_layout = -1  # the capturer's layout_version self._graph was made for
        self.restored: RestoreInfo | None = None
        # The tensor names of the state the sink's chain ends in, and the restore they were taken after.
        self._chain_names: frozenset[str] | None = None
        self._chain_names_restore: RestoreInfo | None = None
        self.restore_timeout = opts.restore_timeout
        self._sink: Sink = (
            AgentSink(SpoolWriter(self.sink.spool), self.store, retention=lambda: self.retention)
            if self.sink.spool is not None
            else StoreSink(self.store, retention=lambda: self.retention, on_parent_missing=self._forget_state)
        )
        self._lag = LagGuard(
            lambda: schedule.durable_lag if (schedule := self.schedule) is not None else LagBound(),
            agent_alive=self._sink.spool.agent_alive if isinstance(self._sink, AgentSink) else None,
            cancel=lambda: self._preemption is not None and self._preemption.requested_at is not None,
        )
        self.last_hold_seconds = self.last_stall_seconds = 0.0
        #: What the user set (``None``: the writer's default, NEW_BASE_AFTER or the agent's ``max_chain``).
        self._new_base_after = opts.new_base_after
        self._sink.set_new_base_after(opts.new_base_after)
        self._summaries = Summaries(opts.summaries) if opts.summaries is not None else None
        self._steps = _StepClock()
        if self._sink.supervised:
            # A hung trainer's agent asks for every thread's stack (to the task log) before it restarts it.
            faulthandler.register(HANG_DUMP_SIGNAL, all_threads=True, chain=False)
        # Made now (tf.train.Checkpoint makes it at its first save): in every capture, numbering saves as TF's.
        self._save_counter = getattr(checkpoint, "save_counter", None)
        self._closed = False
        self._tf_restore, self._restore_before = hook_restore(self)
        process_managers.opened(self, self._sink)

    def __repr__(self) -> str:
        return f"psguard.CheckpointManager(directory={self._directory!r}, sink={self.sink})"

    # ------------------------------------------------------------------------------------ tf.train API
    @property
    def max_to_keep(self) -> int | None:
        return self._max_to_keep

    @property
    def coordinator(self) -> Any:
        """The ``ClusterCoordinator`` captures drain: the one given, else the one of the variables' strategy."""
        if self._coordinator is None:  # the one registered on the strategy that made the variables, if any
            objects = (c for _, obj in gather_variables(self._checkpoint) for c in (obj, unwrap(obj)))
            strategies = (getattr(c, "_distribute_strategy", None) for c in objects)
            found = next((c for s in strategies if (c := getattr(s, "_cluster_coordinator", None)) is not None), None)
            if found is not None:
                self.coordinator = found
        return self._coordinator

    @coordinator.setter
    def coordinator(self, coordinator: Any) -> None:
        self._coordinator = coordinator
        self.capturer.coordinator = coordinator

    @property
    def latest_checkpoint(self) -> str | None:
        """Id of the newest checkpoint (``None``: none), for ``checkpoint.restore()``: before the first save or
        restore under an agent whose memory tier holds a save and the log none, ``memory:<token>``."""
        info = self.store.latest()
        if info is not None or not self._sink.supervised or self._saves or self.restored is not None:
            return info.id if info else None  # the memory tier is asked only before this generation's first save
        memory = self._sink.memory_snapshot(self.restore_timeout)
        if memory is None:
            return None
        cid = f"memory:{memory.token}"
        self._snapshot_for = (cid, memory)
        return cid

    @property
    def checkpoints(self) -> list[str]:
        """Ids of the committed checkpoints, oldest first."""
        return [i.id for i in self.store.checkpoints()]

    @property
    def summaries(self) -> str | None:
        """The folder psguard's TensorBoard scalars are written to (``None``: none are)."""
        return self._summaries.logdir if self._summaries is not None else None

    @property
    def restored_data_position(self) -> Any:
        """The data position saved with the checkpoint the last restore used (``None`` if none)."""
        return self.restored.metadata.get("data_position") if self.restored else None

    @property
    def schedule(self) -> Schedule | None:
        """The schedule :meth:`maybe_save` follows now (a watched policy file's current one)."""
        return self._policy.schedule

    @schedule.setter
    def schedule(self, schedule: Schedule | None) -> None:
        self._policy.schedule = schedule

    @property
    def retention(self) -> Retention | None:
        """The retention applied after each save now (``None``: keep every checkpoint)."""
        if self._retention_arg is not None:
            return self._retention_arg
        spec = self._policy.spec
        return spec.retention if spec is not None else None

    @property
    def new_base_after(self) -> int | None:
        """Deltas after which the chain gets a new base (``0``: only when a policy asks); ``None``: the
        writer's default (16, or under an agent its ``max_chain``)."""
        return self._new_base_after

    @new_base_after.setter
    def new_base_after(self, value: int | None) -> None:
        self._new_base_after = value
        self._sink.set_new_base_after(value)

    def restore_or_initialize(self, init_fn: Callable[[], Any] | None = None) -> str | None:
        return self._summarised(lambda: super(CheckpointManager, self).restore_or_initialize(init_fn))

    restore_or_initialize.__doc__ = RestoreSide.restore_or_initialize.__doc__

    def restore(self, save_path: str, options: Any = None) -> Any:
        return self._summarised(lambda: super(CheckpointManager, self).restore(save_path, options))

    restore.__doc__ = RestoreSide.restore.__doc__

    def _summarised(self, restore: Callable[[], T]) -> T:
        """Run ``restore``; write what it restored, how long it took and the steps lost to the summaries."""
        if self._summaries is None:
            return restore()
        before, began, seen = self.restored, time.monotonic(), process_managers.last_seen_step(self.directory)
        result = restore()
        info = self.restored
        if info is not None and info is not before:
            lost = max(0, seen - info.step) if seen is not None else None
            self._summaries.restored(info.step, info.source, time.monotonic() - began, lost)
        return result

    def save(
        self,
        checkpoint_number: Any = None,
        check_interval: bool = True,
        options: Any = None,
        *,
        metrics: Mapping[str, float] | None = None,
        tiers: frozenset[Tier] | None = None,
    ) -> SaveHandle | None:
        """Capture now (the only stall) and persist in the background; see :class:`SaveHandle`.

        TF's arguments keep TF's meaning (``options`` is ignored: psguard does its own IO). ``tiers``:
        ``{Tier.MEMORY}`` asks a sidecar for its memory tier only (the default is both).
        """
        del options
        if self._checkpoint_interval is not None:
            current = to_int(self._step_counter)
            last = self._last_checkpoint_step
            if last is not None and (
                current == last or (check_interval and current < last + self._checkpoint_interval)
            ):
                return None
            self._last_checkpoint_step = current
        handle = self._save(checkpoint_number, metrics=metrics, tiers=tiers)
        self._hold(handle.step)
        return handle

    def _hold(self, step: int) -> None:
        """Wait while the durable log trails past the policy's ``durable_lag`` (:mod:`psguard.policy.lag`)."""
        self.last_hold_seconds = self._lag.check(step)
        if self._summaries is not None:
            self._summaries.held(step, self.last_hold_seconds, self._lag.status)

    @property
    def durable_lag(self) -> LagStatus:
        """How far training is past the oldest save still waiting to be durable, and the holds so far."""
        return self._lag.status()

    def _save(
        self, checkpoint_number: Any, *, metrics: Mapping[str, float] | None, tiers: frozenset[Tier] | None
    ) -> SaveHandle:
        with self._capture_lock:
            coordinator = self.coordinator
            on_ps = sorted(s.device for i in self.capturer.tensors.values() for s in i.shards if "/job:ps/" in s.device)
            if checkpoint_number is None and coordinator is None and on_ps:
                raise ConfigError(
                    f"variables live on parameter servers ({on_ps[0]}, ...) and no ClusterCoordinator was found: "
                    "a save would read them while workers still run queued steps. Fix: create the job's "
                    "tf.distribute.coordinator.ClusterCoordinator(strategy) before saving, or give it to "
                    "psguard.CheckpointManager as options=psguard.ManagerOptions(coordinator=...)"
                )
            if self._save_counter is not None:
                self._save_counter.assign_add(1)
            stall = 0.0
            if coordinator is not None:
                # Its chief-side work (a trace: seconds, unless warmed) while the workers drain. Training waits
                # for it as for the capture, so it counts in the stall (it overlaps the drain at most).
                t0 = time.perf_counter()
                self.capturer.prepare()
                stall = time.perf_counter() - t0
                coordinator.join()  # read the counters at the state the capture will see
            step = self._step_for(checkpoint_number)
            process_managers.note_step(self.directory, step)
            self._beat(step)
            full = self._sink.whole_next()
            self._saves += 1
            while True:
                t0 = time.perf_counter()
                if full:
                    self._graph = None  # a whole capture carries the object graph too, not "same as before"
                updates = self.capturer.capture(full=full)
                stall += time.perf_counter() - t0
                self.last_stall_seconds = stall
                names = frozenset(self.capturer.tensors)
                gone = self._names_gone(names)
                if gone and not full:
                    log.info(
                        "step %d: tensors of the last checkpoint are gone (%s): saving whole", step, sorted(gone)[:3]
                    )
                    full = True
                    continue
                if (
                    self._deferred is not None
                    and all(n in updates for n in self._deferred.pending)
                    and not self._deferred.sharded_slots.unresolved
                ):
                    self._close_deferred()  # every deferred value found its variable: the file is not needed
                self._add_object_graph(updates)
                metadata: dict[str, Any] = {
                    "partitioning": {n: list(i.partitioning) for n, i in self.capturer.tensors.items()},
                    "writer": f"{socket.gethostname()}:{os.getpid()}",
                    "checkpoint_name": self.checkpoint_name,
                }
                if self.data_position is not None:
                    metadata["data_position"] = self.data_position()
                wanted = tiers or frozenset({Tier.MEMORY, Tier.DURABLE})
                parts = tuple(self.capturer.last_parts)
                job = Job(step, updates, metadata, dict(metrics or {}), wanted, parts=parts)
                try:
                    handle = self._sink.submit(job, stall)
                    self._chain_names, self._chain_names_restore = names, self.restored
                    break
                except DeltaWithoutParentError:
                    if full:
                        raise
                    # The chain broke while this delta was captured: the agent's answer to an earlier capture
                    # (it did not apply it) came after whole_next() was asked. The same state, whole this time.
                    log.warning("step %d: an earlier capture was not applied; capturing it whole", step)
                    full = True
        self._lag.submitted(handle)
        if self._summaries is not None:
            self._summaries.captured(step, stall, handed_off_bytes(updates, parts, self.capturer.tensors))
        log.info("captured step %d in %.3fs (%s)", step, stall, summary(updates))
        return handle

    def _names_gone(self, names: frozenset[str]) -> frozenset[str]:
        """The tensors of the state the chain ends in that the model no longer has: a delta must list every
        tensor of its parent (a Keras 3 model's kernels move under the optimizer once it is built)."""
        chain = self._chain_names
        if self.restored is not None and self.restored is not self._chain_names_restore:
            chain = frozenset(self.restored.metadata.get("partitioning") or ())
        return chain - names if chain else frozenset()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save since the last wait reached the strongest tier it was asked for (durable
        unless it was memory-only); raise :class:`SaveError` if any failed."""
        errors = self._sink.wait(timeout)
        if errors:
            raise SaveError(f"{len(errors)} save(s) failed; the last: {errors[-1]}") from errors[-1]

    sync = wait  # TF's name: wait for outstanding saves (here: until durable)

    def maybe_save(self, step: int | None = None, *, metrics: Mapping[str, float] | None = None) -> SaveHandle | None:
        """Ask the policy; save when it says so. Without a policy, never saves (call :meth:`save`)."""
        schedule, step = self.schedule, self._step_for(step)
        if schedule is not None:
            process_managers.note_step(self.directory, step)
        self._beat(step)
        now, ctx = time.time(), self.context
        if self._preemption is not None:
            ctx = self._preemption.apply(ctx)
        ctx = replace(ctx, in_flight=self._sink.busy())
        decision = schedule.decide(step, now, ctx) if schedule is not None else None
        if not decision or not self._sink.takes(decision.tiers, decision.urgent):
            self._hold(step)
            return None
        handle = self._save(step, metrics=metrics, tiers=decision.tiers)
        if not decision.urgent:  # a preempted job has its grace period to spend, not to wait for the store
            self._hold(step)
        self.context = ctx.with_save(decision.tiers, step=step, at=now, stall=handle.stall_seconds)
        log.info("save at step %d: %s", step, decision.reason)
        if decision.urgent and self._preemption is not None:
            remaining = self._preemption.remaining()
            try:
                handle.restorable(timeout=remaining)  # survives this process: in the agent's memory, or committed
            finally:
                self._preemption.done()
                self.close()
            sys.exit(self._preemption.exit_code)
        return handle

    def close(self, timeout: float | None = None) -> None:
        """Wait for pending saves as :meth:`wait` does (re-raising failures), then release everything.
        Closing a closed manager does nothing."""
        process_managers.closed(self)
        if self._closed:
            return
        self._closed = True
        try:
            self.wait(timeout)
        finally:
            self._close_deferred()
            self._sink.close()
            if self._summaries is not None:
                self._summaries.close()
            self._policy.close()
            if self._preemption is not None:
                self._preemption.uninstall()
            if self._owns_store:
                self.store.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ internals
    @property
    def hang(self) -> HangSpec:
        """When the agent declares this trainer hung (a watched policy file's current ``hang:``)."""
        if self.options.hang is not None:
            return self.options.hang
        spec = self._policy.spec
        return spec.hang if spec is not None else HangSpec()

    def _beat(self, step: int) -> None:
        """Record the step; tell the agent at most once a second (it judges hangs on its own clock)."""
        now = time.monotonic()
        self._steps.observe(step, now)
        if now - self._steps.sent_at < HEARTBEAT_SECONDS:
            return
        self._steps.sent_at = now
        self._sink.heartbeat(step, self.hang.bound(self._steps.median))

    def _forget_state(self) -> None:
        """The checkpoint the next delta would build on is gone: make the next capture whole."""
        self.capturer.invalidate()
        self._graph = None

    def _step_for(self, number: Any) -> int:
        """The step a save records: ``number``, else the step counter, else TF's numbering (save_counter)."""
        counter = next((c for c in (number, self._step_counter, self._save_counter) if c is not None), None)
        return to_int(counter) if counter is not None else self._saves + 1

    def _add_object_graph(self, updates: dict[str, TensorUpdate]) -> None:
        """TF's object graph, walked again (5 ms of stall) only when the capture saw the variables change."""
        layout, graph = self.capturer.layout_version, self._graph
        if graph is None or layout != self._graph_layout:
            graph, self._graph_layout = object_graph_bytes(self._checkpoint), layout
        same = graph == self._graph
        updates[OBJECT_GRAPH_KEY] = Same((), np.dtype(object)) if same else Full(np.array(graph, dtype=object))
        self._graph = graph


def _retention_of(
    max_to_keep: int | None, keep_every_hours: float | None, retention: Retention | None
) -> Retention | None:
    """The retention TF's arguments or ``options.retention`` ask for (``None``: the policy file's, else none)."""
    if max_to_keep is not None and max_to_keep < 1:
        raise PsguardError("max_to_keep must be >= 1 or None (keep everything)")
    if max_to_keep is None and keep_every_hours is None:
        return retention
    if retention is not None:
        raise ConfigError("give either options.retention or max_to_keep/keep_checkpoint_every_n_hours, not both")
    return Retention(keep_last=max_to_keep, keep_every_hours=keep_every_hours)
