"""``psguard.keras.SidecarEvaluator``: tf_keras' ``SidecarEvaluator`` on a psguard store, following it by deltas.

The same arguments and loop as ``tf.keras.utils.SidecarEvaluator`` (the one changed line is the import): the restore
root TF uses, ``expect_partial()`` (``Follower(ignore_missing=True)``; a shape or dtype mismatch is an error), each
newest checkpoint evaluated with the callbacks, a log line per 30 s without one, and the stop after the first
checkpoint of step ``max_evaluations`` or later. The model is kept at the newest commit by a
:class:`~psguard.Follower`, which reads only the changed rows; a corrupt checkpoint is skipped with a logged reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

try:
    import tf_keras
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "psguard.keras.SidecarEvaluator needs the tf_keras package (pip install --no-deps tf_keras==2.21.*; set "
        "TF_USE_LEGACY_KERAS=1 so that tf.keras is tf_keras), as tf.keras.utils.SidecarEvaluator does."
    ) from e

from psguard.store import CheckpointInfo, Store
from psguard.trainer.follower import Follower
from psguard.trainer.variables import gather_variables

log = logging.getLogger(__name__)

_ITERATIONS_UNINITIALIZED = -1
#: Seconds without a new checkpoint after which the evaluator says so (and keeps waiting), as TF's does.
CHECKPOINT_TIMEOUT_SECONDS = 30.0


class SidecarEvaluator:
    """``tf.keras.utils.SidecarEvaluator`` whose ``checkpoint_dir`` is a psguard store URL; ``poll_interval``:
    seconds between listings; :attr:`follower`: the running :meth:`start`'s follower (its ``stats``)."""

    def __init__(
        self,
        model: Any,
        data: Any,
        checkpoint_dir: str,
        steps: int | None = None,
        max_evaluations: int | None = None,
        callbacks: Sequence[Any] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        poll_interval: float = 1.0,
    ) -> None:
        self.model = model
        self.data = data
        self.checkpoint_dir = checkpoint_dir
        self._iterations = tf.Variable(name="iterations", initial_value=_ITERATIONS_UNINITIALIZED, dtype=tf.int64)
        self.max_evaluations = max_evaluations
        self.steps = steps
        self.callbacks = list(callbacks or [])
        self.storage_options = storage_options
        self.poll_interval = poll_interval
        self.follower: Follower | None = None

    def start(self) -> None:
        """Evaluate each newest checkpoint until one of step ``max_evaluations`` or later (``None``: for ever)."""
        with Store.open(self.checkpoint_dir, self.storage_options) as store:
            since = time.monotonic()  # which root restores the store depends on what it holds: wait for one
            while (first := store.latest()) is None:
                if time.monotonic() - since >= CHECKPOINT_TIMEOUT_SECONDS:
                    self._timed_out()
                    since = time.monotonic()
                time.sleep(self.poll_interval)
            # TF's restore root, or the model itself when the checkpoints hold no ``model`` (TF's ``load_weights``).
            if "model" not in {name.split("/")[0] for name in store.manifest(first.id).tensors}:
                if self.model.optimizer is not None and not self._new_optimizer():
                    _ = self.model.optimizer.iterations  # a legacy optimizer makes it on first use; the root tracks it
                root = self.model
            elif self._new_optimizer():
                root = tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer)
            else:
                root = tf.train.Checkpoint(model=self.model, optimizer=tf.train.Checkpoint(iter=self._iterations))
            with Follower(root, store, poll_interval=self.poll_interval, ignore_missing=True) as follower:
                self.follower = follower
                while True:
                    for info in follower.checkpoints(timeout=CHECKPOINT_TIMEOUT_SECONDS):
                        if self._evaluate(info, follower, root):
                            return
                    self._timed_out()

    # ------------------------------------------------------------------------------------------ the loop
    def _new_optimizer(self) -> bool:
        return bool(self.model.optimizer) and isinstance(self.model.optimizer, tf_keras.optimizers.Optimizer)

    def _evaluate(self, info: CheckpointInfo, follower: Follower, root: Any) -> bool:
        """One evaluation of the checkpoint the follower holds; whether it was the last."""
        if not self._new_optimizer():
            if root is self.model:  # the optimizer's own iterations were the root's: restored unless left alone
                iterations = self.model.optimizer.iterations if self.model.optimizer else None
                names = [name for name, obj in gather_variables(root) if obj is iterations]
                if names and names[0] not in follower.left_alone:
                    self._iterations.assign(iterations)
            elif self.model.optimizer:
                self.model.optimizer.iterations.assign(self._iterations)
            if self._iterations.numpy() == _ITERATIONS_UNINITIALIZED:
                raise RuntimeError(
                    f"Variable `iterations` cannot be loaded from the checkpoint file at {self.checkpoint_dir}. "
                    "Please ensure `iterations` is included in the checkpoint saved during training."
                )
        where = f"{info.id} (step {info.step}) of {self.checkpoint_dir}"
        log.info("Evaluation starts: Model weights loaded from latest checkpoint %s", where)
        self.model.evaluate(self.data, steps=self.steps, callbacks=self.callbacks, verbose=2)
        metrics: dict[str, Any] = {}
        for metric in self.model.metrics:
            result = metric.result()
            metrics.update(result if isinstance(result, dict) else {metric.name: result})
        log.info("End of evaluation. Metrics: %s", " ".join(f"{k}={v.numpy()}" for k, v in metrics.items()))
        if self.max_evaluations and self.max_evaluations <= info.step:
            log.info("Last checkpoint evaluated. SidecarEvaluator stops.")
            return True
        return False

    def _timed_out(self) -> None:
        log.info(
            "No checkpoints appear to be found after %.0f seconds in %s. Please check that the training saves "
            "to this store with psguard.CheckpointManager or psguard.keras.CheckpointCallback "
            "(tf.train.Checkpoint(model=..., optimizer=...)).",
            CHECKPOINT_TIMEOUT_SECONDS,
            self.checkpoint_dir,
        )
