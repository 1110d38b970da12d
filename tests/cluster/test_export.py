"""``psguard export`` of a job trained under ParameterServerStrategy: its embedding partitioned over two PS, its
AUC held on a PS, read back by TensorFlow's own tools in a process with no strategy.

The other model styles, without a cluster: tests/unit/trainer/test_export.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf
import tf_keras

from psguard.trainer.export import OBJECT_GRAPH_KEY, export_checkpoint
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.variables import bitwise_equal, read_tensors
from tests.support.clusters import Chief
from tests.support.model_styles import Evaluations, as_array, differing

BUCKETS = 1000
STEPS = 4


def wide_deep() -> tuple[Any, Any]:
    """A hashed-feature Wide & Deep (functional: hashing, concatenation and activation hold no value) and the
    AUC it is compiled with, which its checkpoint holds too."""
    tf_keras.utils.set_random_seed(5)
    ids = tf_keras.Input((2,), dtype="int64", name="feature_ids")
    dense = tf_keras.Input((3,), name="numeric")
    hashed = tf_keras.layers.Hashing(BUCKETS)(ids)
    deep = tf_keras.layers.Dense(8, activation="relu")(
        tf_keras.layers.Flatten()(tf_keras.layers.Embedding(BUCKETS, 8)(hashed))
    )
    both = tf_keras.layers.Concatenate()([tf_keras.layers.Dense(1)(dense), deep])
    model = tf_keras.Model([ids, dense], tf_keras.layers.Activation("linear")(tf_keras.layers.Dense(1)(both)))
    auc = tf_keras.metrics.AUC(from_logits=True, name="auc")
    model.compile(
        optimizer=tf_keras.optimizers.Adam(0.01),
        loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[auc],
    )
    return model, auc


def examples(seed: int) -> Any:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 10**6, (64, 2))
    dense = rng.random((64, 3)).astype(np.float32)
    labels = (ids.sum(axis=1, keepdims=True) % 2).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices(((ids, dense), labels)).batch(16)


@pytest.mark.slow
def test_a_ps_trained_job_exports_what_tf_reads_without_a_strategy(chief: Chief, tmp_path: Path) -> None:
    strategy = chief.strategies["fixed2"]
    with strategy.scope():
        model, auc = wide_deep()
    creator = tf_keras.utils.experimental.DatasetCreator(lambda context: examples(context.input_pipeline_id).repeat())
    model.fit(creator, epochs=1, steps_per_epoch=STEPS, verbose=0)
    root = tf.train.Checkpoint(model=model, optimizer=model.optimizer, auc=auc)
    embedding = next(layer for layer in model.layers if isinstance(layer, tf_keras.layers.Embedding))
    assert len(embedding.embeddings.variables) == 2  # partitioned over the two PS
    assert all("/job:ps" in v.device for v in auc.variables), [v.device for v in auc.variables]

    out = tmp_path / "export"
    with CheckpointManager(root, str(tmp_path / "store")) as manager:
        info = manager.save(STEPS).result(timeout=120)
        stored = manager.store.load(info.id)
        prefix = export_checkpoint(manager.store, info.id, out)
    assert float(as_array(stored["auc/true_positives/.ATTRIBUTES/VARIABLE_VALUE"]).sum()) > 0  # it counted
    tf_prefix = root.write(str(tmp_path / "written" / "ckpt"))  # TF's own, of the same objects
    tf_reader = tf.train.load_checkpoint(tf_prefix)
    assert tf.train.load_checkpoint(prefix).get_tensor(OBJECT_GRAPH_KEY) == tf_reader.get_tensor(OBJECT_GRAPH_KEY)
    assert not differing(stored, prefix)
    tf_values = {k: as_array(tf_reader.get_tensor(k)) for k in tf_reader.get_variable_to_shape_map()}
    assert not differing({**tf_values, OBJECT_GRAPH_KEY: stored[OBJECT_GRAPH_KEY]}, prefix)

    # read where no strategy is: one embedding variable, the AUC on this process
    fresh, fresh_auc = wide_deep()
    fresh.optimizer.build(fresh.trainable_variables)
    fresh_root = tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer, auc=fresh_auc)
    fresh_root.restore(prefix).assert_consumed()
    restored = read_tensors(fresh_root)
    assert sorted(restored) == sorted(k for k in stored if k != OBJECT_GRAPH_KEY)
    assert not [k for k in restored if not bitwise_equal(restored[k], stored[k])]
    assert next(tf.train.checkpoints_iterator(str(out), timeout=1)) == prefix

    # an evaluator pod's SidecarEvaluator evaluates the export as it evaluates TF's own checkpoint of the job
    tf.train.CheckpointManager(root, str(tmp_path / "tf"), max_to_keep=1).save(checkpoint_number=STEPS)
    logs = []
    for folder in (out, tmp_path / "tf"):
        seen = Evaluations()
        evaluator, _ = wide_deep()
        tf_keras.utils.SidecarEvaluator(
            evaluator, examples(9), str(folder), max_evaluations=1, callbacks=[seen]
        ).start()
        logs.append(seen.logs)
    assert logs[0] == logs[1] and len(logs[0]) == 1 and set(logs[0][0]) == {"loss", "auc"}, logs
