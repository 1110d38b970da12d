"""A custom training loop with a tf_keras (non-legacy) optimizer, created but never built before the restore,
checkpointed with the idiom of TensorFlow's "Training checkpoints" guide (tensorflow.org/guide/checkpoint):
a ``step`` variable in the checkpoint, ``ckpt.restore(manager.latest_checkpoint)`` whether or not there is
one, ``manager.save()`` every 10 steps, numbered by the checkpoint's save counter.

The loop itself is the ParameterServerStrategy API docs' (``ClusterCoordinator.schedule`` with a per-worker
dataset, a ``FixedShardsPartitioner`` over the PS). Runs as the chief of the cluster in ``TF_CONFIG``:

    psguard wrap --ps 2 --workers 2 -- python keras_adam_ctl.py CHECKPOINT_DIR

Only the last line (``report``) is the test's.
"""

import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf_keras layers: Keras 3 layers fail on partitioned variables
import tensorflow as tf
from final_state import report

VOCAB, DIM, BATCH, STEPS = 4096, 16, 64, 40
checkpoint_dir = sys.argv[1]

cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
num_ps = len(cluster_resolver.cluster_spec().as_dict()["ps"])
strategy = tf.distribute.experimental.ParameterServerStrategy(
    cluster_resolver,
    variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_shards=num_ps),
)
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

with strategy.scope():
    model = tf.keras.Sequential(
        [
            tf.keras.Input(shape=(2,), dtype=tf.int64),
            tf.keras.layers.Embedding(VOCAB, DIM),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(16, activation="relu"),
            tf.keras.layers.Dense(1),
        ]
    )
    opt = tf.keras.optimizers.Adam(0.01)


def dataset_fn(input_context):
    seed = [3, input_context.input_pipeline_id]
    ids = tf.random.stateless_uniform([4096, 2], seed=seed, maxval=VOCAB, dtype=tf.int64)
    labels = tf.cast(tf.math.floormod(tf.reduce_sum(ids, axis=1), 2), tf.float32)
    return tf.data.Dataset.from_tensor_slices((ids, labels)).shuffle(1024).repeat().batch(BATCH)


@tf.function
def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)


@tf.function
def train_step(iterator):
    def replica_fn(ids, labels):
        with tf.GradientTape() as tape:
            logits = tf.squeeze(model(ids, training=True), axis=1)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
        variables = model.trainable_variables
        gradients = tape.gradient(loss, variables)
        opt.apply_gradients(zip(gradients, variables))
        return loss

    ids, labels = next(iterator)
    return strategy.run(replica_fn, args=(ids, labels))


ckpt = tf.train.Checkpoint(step=tf.Variable(0, dtype=tf.int64), optimizer=opt, net=model)
manager = tf.train.CheckpointManager(ckpt, checkpoint_dir, max_to_keep=3)

ckpt.restore(manager.latest_checkpoint)
if manager.latest_checkpoint:
    print("Restored from {}".format(manager.latest_checkpoint))
else:
    print("Initializing from scratch.")
print("Starting at step {}".format(int(ckpt.step)))

while int(ckpt.step) < STEPS:
    coordinator.schedule(train_step, args=(per_worker_iterator,))
    ckpt.step.assign_add(1)
    if int(ckpt.step) % 10 == 0:
        coordinator.join()
        save_path = manager.save()
        print("Saved checkpoint for step {}: {}".format(int(ckpt.step), save_path))

report(ckpt, step=opt.iterations.numpy())
