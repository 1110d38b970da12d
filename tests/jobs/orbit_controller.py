"""A parameter-server job driven by TensorFlow Model Garden's ``orbit.Controller``, the way Model Garden's own
``official.core`` trainer runs one (``base_trainer._AsyncTrainer``, ``train_lib``).

An ``orbit.StandardTrainer`` whose train loop is scheduled on the workers through a ``ClusterCoordinator`` and
joined in ``train_loop_end``; a global step from ``orbit.utils.create_global_step()``; the
``tf.train.CheckpointManager`` that ``train_lib`` builds (``step_counter``, ``checkpoint_interval``,
``init_fn``), which the Controller restores in its constructor and saves every ``checkpoint_interval`` steps
and at the end. The optimizer is not built before that restore. Runs as the chief of the cluster in
``TF_CONFIG``:

    psguard wrap --ps 2 --workers 2 -- python orbit_controller.py MODEL_DIR

Only the last line (``report``) is the test's.
"""

import functools
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras = tf_keras (orbit imports tf_keras too)
import orbit
import tensorflow as tf
from final_state import report

VOCAB, DIM, BATCH = 4096, 16, 64
model_dir = sys.argv[1]


def dataset_fn(input_context=None):
    ids = tf.random.stateless_uniform([4096, 2], seed=[1, 2], maxval=VOCAB, dtype=tf.int64)
    labels = tf.cast(tf.math.floormod(tf.reduce_sum(ids, axis=1), 2), tf.float32)
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).shuffle(1024).repeat()
    if input_context:
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.batch(BATCH)


class Trainer(orbit.StandardTrainer):
    """A binary classifier over pairs of ids; the async parts as in ``official.core.base_trainer``."""

    def __init__(self, strategy):
        self.strategy = strategy
        with strategy.scope():
            self.model = tf.keras.Sequential(
                [
                    tf.keras.Input(shape=(2,), dtype=tf.int64),
                    tf.keras.layers.Embedding(VOCAB, DIM),
                    tf.keras.layers.Flatten(),
                    tf.keras.layers.Dense(16, activation="relu"),
                    tf.keras.layers.Dense(1),
                ]
            )
            self.optimizer = tf.keras.optimizers.legacy.SGD(learning_rate=0.1, momentum=0.9)
            self.global_step = orbit.utils.create_global_step()
            self.train_loss = tf.keras.metrics.Mean("training_loss", dtype=tf.float32)
        self.checkpoint = tf.train.Checkpoint(global_step=self.global_step, model=self.model, optimizer=self.optimizer)
        self.coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        per_worker_dataset_fn = tf.function(
            functools.partial(orbit.utils.make_distributed_dataset, strategy, dataset_fn)
        )
        train_dataset = self.coordinator.create_per_worker_dataset(per_worker_dataset_fn)
        super().__init__(train_dataset)

    def initialize(self):
        """``init_fn``: called when there is no checkpoint to restore."""
        print("no checkpoint: training from scratch", flush=True)

    def create_train_loop_fn(self):
        train_loop_fn = super().create_train_loop_fn()

        def _async_loop_fn(iterator, num_steps):
            self.coordinator.schedule(train_loop_fn, args=(iterator, num_steps))

        return _async_loop_fn

    def train_step(self, iterator):
        def step_fn(inputs):
            ids, labels = inputs
            with tf.GradientTape() as tape:
                logits = tf.squeeze(self.model(ids, training=True), axis=1)
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
            self.train_loss.update_state(loss)
            self.global_step.assign_add(1)

        self.strategy.run(step_fn, args=(next(iterator),))

    def train_loop_end(self):
        self.coordinator.join()
        logs = {"training_loss": self.train_loss.result()}
        self.train_loss.reset_states()
        return logs


cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
num_ps = len(cluster_resolver.cluster_spec().as_dict()["ps"])
strategy = tf.distribute.experimental.ParameterServerStrategy(
    cluster_resolver,
    variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_shards=num_ps),
)
trainer = Trainer(strategy)

checkpoint_manager = tf.train.CheckpointManager(
    trainer.checkpoint,
    directory=model_dir,
    max_to_keep=3,
    step_counter=trainer.global_step,
    checkpoint_interval=10,
    init_fn=trainer.initialize,
)
controller = orbit.Controller(
    strategy=strategy,
    trainer=trainer,
    global_step=trainer.global_step,
    steps_per_loop=5,
    checkpoint_manager=checkpoint_manager,
    summary_dir=os.path.join(model_dir, "train"),
)
controller.train(steps=40)

report(trainer.checkpoint, step=trainer.global_step.numpy())
