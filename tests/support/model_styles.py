"""The model styles an export must round-trip, each built, trained a few steps and checkpointed as users do, and
the round trip itself (:func:`round_trip`): save through psguard, ``psguard export``, then read the folder with
TensorFlow's own tools only.

Styles: a ``Sequential`` model; a functional Wide & Deep whose object graph ends in a node holding no value (TF
then serializes the graph with a trailing NUL byte); a subclassed model; a TensorFlow Recommenders DCN ranking
model; a Wide & Deep with two optimizers (Ftrl for the wide part, Adam for the deep one); a custom loop whose
checkpoint holds an AUC metric (on the PS under ParameterServerStrategy). All tf_keras, as the job styles run
(``TF_USE_LEGACY_KERAS=1``); TFRS reaches Keras through ``tf.keras`` and so needs that variable set before
``tf.keras`` is first touched, which a pytest process cannot promise: its test runs this module as a child:

    TF_USE_LEGACY_KERAS=1 python -m tests.support.model_styles tfrs FOLDER
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np
import tensorflow as tf
import tf_keras

from psguard.trainer.export import OBJECT_GRAPH_KEY, export_checkpoint
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.variables import bitwise_equal, read_tensors

#: The step the checkpoint is saved at: the export is ``ckpt-3``, and ``SidecarEvaluator(max_evaluations=1)``
#: stops after the first checkpoint whose number is at least 1.
STEP = 3
ROWS = 64
BATCH = 16


@dataclass
class Job:
    model: Any  # trained STEP steps (its optimizers built)
    root: tf.train.Checkpoint  # what the job checkpoints


@dataclass(frozen=True)
class Style:
    build: Callable[[int], Job]  # a trained job, its initial values drawn from the seed
    evaluator: Callable[[int], Any]  # an evaluator's model: compiled with metrics, never trained
    data: Callable[[], Any]  # the evaluation data (finite)


def _seeded(seed: int) -> None:
    tf_keras.utils.set_random_seed(seed)


# ----------------------------------------------------------------------------------------------- data
def _wide_deep_data() -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    wide = rng.random((ROWS, 6)).astype(np.float32)
    ids = rng.integers(0, 100, (ROWS, 2))
    return (wide, ids), (ids.sum(axis=1, keepdims=True) % 2).astype(np.float32)


def _dataset(xy: tuple[Any, Any]) -> Any:
    return tf.data.Dataset.from_tensor_slices(xy).batch(BATCH)


# ----------------------------------------------------------------------------------------------- Sequential
def _sequential(seed: int) -> Any:
    _seeded(seed)
    model = tf_keras.Sequential(
        [
            tf_keras.Input((2,), dtype="int64"),
            tf_keras.layers.Embedding(100, 4),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(8, activation="relu"),
            tf_keras.layers.Dropout(0.1),
            tf_keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer=tf_keras.optimizers.Adam(0.01),
        loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[tf_keras.metrics.BinaryAccuracy(threshold=0.0)],
    )
    return model


def _ids_data() -> tuple[np.ndarray, np.ndarray]:
    (_, ids), labels = _wide_deep_data()
    return ids, labels


def _fit(model: Any, data: Any) -> Job:
    model.fit(data, epochs=1, steps_per_epoch=STEP, verbose=0)
    return Job(model, tf.train.Checkpoint(model=model, optimizer=model.optimizer))


SEQUENTIAL = Style(
    build=lambda seed: _fit(_sequential(seed), _dataset(_ids_data()).repeat()),
    evaluator=_sequential,
    data=lambda: _dataset(_ids_data()),
)


# ----------------------------------------------------------------------------------------------- functional
def _functional(seed: int) -> Any:
    """Wide & Deep, functional: inputs, a concatenation and an activation hold no value, and the deep tower ends
    in a nested ``Sequential`` of a ``Dropout`` alone: the last node of the object graph, valueless."""
    _seeded(seed)
    wide_in = tf_keras.Input((6,), name="wide")
    ids_in = tf_keras.Input((2,), dtype="int64", name="ids")
    deep = tf_keras.layers.Flatten()(tf_keras.layers.Embedding(100, 4)(ids_in))
    tower = tf_keras.Sequential(
        [tf_keras.layers.Dense(8, activation="relu"), tf_keras.Sequential([tf_keras.layers.Dropout(0.1)])]
    )
    both = tf_keras.layers.Concatenate()([tf_keras.layers.Dense(1)(wide_in), tower(deep)])
    out = tf_keras.layers.Activation("linear")(tf_keras.layers.Dense(1)(both))
    model = tf_keras.Model([wide_in, ids_in], out)
    model.compile(
        optimizer=tf_keras.optimizers.Adam(0.01),
        loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[tf_keras.metrics.BinaryAccuracy(threshold=0.0)],
    )
    return model


FUNCTIONAL = Style(
    build=lambda seed: _fit(_functional(seed), _dataset(_wide_deep_data()).repeat()),
    evaluator=_functional,
    data=lambda: _dataset(_wide_deep_data()),
)


# ----------------------------------------------------------------------------------------------- subclassed
class Ranker(tf_keras.Model):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.embedding = tf_keras.layers.Embedding(100, 4)
        self.hidden = [tf_keras.layers.Dense(8, activation="relu"), tf_keras.layers.Dense(4, activation="relu")]
        self.logit = tf_keras.layers.Dense(1)

    def call(self, ids: Any) -> Any:
        x = tf.reshape(self.embedding(ids), [-1, 8])
        for layer in self.hidden:
            x = layer(x)
        return self.logit(x)


def _subclassed(seed: int) -> Any:
    _seeded(seed)
    model = Ranker()
    model.compile(
        optimizer=tf_keras.optimizers.Adagrad(0.1),
        loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[tf_keras.metrics.BinaryAccuracy(threshold=0.0)],
    )
    model(np.zeros((1, 2), np.int64))
    return model


SUBCLASSED = Style(
    build=lambda seed: _fit(_subclassed(seed), _dataset(_ids_data()).repeat()),
    evaluator=_subclassed,
    data=lambda: _dataset(_ids_data()),
)


# ----------------------------------------------------------------------------------------------- two optimizers
def _two_optimizers(seed: int, *, compiled_for: str = "training") -> Any:
    """``WideDeepModel`` with Ftrl on the linear part and Adam on the DNN. An evaluator compiles it with one
    optimizer: ``SidecarEvaluator`` cannot restore into a list of optimizers (on TF's own checkpoints either)."""
    _seeded(seed)
    linear = tf_keras.experimental.LinearModel()
    dnn = tf_keras.Sequential([tf_keras.layers.Dense(8, activation="relu"), tf_keras.layers.Dense(1)])
    model = tf_keras.experimental.WideDeepModel(linear, dnn)
    optimizer: Any = (
        [tf_keras.optimizers.Ftrl(0.1), tf_keras.optimizers.Adam(0.01)] if compiled_for == "training" else "sgd"
    )
    model.compile(
        optimizer=optimizer,
        loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[tf_keras.metrics.BinaryAccuracy(threshold=0.0)],
    )
    return model


def _wide_deep_twice() -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    (wide, _), labels = _wide_deep_data()
    return (wide, wide[:, :4]), labels


TWO_OPTIMIZERS = Style(
    build=lambda seed: _fit(_two_optimizers(seed), _dataset(_wide_deep_twice()).repeat()),
    evaluator=lambda seed: _two_optimizers(seed, compiled_for="evaluation"),
    data=lambda: _dataset(_wide_deep_twice()),
)


# ----------------------------------------------------------------------------------------------- metric
def _metric_job(seed: int) -> Job:
    """A custom loop whose checkpoint holds its AUC beside the model and optimizer (under
    ParameterServerStrategy, metric variables made in the strategy's scope live on a PS)."""
    model = _sequential(seed)
    auc = tf_keras.metrics.AUC(from_logits=True)
    optimizer = model.optimizer
    for ids, labels in _dataset(_ids_data()).repeat().take(STEP):
        with tf.GradientTape() as tape:
            logits = model(ids, training=True)
            loss = model.compiled_loss(labels, logits)
        weights = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights, strict=True))
        auc.update_state(labels, logits)
    return Job(model, tf.train.Checkpoint(model=model, optimizer=optimizer, auc=auc))


METRIC = Style(build=_metric_job, evaluator=_sequential, data=lambda: _dataset(_ids_data()))


# ----------------------------------------------------------------------------------------------- TFRS
def _tfrs_features() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "movie_id": rng.integers(0, 50, ROWS).astype(str).astype(object),
        "user_gender": rng.integers(0, 2, ROWS).astype(np.int64),
        "user_rating": rng.integers(1, 6, ROWS).astype(np.float32),
    }


def _tfrs(seed: int) -> Any:
    """The DCN ranking model of tests/jobs/tfrs_dcn.py, smaller: lookups and embeddings per feature, a Cross
    layer, a ``Ranking`` task with an RMSE metric."""
    import tensorflow_recommenders as tfrs  # only under TF_USE_LEGACY_KERAS=1 (this module's docstring)

    _seeded(seed)
    features = _tfrs_features()

    class DCN(tfrs.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.movie = tf.keras.Sequential(
                [
                    tf.keras.layers.StringLookup(vocabulary=np.unique(features["movie_id"]), mask_token=None),
                    tf.keras.layers.Embedding(51, 8),
                ]
            )
            self.gender = tf.keras.Sequential(
                [tf.keras.layers.IntegerLookup(vocabulary=[0, 1], mask_value=None), tf.keras.layers.Embedding(3, 8)]
            )
            self.cross = tfrs.layers.dcn.Cross(projection_dim=None, kernel_initializer="glorot_uniform")
            self.deep = tf.keras.layers.Dense(8, activation="relu")
            self.logit = tf.keras.layers.Dense(1)
            self.task = tfrs.tasks.Ranking(
                loss=tf.keras.losses.MeanSquaredError(reduction=tf.keras.losses.Reduction.SUM),
                metrics=[tf.keras.metrics.RootMeanSquaredError("RMSE")],
            )

        def call(self, features: dict[str, Any]) -> Any:
            x = tf.concat([self.movie(features["movie_id"]), self.gender(features["user_gender"])], axis=1)
            return self.logit(self.deep(self.cross(x)))

        def compute_loss(self, features: dict[str, Any], training: bool = False) -> Any:
            labels = features["user_rating"]
            return self.task(labels=labels, predictions=self(features))

    model = DCN()
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01))
    model({k: v[:1] for k, v in features.items()})
    return model


TFRS = Style(
    build=lambda seed: _fit(_tfrs(seed), tf.data.Dataset.from_tensor_slices(_tfrs_features()).batch(BATCH).repeat()),
    evaluator=_tfrs,
    data=lambda: tf.data.Dataset.from_tensor_slices(_tfrs_features()).batch(BATCH),
)

STYLES = {
    "sequential": SEQUENTIAL,
    "functional_empty_nodes": FUNCTIONAL,
    "subclassed": SUBCLASSED,
    "tfrs": TFRS,
    "two_optimizers": TWO_OPTIMIZERS,
    "ps_metric": METRIC,
}


# ----------------------------------------------------------------------------------------------- the round trip
def as_array(value: Any) -> np.ndarray:
    """A checkpoint reader's value as an array: a scalar string comes as ``bytes``, kept whole (dtype object)."""
    return np.array(value, dtype=object) if isinstance(value, bytes) else np.asarray(value)


def differing(expected: dict[str, np.ndarray], prefix: str) -> list[str]:
    """Keys whose tensor at ``prefix`` is not ``expected``'s bit for bit, or that only one side has."""
    reader = tf.train.load_checkpoint(prefix)
    keys = set(reader.get_variable_to_shape_map())
    bad = sorted(keys ^ set(expected))
    bad += [k for k in sorted(keys & set(expected)) if not bitwise_equal(as_array(reader.get_tensor(k)), expected[k])]
    return bad


class Evaluations(tf_keras.callbacks.Callback):  # type: ignore[misc]
    """The logs of every evaluation a ``SidecarEvaluator`` runs."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: list[dict[str, float]] = []

    def on_test_end(self, logs: Any = None) -> None:
        self.logs.append({k: float(v) for k, v in (logs or {}).items()})


def round_trip(name: str, folder: Path, *, evaluator: type | None = None) -> str:
    """Checkpoint style ``name`` through psguard, export it to ``folder/export`` and read it back with TF's tools:
    ``load_checkpoint`` (every tensor psguard stored, bit for bit; the object graph as ``tf.train.Checkpoint``
    writes it for the same objects), ``Checkpoint.restore`` into a model of other initial values (everything
    consumed, every variable then bit for bit), ``checkpoints_iterator`` (yields it) and ``SidecarEvaluator``
    (``evaluator``: tf_keras's unless given; evaluates it as the trained model evaluates). Returns the prefix."""
    style = STYLES[name]
    job = style.build(1)
    out = folder / "export"
    with CheckpointManager(job.root, str(folder / "store")) as manager:
        info = manager.save(STEP).result(timeout=120)
        stored = manager.store.load(info.id)
        prefix = export_checkpoint(manager.store, info.id, out)
    assert prefix == str(out / f"ckpt-{STEP}"), prefix
    tf_prefix = job.root.write(str(folder / "tf" / "ckpt"))
    tf_graph = tf.train.load_checkpoint(tf_prefix).get_tensor(OBJECT_GRAPH_KEY)
    graph = tf.train.load_checkpoint(prefix).get_tensor(OBJECT_GRAPH_KEY)
    assert graph == tf_graph, f"object graph: {len(graph)} bytes ending {graph[-8:]!r}, TF's ending {tf_graph[-8:]!r}"
    assert not differing(stored, prefix)
    tf_reader = tf.train.load_checkpoint(tf_prefix)
    assert not differing({k: as_array(tf_reader.get_tensor(k)) for k in tf_reader.get_variable_to_shape_map()}, prefix)

    fresh = style.build(2)
    fresh.root.restore(prefix).assert_consumed()
    restored = read_tensors(fresh.root)
    assert sorted(restored) == sorted(k for k in stored if k != OBJECT_GRAPH_KEY)
    assert not [k for k in restored if not bitwise_equal(restored[k], stored[k])]

    assert next(tf.train.checkpoints_iterator(str(out), timeout=1)) == prefix
    seen = Evaluations()
    sidecar = evaluator or tf_keras.utils.SidecarEvaluator
    sidecar(style.evaluator(3), style.data(), str(out), max_evaluations=1, callbacks=[seen]).start()
    want = job.model.evaluate(style.data(), return_dict=True, verbose=0)
    assert seen.logs == [{k: float(v) for k, v in want.items()}], (seen.logs, want)
    return prefix


if __name__ == "__main__":
    round_trip(sys.argv[1], Path(sys.argv[2]))
    print("round trip ok")
