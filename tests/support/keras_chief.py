"""A chief process for the restart test: tf_keras ``model.fit`` under ParameterServerStrategy with
``psguard.trainer.keras.CheckpointCallback``, reporting what happens as JSON lines on stdout. Its model and data
(:func:`build_model`, :func:`dataset_fn`) are also the in-process PS tests' of ``tests/cluster/test_keras_callback.py``.

Usage: python -m tests.support.keras_chief URL OPTIONS_JSON   (TF_CONFIG names the cluster and this chief)

Events: ``restored`` (after the callback's on_train_begin: the checkpoint used, and with ``dump`` the
restored tensors written to an .npz before any step ran), ``resumed`` (the epoch and batch fit starts at),
``durable`` (a save is committed), ``held`` (``hold``: the process parks before the last execution of the
fit, after at least one durable save, so a test can kill it mid-training without racing the end; stdin
closing ends it), ``finished`` (the final step and the checkpoints). The test waits for events, never sleeps.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

if __name__ == "__main__":  # the chief's settings, before TensorFlow loads; a test importing the model keeps its own
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np
import tensorflow as tf
import tf_keras

from psguard.agent.process.reaper import die_with_parent
from psguard.trainer.keras import CheckpointCallback
from psguard.trainer.variables import read_tensors

VOCAB = 2000


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def build_model(strategy: Any, steps_per_execution: int) -> Any:
    with strategy.scope():
        model = tf_keras.Sequential(
            [
                tf_keras.Input((2,), dtype="int64"),
                tf_keras.layers.Embedding(VOCAB, 8, name="emb"),
                tf_keras.layers.Flatten(),
                tf_keras.layers.Dense(8, activation="relu"),
                tf_keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=tf_keras.optimizers.Adagrad(0.1),
            loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    return model


def dataset_fn(context: Any) -> Any:
    ids = tf.random.stateless_uniform([512, 2], seed=[7, context.input_pipeline_id], maxval=VOCAB, dtype=tf.int64)
    labels = tf.cast(tf.math.floormod(tf.reduce_sum(ids, axis=1), 2), tf.float32)
    return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(16)


class Reporter(tf_keras.callbacks.Callback):  # type: ignore[misc]
    """Placed after the psguard callback, so its hooks see the state that one left."""

    def __init__(self, psguard: CheckpointCallback, opts: dict[str, Any]) -> None:
        super().__init__()
        self._supports_tf_logs = True
        self.psguard = psguard
        self.opts = opts
        self.reported: set[int] = set()
        self.pending: list[Any] = []
        self.resumed = False

    def on_train_begin(self, logs: Any = None) -> None:
        cb = self.psguard
        assert cb.manager is not None
        restored = cb.manager.restored if cb.restored_step is not None else None
        if self.opts.get("dump"):
            np.savez(self.opts["dump"], **read_tensors(cb.manager.checkpoint))
        emit(
            "restored",
            step=cb.restored_step,
            id=restored.id if restored is not None else None,
            iterations=int(self.model.optimizer.iterations.numpy()),
        )

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if not self.resumed:
            self.resumed = True
            emit("resumed", at=list(self.psguard.resumed_at or ()), epoch=epoch)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        spe, epochs = self.params["steps"], self.params["epochs"]
        last = batch + self.opts["steps_per_execution"] >= spe and self.psguard.position.epoch == epochs - 1
        if self.opts.get("hold") and last:
            handle = self.psguard.last_save
            assert handle is not None, "no save before the last execution: lower every"
            self.report(handle.result(timeout=120))
            emit("held", step=self.psguard.step)
            sys.stdin.read()  # the test kills us here; EOF means it is gone
            os._exit(3)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        # Every handle is last_save for at least the batch that made it, so none is missed here even when the
        # psguard callback starts the next save at the very batch end where the previous one is found done.
        handle = self.psguard.last_save
        if handle is not None and all(handle is not h for h in self.pending):
            self.pending.append(handle)
        for handle in [h for h in self.pending if h.done()]:
            self.pending.remove(handle)
            if handle.exception() is None:
                self.report(handle.result())

    def report(self, info: Any) -> None:
        if info.step not in self.reported:
            self.reported.add(info.step)
            emit("durable", step=info.step, id=info.id, kind=info.kind)


def main() -> None:
    url, opts = sys.argv[1], json.loads(sys.argv[2])
    die_with_parent(os.getppid())
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
    )
    model = build_model(strategy, opts["steps_per_execution"])
    cb = CheckpointCallback(url, save_freq=opts["every"])
    reporter = Reporter(cb, opts)
    data = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
    model.fit(data, epochs=opts["epochs"], steps_per_epoch=opts["steps_per_epoch"], callbacks=[cb, reporter], verbose=0)
    assert cb.last_save is not None
    final = cb.last_save.result()
    emit("finished", iterations=int(model.optimizer.iterations.numpy()), step=cb.step, id=final.id)


if __name__ == "__main__":
    main()
