"""An evaluator's side of a tf_keras job, for the tests of the drop-in SidecarEvaluator and of the publisher: the
job's model and evaluation data, and a callback through which a test awaits each evaluation a SidecarEvaluator
(TF's or psguard's) runs in a thread."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf
import tf_keras

STEPS_PER_SAVE = 2
SAVES = 3


def data() -> Any:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, (64, 2))
    labels = (ids.sum(axis=1, keepdims=True) % 2).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(16)


def build(seed: int, *, trainer: bool, legacy: bool = False) -> Any:
    """The job's model; the evaluator's is compiled for ``evaluate()`` only (its optimizer is Keras' default)."""
    tf_keras.utils.set_random_seed(seed)
    model = tf_keras.Sequential(
        [
            tf_keras.Input((2,), dtype="int64"),
            tf_keras.layers.Embedding(100, 4),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(8, activation="relu"),
            tf_keras.layers.Dense(1),
        ]
    )
    optimizer: Any = tf_keras.optimizers.legacy.Adam(0.05) if legacy else tf_keras.optimizers.Adam(0.05)
    model.compile(
        optimizer=optimizer if trainer or legacy else "rmsprop",
        loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[tf_keras.metrics.BinaryAccuracy(threshold=0.0), tf_keras.metrics.AUC(from_logits=True, name="auc")],
    )
    return model


class Seen(tf_keras.callbacks.Callback):  # type: ignore[misc]
    """Each evaluation's step (the restored ``optimizer.iterations``) and logs, into a queue the test waits on."""

    def __init__(self) -> None:
        super().__init__()
        self.evaluations: queue.Queue[tuple[int, dict[str, float]] | BaseException] = queue.Queue()

    def on_test_end(self, logs: Any = None) -> None:
        step = int(self.model.optimizer.iterations.numpy())
        self.evaluations.put((step, {k: float(v) for k, v in (logs or {}).items()}))


def in_thread(start: Callable[[], None], seen: Seen) -> threading.Thread:
    """``start()`` in a thread; an error is put on ``seen``'s queue, so the test fails at once instead of waiting."""

    def run() -> None:
        try:
            start()
        except BaseException as e:
            seen.evaluations.put(e)

    thread = threading.Thread(target=run, name="test-evaluator")
    thread.start()
    return thread


def next_evaluation(seen: Seen) -> tuple[int, dict[str, float]]:
    got = seen.evaluations.get(timeout=120)
    if isinstance(got, BaseException):
        raise got
    return got


def summaries(logdir: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar the TensorBoard callback wrote under ``logdir``, in order."""
    out: list[tuple[str, int, float]] = []
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars":
                    out.append((value.tag, event.step, float(tf.make_ndarray(value.tensor))))
    return out
