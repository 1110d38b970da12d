"""A small recommendation-style model and a ``ClusterCoordinator`` training loop, for tests, demos, benches.

The shape is what psguard is for: one large embedding table (sharded over the PS tasks by the strategy's
partitioner) of which each step touches a few rows, and a small dense part that every step changes. It is a
plain ``tf.Module``, not a Keras layer stack: in TF 2.21 Keras 3 layers fail on partitioned variables
(``'ShardedVariable' object has no attribute 'handle'``), while a ``tf.Module`` works with tf_keras and
Keras 3 optimizers alike. Gradients are taken with respect to the *shards* (``tf.Module`` flattens a
``ShardedVariable`` into them); asking ``GradientTape`` for the ``ShardedVariable`` itself fails the same way.

The capture benchmark that trains this model is ``psguard bench capture`` (:mod:`psguard.benchmarks.capture`).
"""

from __future__ import annotations

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


#: One example in this many is labelled 0, the others 1 (see :func:`labels_for`).
LABEL_PERIOD = 5


def labels_for(ids: Any) -> Any:
    """The label of each example: 0 when the sum of its ids is a multiple of :data:`LABEL_PERIOD`, else 1.

    Learnable, so a final loss says something: with ids drawn uniformly from a large vocabulary each id is seen
    a couple of times in a short run, too few to memorise a per-id rule (the old label, the parity of the id
    sum, left the loss at ln 2 = 0.693 whatever happened to the weights). Here 80% of the labels are 1: the
    model learns that from the first steps (through its biases and the shared dense layers), so the loss falls
    towards the labels' entropy, 0.50, and a run whose weights were lost or scrambled ends clearly above a
    fault-free one. The same function labels the training batches and the chaos runs' evaluation batch.
    """
    return tf.cast(tf.math.floormod(tf.reduce_sum(ids, axis=1), LABEL_PERIOD) != 0, tf.float32)


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
            labels = labels_for(ids)
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
