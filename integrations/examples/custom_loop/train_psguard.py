"""train.py after the one-line change: psguard.CheckpointManager instead of tf.train.CheckpointManager.

Nothing else differs (tests/cluster/e2e/test_examples.py checks that). Give psguard wrap the same URL as --store, so the
chief's agent keeps the memory tier and writes the durable log there:

    psguard wrap --ps 1 --workers 1 --store /tmp/ckpt -- python train_psguard.py --checkpoint-dir /tmp/ckpt

Any store URL works for --checkpoint-dir (a path, s3://bucket/prefix, hdfs://...). Without an agent the
manager writes to the store itself.
"""

import argparse
import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras = tf_keras: Keras 3 does not support PS training
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

import psguard

VOCAB, DIM, HIDDEN, BATCH = 1000, 8, 16, 32


class Model(tf.Module):
    """One embedding table (sharded over the PS tasks) and a small dense head."""

    def __init__(self):
        super().__init__()
        self.embedding = tf.Variable(tf.random.uniform([VOCAB, DIM], -0.05, 0.05, seed=1), name="embedding")
        self.kernel = tf.Variable(tf.random.uniform([2 * DIM, HIDDEN], -0.3, 0.3, seed=2), name="kernel")
        self.out = tf.Variable(tf.random.uniform([HIDDEN, 1], -0.3, 0.3, seed=3), name="out")
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")

    def __call__(self, ids):
        x = tf.reshape(tf.nn.embedding_lookup(self.embedding, ids), [-1, 2 * DIM])
        return tf.squeeze(tf.matmul(tf.nn.relu(tf.matmul(x, self.kernel)), self.out), axis=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    num_ps = len(resolver.cluster_spec().as_dict()["ps"])
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps)
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = Model()
        optimizer = tf.keras.optimizers.Adagrad(0.1)
        optimizer.build(model.trainable_variables)  # slots exist before the restore

    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = psguard.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=3)
    restored = manager.restore_or_initialize()
    start = int(model.step.numpy())
    print(json.dumps({"event": "start", "restored": restored is not None, "step": start}), flush=True)

    @tf.function
    def step_fn(index):
        def replica_step(index):
            ids = tf.random.stateless_uniform([BATCH, 2], seed=tf.stack([index, 0]), maxval=VOCAB, dtype=tf.int64)
            labels = tf.cast(tf.math.floormod(tf.reduce_sum(ids, axis=1), 2), tf.float32)
            with tf.GradientTape() as tape:
                logits = model(ids)
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            model.step.assign_add(1)
            return loss

        return strategy.run(replica_step, args=(index,))

    index = start
    while int(model.step.numpy()) < args.steps:
        for _ in range(args.save_every):
            coordinator.schedule(step_fn, args=(tf.constant(index, tf.int64),))
            index += 1
        coordinator.join()
        manager.save(checkpoint_number=int(model.step.numpy()))
    print(json.dumps({"event": "done", "step": int(model.step.numpy())}), flush=True)


if __name__ == "__main__":
    main()
