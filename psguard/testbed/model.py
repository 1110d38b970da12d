"""A small recommendation-style model and a ``ClusterCoordinator`` training loop, for tests, demos, benches.

The shape is what psguard is for: one large embedding table (sharded over the PS tasks by the strategy's
partitioner) of which each step touches a few rows, and a small dense part that every step changes. It is a
plain ``tf.Module``, not a Keras layer stack: in TF 2.21 Keras 3 layers fail on partitioned variables
(``'ShardedVariable' object has no attribute 'handle'``), while a ``tf.Module`` works with tf_keras and
Keras 3 optimizers alike. Gradients are taken with respect to the *shards* (``tf.Module`` flattens a
``ShardedVariable`` into them); asking ``GradientTape`` for the ``ShardedVariable`` itself fails the same way.

Capture benchmark: ``TF_CPP_MIN_LOG_LEVEL=3 TF_ENABLE_ONEDNN_OPTS=0 python -m psguard.testbed.model`` (JSON out,
``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

#: Optimizer names and families accepted by :func:`make_optimizer`.
OPTIMIZERS = ("sgd", "adagrad", "adam", "ftrl")
FAMILIES = ("tf_keras", "tf_keras_legacy", "keras3")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 1000
    embedding_dim: int = 8
    hidden: int = 16
    features: int = 2  # ids looked up per example (e.g. user and item, both in the one table)
    batch_size: int = 32
    seed: int = 0


def _uniform(shape: Sequence[int], scale: float, seed: int) -> Callable[..., Any]:
    """An initializer the PS strategy can call per shard, so a large table is created on the PS, not sent."""

    def init(partition_shape: Sequence[int] | None = None, partition_offset: Sequence[int] | None = None) -> Any:
        part = list(partition_shape) if partition_shape is not None else list(shape)
        offset = int(partition_offset[0]) if partition_offset is not None else 0
        return tf.random.stateless_uniform(part, seed=[seed, offset], minval=-scale, maxval=scale)

    return init


class RecModel(tf.Module):  # type: ignore[misc]
    """Embedding table + two dense layers; create it under ``strategy.scope()`` to place it on the PS."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__(name="rec_model")
        cfg = config or ModelConfig()
        self.config = cfg
        d, h, f = cfg.embedding_dim, cfg.hidden, cfg.features
        self.embedding = tf.Variable(
            _uniform([cfg.vocab_size, d], 0.05, cfg.seed), shape=[cfg.vocab_size, d], dtype=tf.float32,
            name="embedding",
        )  # fmt: skip
        self.dense_kernel = tf.Variable(
            _uniform([f * d, h], 0.3, cfg.seed + 1), shape=[f * d, h], dtype=tf.float32, name="dense_kernel"
        )
        self.dense_bias = tf.Variable(tf.zeros([h]), name="dense_bias")
        self.out_kernel = tf.Variable(
            _uniform([h, 1], 0.3, cfg.seed + 2), shape=[h, 1], dtype=tf.float32, name="out_kernel"
        )
        self.out_bias = tf.Variable(tf.zeros([1]), name="out_bias")
        self.step = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="step")

    def __call__(self, ids: Any) -> Any:
        cfg = self.config
        emb = tf.nn.embedding_lookup(self.embedding, ids)
        x = tf.reshape(emb, [-1, cfg.features * cfg.embedding_dim])
        x = tf.nn.relu(tf.matmul(x, self.dense_kernel) + self.dense_bias)
        return tf.squeeze(tf.matmul(x, self.out_kernel) + self.out_bias, axis=1)


def train_variables(model: Any) -> list[Any]:
    """The trainable variables with every ``ShardedVariable`` split into its shards, as optimizers need."""
    return list(model.trainable_variables)


def make_optimizer(name: str, family: str = "tf_keras", learning_rate: float | None = None) -> Any:
    """An optimizer by name from one of the Keras families that work under PS strategy in TF 2.21.

    ``tf_keras``: the TF 2.11+ optimizers from the tf_keras package (slots of a sharded variable are one
    ShardedVariable, named ``optimizer/_variables/N``); ``tf_keras_legacy``: ``OptimizerV2`` (slots under
    ``<var>/.OPTIMIZER_SLOT/optimizer/<slot>``); ``keras3``: Keras 3 (one slot per shard, plus every model
    shard tracked again under ``optimizer/_trainable_variables/N``).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {OPTIMIZERS}")
    lr = learning_rate if learning_rate is not None else {"sgd": 0.1, "adagrad": 0.1, "adam": 0.01, "ftrl": 0.1}[name]
    cls_name = {"sgd": "SGD", "adagrad": "Adagrad", "adam": "Adam", "ftrl": "Ftrl"}[name]
    if family == "tf_keras":
        import tf_keras

        return getattr(tf_keras.optimizers, cls_name)(learning_rate=lr)
    if family == "tf_keras_legacy":
        import tf_keras

        return getattr(tf_keras.optimizers.legacy, cls_name)(learning_rate=lr)
    if family == "keras3":
        import keras

        return getattr(keras.optimizers, cls_name)(learning_rate=lr)
    raise ValueError(f"optimizer family {family!r} is not one of {FAMILIES}")


def build_optimizer(optimizer: Any, variables: Sequence[Any]) -> None:
    """Create the slots now (under the strategy's scope), not lazily inside the first step.

    Restores need the slots to exist (TF skips slots of an unbuilt optimizer silently), and captures see
    a stable set of tensors from the first save.
    """
    if hasattr(optimizer, "build"):
        optimizer.build(list(variables))
    elif hasattr(optimizer, "_create_all_weights"):  # tf_keras legacy OptimizerV2
        optimizer._create_all_weights(list(variables))


class Trainer:
    """Schedules training steps of ``model`` on the cluster's workers through a ``ClusterCoordinator``.

    Each step's batch is generated on the worker from the step's index (stateless random), so runs are
    reproducible and need no input pipeline; labels are a fixed function of the ids, so there is something
    to learn. Create it under or outside ``strategy.scope()``; it builds the optimizer under the scope.
    """

    def __init__(self, strategy: Any, coordinator: Any, model: Any, optimizer: Any) -> None:
        self.strategy = strategy
        self.coordinator = coordinator
        self.model = model
        self.optimizer = optimizer
        self.next_index = 0
        variables = train_variables(model)
        with strategy.scope():
            build_optimizer(optimizer, variables)
        cfg: ModelConfig = model.config

        def replica_step(index: Any) -> Any:
            ids = tf.random.stateless_uniform(
                [cfg.batch_size, cfg.features], seed=tf.stack([index, tf.constant(cfg.seed, tf.int64)]),
                maxval=cfg.vocab_size, dtype=tf.int64,
            )  # fmt: skip
            labels = tf.cast(tf.math.floormod(tf.reduce_sum(ids, axis=1), 2), tf.float32)
            with tf.GradientTape() as tape:
                logits = model(ids)
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables, strict=True))
            model.step.assign_add(1)
            return loss

        def step_fn(index: Any) -> Any:
            return strategy.run(replica_step, args=(index,))

        self._step_fn = tf.function(step_fn)

    def train(self, steps: int, *, join: bool = True) -> None:
        """Schedule ``steps`` steps; with ``join`` wait for them (at-least-once: count ``model.step``)."""
        for _ in range(steps):
            self.coordinator.schedule(self._step_fn, args=(tf.constant(self.next_index, tf.int64),))
            self.next_index += 1
        if join:
            self.coordinator.join()


# --------------------------------------------------------------------------------------------- benchmark


def _touch_rows_fn(table: Any) -> Any:
    """A function that changes exactly ``k`` distinct rows per shard, on the PS (no data to or from the chief)."""
    from tensorflow.python.distribute import ps_values

    shards = [v.get() if isinstance(v, ps_values.CachingVariable) else v for v in table.variables]

    def touch(fraction: Any, seed: Any) -> Any:
        for i, shard in enumerate(shards):
            with tf.device(shard.device):
                n = tf.shape(shard, out_type=tf.int64)[0]
                k = tf.cast(tf.math.round(tf.cast(n, tf.float64) * fraction), tf.int32)
                perm = tf.random.experimental.stateless_shuffle(tf.range(n), seed=tf.stack([seed, i]))
                ids = perm[:k]
                shard.scatter_add(tf.IndexedSlices(tf.ones([k, shard.shape[1]], shard.dtype), ids))
        return tf.constant(True)

    return tf.function(touch, autograph=False)


def bench_capture(*, rows: int, dim: int, num_ps: int, fractions: Sequence[float], repeats: int) -> dict[str, Any]:
    """Capture stall and PS -> chief bytes vs ``tf.train.Checkpoint.write`` on a real local cluster.

    The table gets a sparse update before anything is timed: training with sparse gradients leaves every
    embedding in TF's copy-on-read mode, which makes any full read (TF's save included) copy the shard.
    """
    from psguard.capture import Capturer
    from psguard.testbed.cluster import LocalCluster

    def summary(times: list[float]) -> dict[str, Any]:
        return {"min_s": min(times), "median_s": statistics.median(times), "all_s": times}

    table_bytes = rows * dim * 4
    results: dict[str, Any] = {"rows": rows, "dim": dim, "num_ps": num_ps, "table_bytes": table_bytes}
    with LocalCluster(num_ps=num_ps, num_workers=1) as cluster:
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            cluster.cluster_resolver(),
            variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps),
        )
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            table = tf.Variable(_uniform([rows, dim], 0.05, 0), shape=[rows, dim], dtype=tf.float32, name="table")
            step = tf.Variable(tf.constant(0, tf.int64), name="step")
        module = tf.Module()
        module.table, module.step = table, step
        root = tf.train.Checkpoint(model=module)
        name = "model/table/.ATTRIBUTES/VARIABLE_VALUE"
        touch = _touch_rows_fn(table)
        seed = 0

        def change(fraction: float) -> None:
            nonlocal seed
            seed += 1
            touch(tf.constant(fraction, tf.float64), tf.constant(seed, tf.int64))
            step.assign_add(1)

        change(0.01)
        capturer = Capturer(root, coordinator=coordinator)
        t = time.perf_counter()
        capturer.capture()
        results["first_full_capture_s"] = time.perf_counter() - t  # includes tracing the capture function

        with tempfile.TemporaryDirectory(prefix="psguard-bench-") as tmp:
            tf_times = []
            for i in range(repeats + 1):
                change(0.01)
                coordinator.join()
                t = time.perf_counter()
                root.write(os.path.join(tmp, f"ckpt-{i}"))
                tf_times.append(time.perf_counter() - t)
            results["tf_write"] = summary(tf_times[1:])  # the first one traces TF's save function
            results["tf_write"]["bytes"] = sum(
                os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp) if f.startswith("ckpt-1.")
            )
        capturer.capture()
        for fraction in fractions:
            stalls, nbytes, kinds = [], [], []
            for _ in range(repeats):
                change(fraction)
                capturer.capture()
                stats = capturer.last_stats
                stalls.append(stats.stall_seconds)
                nbytes.append(stats.bytes_read)
                kinds.append("full" if name in stats.full else f"rows:{stats.rows.get(name, 0)}")
            entry = summary(stalls)
            entry.update(
                bytes_read=nbytes[-1],
                bytes_read_vs_table=nbytes[-1] / table_bytes,
                stall_vs_tf_write=entry["median_s"] / results["tf_write"]["median_s"],
                kind=kinds[-1],
            )
            results[f"changed_{fraction:g}"] = entry
        quiet = []
        for _ in range(repeats):
            capturer.capture()
            quiet.append(capturer.last_stats.stall_seconds)
        results["no_change"] = summary(quiet) | {"bytes_read": capturer.last_stats.bytes_read}
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m psguard.testbed.model", description="psguard capture benchmark")
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--num-ps", type=int, default=2)
    p.add_argument("--fractions", default="0.01,0.1,1.0", help="changed-row fractions, comma separated")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    results = bench_capture(
        rows=args.rows,
        dim=args.dim,
        num_ps=args.num_ps,
        fractions=[float(f) for f in args.fractions.split(",")],
        repeats=args.repeats,
    )
    json.dump(results, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
