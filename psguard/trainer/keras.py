"""``psguard.trainer.keras.CheckpointCallback``: psguard checkpoints for tf_keras ``model.fit``, with resume.

``BackupAndRestore`` writes whole TF checkpoints, and under ``ParameterServerStrategy`` only at epoch ends; this
callback hands saving to a :class:`psguard.CheckpointManager` (incremental, asynchronous, any store URL).
Resume goes through ``model._training_state`` as ``BackupAndRestore``'s does: right after ``on_train_begin``, fit
asks ``maybe_load_initial_counters_from_ckpt`` where to start, and each checkpoint records the fit position it
was taken at (``data_position``), so a restarted chief schedules exactly the steps the checkpoint had not seen.
The input pipeline's position is not restored (per-worker datasets start over, as with ``BackupAndRestore``).
Only tf_keras models: Keras 3's ``fit`` does not support ``ParameterServerStrategy`` in TF 2.21.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Unpack

import tensorflow as tf

try:
    import tf_keras
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "psguard.trainer.keras needs the tf_keras package (pip install --no-deps tf_keras==2.21.*; set "
        "TF_USE_LEGACY_KERAS=1 so that tf.keras is tf_keras). For Keras 3 models use a custom training loop "
        "with psguard.CheckpointManager."
    ) from e

from psguard.errors import ConfigError, PsguardError
from psguard.policy.engine import AnyOf, EverySteps, Retention, Schedule
from psguard.policy.files import load_policy
from psguard.trainer.manager import CheckpointManager, SaveHandle
from psguard.trainer.options import (
    CALLBACK_MOVES,
    CallbackOptions,
    DeprecatedCallbackArgs,
    ManagerOptions,
    apply_deprecated,
    deprecation,
)
from psguard.trainer.sinks import SinkKind

log = logging.getLogger(__name__)

_UNSET = object()

#: Key of the fit position inside a checkpoint's ``data_position`` metadata.
POSITION_KEY = "keras_fit"

#: The folder under a ``TensorBoard`` callback's ``log_dir`` that psguard's scalars go to: TensorBoard shows it as a
#: run of its own, beside ``train`` and ``validation``.
SUMMARIES_RUN = "psguard"

#: How many frames up from ``on_train_begin`` the ``CallbackList`` calling it is looked for (tf_keras 2.x: two).
_CALLER_FRAMES = 8


class KerasSupportError(PsguardError, NotImplementedError):
    """The model or strategy is one this callback cannot checkpoint and resume correctly."""


@dataclass(frozen=True)
class FitPosition:
    """Where ``model.fit`` stood at a checkpoint: the epoch of the last scheduled batch, the batches done in it,
    the global step, and the fit's ``steps_per_epoch`` (for diagnostics)."""

    epoch: int
    batches: int
    step: int
    steps_per_epoch: int | None = None

    @classmethod
    def from_json(cls, doc: Any) -> FitPosition | None:
        """The position in ``doc`` (a ``data_position``), or ``None`` when it holds none."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get(POSITION_KEY), Mapping):
            return None
        d = doc[POSITION_KEY]
        try:
            spe = d.get("steps_per_epoch")
            return cls(int(d["epoch"]), int(d["batches"]), int(d["step"]), None if spe is None else int(spe))
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring an unreadable fit position in the checkpoint: %r", d)
            return None

    def resume_at(self, steps_per_epoch: int | None) -> tuple[int, int]:
        """``(initial_epoch, initial_step)``: the next batch, or the next epoch's start when this one was done."""
        if steps_per_epoch is not None and steps_per_epoch > 0 and self.batches >= steps_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.batches


class _ResumeState:
    """Stands in for tf_keras' ``WorkerTrainingState`` on ``model._training_state``; answers once, so a later
    ``fit`` without this callback does not inherit the position."""

    def __init__(self, callback: CheckpointCallback) -> None:
        self._callback = callback
        self._used = False

    def maybe_load_initial_counters_from_ckpt(
        self, steps_per_epoch: int | None, initial_epoch: int, mode: Any = None
    ) -> tuple[int, int]:
        if self._used:
            return initial_epoch, 0
        self._used = True
        return self._callback._resume_at(steps_per_epoch, initial_epoch)


class CheckpointCallback(tf_keras.callbacks.Callback):  # type: ignore[misc]
    """Incremental, asynchronous psguard checkpoints of ``model.fit``, and resume after a restart.

    ``directory`` (``backup_dir``): a store URL, or a :class:`psguard.CheckpointManager` of this model (left
    open). Then ``BackupAndRestore``'s arguments (``save_freq``; the other two unused), ``ModelCheckpoint``'s
    ``monitor`` / ``mode`` / ``save_best_only``, and psguard's ``policy``, ``options``
    (:class:`~psguard.trainer.options.CallbackOptions`) and ``sink`` for the manager it creates; the keyword
    arguments taken before ``options`` still work, with a warning. ``on_train_end`` waits until every save is
    durable. Steps are counted from what ``fit`` schedules (reading ``optimizer.iterations`` costs an RPC).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | CheckpointManager | None = None,
        save_freq: str | int | None = None,
        delete_checkpoint: bool = True,
        save_before_preemption: bool = False,
        *,
        backup_dir: str | os.PathLike[str] | None = None,
        monitor: str | None = None,
        mode: str = "auto",
        save_best_only: bool = False,
        policy: Schedule | str | os.PathLike[str] | None = None,
        options: CallbackOptions | None = None,
        sink: SinkKind | None = None,
        **deprecated: Unpack[DeprecatedCallbackArgs],
    ) -> None:
        super().__init__()
        del delete_checkpoint, save_before_preemption  # BackupAndRestore's; see the class doc
        legacy: dict[str, Any] = dict(deprecated)
        every = _steps_of(save_freq, legacy.pop("save_every_n_steps", None))
        opts = apply_deprecated(options or CallbackOptions(), legacy, CALLBACK_MOVES, callee="CheckpointCallback")
        if (directory is None) == (backup_dir is None):
            raise ConfigError("give the store once: directory (or BackupAndRestore's backup_dir)")
        directory = directory if directory is not None else backup_dir
        assert directory is not None
        given = directory if isinstance(directory, CheckpointManager) else None
        if save_best_only and monitor is None:
            raise ConfigError("save_best_only needs monitor= (the metric of the epoch's logs to judge by)")
        _check_args(given, opts, sink, monitor, mode)
        loaded = policy if policy is None or isinstance(policy, Schedule) else load_policy(os.fspath(policy)).schedule
        schedule = _combine(loaded, every)
        #: Save at every epoch's end: asked (``save_freq="epoch"``, ``monitor``), or as BackupAndRestore does by
        #: default when nothing else says when.
        self.save_per_epoch = (
            save_freq == "epoch"
            or monitor is not None
            or (schedule is None and (given is None or given.schedule is None))
        )
        self.monitor = monitor
        name = (monitor or "").lower()  # "auto" as ModelCheckpoint decides it (accuracies and F-measures up)
        auto = "max" if "acc" in name or name.startswith("fmeasure") or "auc" in name else "min"
        self.mode: str = auto if mode == "auto" else mode
        self.save_best_only = save_best_only
        self.best: float | None = None
        self._given = given
        self._url = None if isinstance(directory, CheckpointManager) else os.fspath(directory)
        self._schedule = schedule
        # A policy file on its own goes to the manager as it is: it watches the file and applies its
        # retention. Combined with save_freq steps, the combined schedule goes, and the file's retention.
        file_alone = policy is not None and not isinstance(policy, Schedule) and every is None
        self._manager_policy: Schedule | str | os.PathLike[str] | None = policy if file_alone else schedule
        self._retention, self.max_to_keep = _own_retention(policy, every, monitor, self.mode, opts.max_to_keep)
        #: The callback's own settings (the manager's among them), as given or moved from old keyword arguments.
        self.options = opts
        self.sink = sink
        #: Where the manager of the last ``fit`` writes psguard's TensorBoard scalars (``None``: nowhere).
        self.summaries_folder: str | None = None
        self.manager: CheckpointManager | None = self._given
        #: What the callback saves (the manager's checkpoint), set by ``on_train_begin``.
        self.checkpoint: Any = None
        #: The newest save this callback started (``result()`` blocks until it is durable).
        self.last_save: SaveHandle | None = None
        #: The checkpoint restored by the last ``on_train_begin`` (``None``: started fresh).
        self.restored_step: int | None = None
        self.restored_position: FitPosition | None = None
        #: ``(initial_epoch, initial_step)`` that the last fit was told to start at.
        self.resumed_at: tuple[int, int] | None = None
        # Under PS tf_keras calls batch hooks only for callbacks taking RemoteValue logs (never read here).
        self._supports_tf_logs = True
        self._chief_worker_only = True
        self._step = 0
        self._epoch = 0
        self._batches = 0
        self._steps_per_epoch: int | None = None
        self._position_hook = False
        self._given_schedule: Any = _UNSET
        # The train function the last fit used and the write-hook generation it was traced under (weakly).
        self._hooked: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None

    # ------------------------------------------------------------------------------------------ Keras hooks

    def set_model(self, model: Any) -> None:
        _refuse_keras3(model)
        super().set_model(model)

    def _implements_train_batch_hooks(self) -> bool:
        return True

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        model = self.model
        _refuse_keras3(model)
        strategy = getattr(model, "_distribution_strategy", None)  # None: the default one
        if strategy is not None and not _is_ps(strategy):  # others' variables are untested here
            raise KerasSupportError(
                "psguard.trainer.keras.CheckpointCallback supports ParameterServerStrategy and no strategy, not "
                f"{type(strategy).__name__}"
            )
        other = getattr(model, "_training_state", None)
        if other is not None and not isinstance(other, _ResumeState):
            raise ConfigError(
                f"another callback ({type(other).__name__}, from BackupAndRestore?) also resumes this fit through "
                "model._training_state; use one of them"
            )
        if self.manager is not None and self.manager is not self._given:
            self.close()  # left open by a fit that raised before on_train_end
        self.last_save = None
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            raise ConfigError("compile the model before fit: the callback checkpoints its optimizer too")
        if not model.built:
            raise ConfigError(
                "build the model before fit (give it an Input, or call it on a batch): the callback restores "
                "before the first step, into variables that must exist"
            )
        variables = list(model.trainable_variables)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            if callable(getattr(optimizer, "build", None)):
                if not getattr(optimizer, "_built", False):
                    optimizer.build(variables)
            elif callable(getattr(optimizer, "_create_all_weights", None)):  # tf_keras.optimizers.legacy
                optimizer._create_all_weights(variables)
        coordinator = getattr(model, "_cluster_coordinator", None)
        if self._given is None:
            assert self._url is not None
            self.manager = CheckpointManager(
                tf.train.Checkpoint(model=model, optimizer=model.optimizer),
                self._url,
                max_to_keep=self.max_to_keep,
                policy=self._manager_policy,
                options=self._manager_options(coordinator),
                sink=self.sink,
            )
        else:
            self.manager = self._given
            if self._schedule is not None:
                self._given_schedule = self.manager.schedule
                self.manager.schedule = self._schedule
            if self.manager.coordinator is None and coordinator is not None:
                raise ConfigError(
                    "the CheckpointManager has no coordinator but the model trains under ParameterServerStrategy: "
                    "create it with options=psguard.ManagerOptions(coordinator=model._cluster_coordinator) "
                    "(or the strategy's ClusterCoordinator) so that captures drain the scheduled steps first"
                )
            # The position is what makes resume exact; a manager that records none still resumes by step.
            if self.manager.data_position is None:
                self.manager.data_position = self._data_position
                self._position_hook = True
        self.checkpoint = self.manager.checkpoint
        self.summaries_folder = self.manager.summaries
        try:
            self._restore(model)
        except BaseException:
            self.close()
            raise
        self._retrace_unhooked(model)
        steps = (self.params or {}).get("steps")
        self._steps_per_epoch = int(steps) if isinstance(steps, int) and steps > 0 else None
        self.resumed_at = None
        # Installed after the restore succeeded: fit consults it right after on_train_begin returns.
        model._training_state = _ResumeState(self)

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self.restored_step is not None and self.resumed_at is None:
            # Training would start over on top of restored weights and number its saves wrongly.
            raise KerasSupportError(
                "model.fit did not ask model._training_state where to resume (a tf_keras version other than 2.x, "
                "or another callback replaced it): cannot resume at the restored step"
            )
        self._epoch = epoch
        self._batches = self.resumed_at[1] if self.resumed_at is not None and epoch == self.resumed_at[0] else 0

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        # `batch` is the index of the last batch of this execution (steps_per_execution batches per call).
        done = int(batch) + 1
        self._step += max(done - self._batches, 0)
        self._batches = done
        assert self.manager is not None
        self.last_save = self.manager.maybe_save(self._step) or self.last_save

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if not self.save_per_epoch:
            return
        metrics: dict[str, float] | None = None
        if self.monitor is not None:
            value = (logs or {}).get(self.monitor)
            if value is None:
                log.warning("monitor %r is not in the epoch's logs (%s)", self.monitor, sorted(logs or {}))
            else:
                current = float(value)
                metrics = {self.monitor: current}
                better = self.best is None or (current > self.best if self.mode == "max" else current < self.best)
                if better:
                    self.best = current
                elif self.save_best_only:
                    return
        if self.save_best_only and metrics is None:
            return
        assert self.manager is not None
        self.last_save = self.manager.save(self._step, metrics=metrics)

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        model = self.model
        if isinstance(getattr(model, "_training_state", None), _ResumeState):
            model._training_state = None
        manager = self.manager
        if manager is None:
            return
        try:
            saved = self.last_save.step if self.last_save is not None else self.restored_step
            if self.options.save_at_end and saved != self._step:
                self.last_save = manager.save(self._step)
            manager.wait()
            if self.last_save is not None:
                self.last_save.result()  # a save handed to a sidecar is not the writer's to wait for
        finally:
            self.close()

    # ------------------------------------------------------------------------------------------ public

    @property
    def step(self) -> int:
        """The global step of the last batch fit scheduled (what the next save is numbered)."""
        return self._step

    @property
    def position(self) -> FitPosition:
        """Where fit stands now, as a checkpoint taken now would record it."""
        return FitPosition(self._epoch, self._batches, self._step, self._steps_per_epoch)

    def close(self) -> None:
        """Release the manager this callback created, as ``on_train_end`` does (after a ``fit`` that raised)."""
        manager, self.manager = self.manager, self._given
        if self._given is not None:
            if self._position_hook:
                self._given.data_position = None
                self._position_hook = False
            if self._given_schedule is not _UNSET:
                self._given.schedule = self._given_schedule
                self._given_schedule = _UNSET
        if manager is not None and manager is not self._given:
            manager.close()

    # ------------------------------------------------------------------------------------------ internals

    def _manager_options(self, coordinator: Any) -> ManagerOptions:
        """The options of the manager this fit creates: the user's, with what the callback supplies."""
        own, asked = self.options.manager, self.options.summaries
        folder = None if isinstance(asked, bool) else os.fspath(asked)
        if own.summaries is None and asked is True:  # <log_dir>/psguard of the fit's first TensorBoard callback
            frame, callbacks = sys._getframe(), []  # the fit's: of the CallbackList a few frames up
            for _ in range(_CALLER_FRAMES):
                owner = frame.f_locals.get("self")
                if isinstance(owner, tf_keras.callbacks.CallbackList) and any(c is self for c in owner.callbacks):
                    callbacks = list(owner.callbacks)
                    break
                if frame.f_back is None:
                    break
                frame = frame.f_back
            board = next((c for c in callbacks if isinstance(c, tf_keras.callbacks.TensorBoard)), None)
            folder = os.path.join(os.fspath(board.log_dir), SUMMARIES_RUN) if board is not None else None
        return dataclasses.replace(
            own,
            coordinator=coordinator,
            data_position=self._data_position,
            retention=self._retention if self._retention is not None else own.retention,
            summaries=own.summaries if own.summaries is not None else folder,
        )

    def _retrace_unhooked(self, model: Any) -> None:
        """Make ``fit`` trace its train function again when the cached one was traced under other write hooks:
        it would mark rows for an earlier capturer, and every capture would hash every row."""
        assert self.manager is not None
        capturer = self.manager.capturer
        capturer.refresh()  # a given manager's capturer may predate the optimizer's slots built above
        generation = capturer.hook_generation
        fn = getattr(model, "train_tf_function", None)
        if fn is None or generation is None:
            self._hooked = None
            return
        hooked = self._hooked
        count = getattr(fn, "experimental_get_tracing_count", None)
        if (not callable(count) or count()) and not (
            hooked is not None and hooked[0]() is fn and hooked[1]() is generation
        ):
            log.info("the train function was traced before this fit's write hooks: tracing it again")
            model.make_train_function(force=True)
            fn = model.train_tf_function
        self._hooked = (weakref.ref(fn), weakref.ref(generation))

    def _restore(self, model: Any) -> None:
        assert self.manager is not None
        restored = self.manager.restore_or_initialize()
        info = self.manager.restored if restored is not None else None
        self.restored_position = None
        if info is not None:
            self.restored_step = info.step
            self.restored_position = FitPosition.from_json(info.metadata.get("data_position"))
            self._step = self.restored_position.step if self.restored_position is not None else info.step
            log.info("restored step %d (%s)", info.step, info.id)
        else:
            self.restored_step = None
            self._step = int(model.optimizer.iterations.numpy())
            # Count "every N steps" from where this run starts, not from step 0 of an earlier run.
            self.manager.context = dataclasses.replace(self.manager.context, started_step=self._step)

    def _resume_at(self, steps_per_epoch: int | None, initial_epoch: int) -> tuple[int, int]:
        """Called by fit (through ``_ResumeState``) right after ``on_train_begin``."""
        spe = steps_per_epoch if steps_per_epoch is not None else self._steps_per_epoch
        self._steps_per_epoch = spe
        at = (initial_epoch, 0)
        if self.restored_position is not None:
            at = self.restored_position.resume_at(spe)
        elif self.restored_step is not None and spe:
            at = divmod(self._step, spe)  # no fit position (another manager's): assume it started at step 0
        self.resumed_at = at
        self._epoch, self._batches = at
        if self.restored_step is not None:
            log.info("resuming fit at epoch %d, batch %d (step %d)", at[0], at[1], self._step)
        return at

    def _data_position(self) -> dict[str, Any]:
        return {POSITION_KEY: dataclasses.asdict(self.position)}


# ---------------------------------------------------------------------------------------------- checks


def _steps_of(save_freq: str | int | None, every: int | None) -> int | None:
    """Steps between saves: BackupAndRestore's ``save_freq`` when a number, or the deprecated
    ``save_every_n_steps`` (which also saved at every epoch's end beside ``save_freq="epoch"``)."""
    if save_freq is not None and save_freq != "epoch":
        if isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1:
            raise ConfigError(f"save_freq must be 'epoch' or a positive number of steps, not {save_freq!r}")
        if every is not None:
            raise ConfigError("give save_freq (steps) or save_every_n_steps, not both")
        return save_freq
    if every is None:
        return None
    spelling = (
        "save_freq=..."
        if save_freq is None
        else "policy=psguard.policy.Schedule(durable=psguard.policy.EverySteps(...))` beside `save_freq='epoch'"
    )
    warnings.warn(deprecation("save_every_n_steps", spelling), DeprecationWarning, stacklevel=3)
    if isinstance(every, bool) or every < 1:
        raise ConfigError(f"save_every_n_steps must be a positive integer, not {every!r}")
    return every


def _check_args(
    given: CheckpointManager | None, options: CallbackOptions, sink: SinkKind | None, monitor: str | None, mode: str
) -> None:
    """Refuse arguments that contradict each other, and manager options the callback sets itself."""
    if mode not in ("auto", "min", "max"):
        raise ConfigError(f"mode must be 'auto', 'min' or 'max', not {mode!r}")
    if given is not None and (options != CallbackOptions() or sink is not None):
        raise ConfigError(
            "options and sink configure the manager the callback creates; with an existing CheckpointManager "
            "set them on it"
        )
    if monitor is not None and given is not None:
        raise ConfigError(
            "monitor keeps the best checkpoint by retention: with an existing manager, set "
            "options=psguard.ManagerOptions(retention=Retention(keep_best=1, metric=..., mode=...)) on it instead"
        )
    own = options.manager
    if own.coordinator is not None or own.data_position is not None:
        raise ConfigError(
            "the callback gives its manager the model's coordinator and the fit position: leave "
            "options.manager.coordinator and options.manager.data_position unset"
        )
    if options.summaries is not True and own.summaries is not None:
        raise ConfigError("give summaries once: options.summaries or options.manager.summaries, not both")
    if own.retention is not None and (monitor is not None or options.max_to_keep is not None):
        raise ConfigError(
            "give retention once: options.manager.retention, or options.max_to_keep / monitor (the callback "
            "makes the retention from them)"
        )


def _own_retention(
    policy: Schedule | str | os.PathLike[str] | None,
    every: int | None,
    monitor: str | None,
    mode: str,
    keep: int | None,
) -> tuple[Retention | None, int | None]:
    """The retention for the manager, and the ``max_to_keep`` left for TF's argument: a policy file's when its
    schedule was combined with steps, the best by ``monitor`` beside the newest."""
    retention = None
    if policy is not None and not isinstance(policy, Schedule) and every is not None and keep is None:
        retention = load_policy(os.fspath(policy)).retention
    if monitor is None:
        return retention, keep
    keep_last = keep if keep is not None else (retention or Retention()).keep_last
    return Retention(keep_last=keep_last, keep_best=1, metric=monitor, mode="max" if mode == "max" else "min"), None


def _combine(schedule: Schedule | None, every: int | None) -> Schedule | None:
    if every is None:
        return schedule
    steps = EverySteps(every)
    if schedule is None:
        return Schedule(durable=steps)
    durable = steps if schedule.durable is None else AnyOf((schedule.durable, steps))
    return dataclasses.replace(schedule, durable=durable)


def _is_ps(strategy: Any) -> bool:
    return bool(getattr(strategy, "_should_use_with_coordinator", False)) or isinstance(
        strategy, tf.distribute.experimental.ParameterServerStrategy
    )


def _refuse_keras3(model: Any) -> None:
    """Fail before training: Keras 3's ``fit`` has no PS support in TF 2.21 and no hook to resume mid-epoch."""
    if model is None or isinstance(model, tf_keras.Model):
        return
    if not any(c.__module__.split(".")[0] == "keras" for c in type(model).__mro__):
        return
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    if _is_ps(strategy):
        raise KerasSupportError(
            "psguard.trainer.keras.CheckpointCallback got a Keras 3 model under ParameterServerStrategy: Keras 3's "
            "model.fit does not support ParameterServerStrategy in TF 2.21. Use tf_keras for model.fit "
            "(pip install --no-deps tf_keras==2.21.*, set TF_USE_LEGACY_KERAS=1 so tf.keras is tf_keras, and "
            "build the model with tf.keras / tf_keras), or train with a custom loop (ClusterCoordinator.schedule) "
            "and save with psguard.CheckpointManager(tf.train.Checkpoint(model=..., optimizer=...), url, "
            "options=psguard.ManagerOptions(coordinator=coordinator))."
        )
    raise KerasSupportError(
        "psguard.trainer.keras.CheckpointCallback drives tf_keras model.fit (TF_USE_LEGACY_KERAS=1); this is a Keras 3 "
        "model. With Keras 3 save from a custom training loop with psguard.CheckpointManager."
    )
