"""train.py after the one-line change: psguard.keras.CheckpointCallback instead of BackupAndRestore.

Nothing else differs (tests/cluster/e2e/test_examples.py checks that). BackupAndRestore saves only at epoch ends under
ParameterServerStrategy, writes whole checkpoints to a local path and deletes them when fit succeeds; the
psguard callback saves the changed rows every N steps to any store URL and resumes fit where it stood. Give
psguard wrap the same URL as --store, so the chief's agent keeps the memory tier and the durable log:

    psguard wrap --ps 1 --workers 1 --store /tmp/backup -- python train_psguard.py --backup-dir /tmp/backup
"""

import argparse
import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras = tf_keras: Keras 3 does not support PS training
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

import psguard.keras

VOCAB = 1000


def dataset_fn(context):
    ids = tf.random.stateless_uniform([512, 2], seed=[7, context.input_pipeline_id], maxval=VOCAB, dtype=tf.int64)
    labels = tf.cast(tf.math.floormod(tf.reduce_sum(ids, axis=1), 2), tf.float32)
    return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(16)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backup-dir", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=10)
    args = parser.parse_args()

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    num_ps = len(resolver.cluster_spec().as_dict()["ps"])
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps)
    )
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.Input((2,), dtype="int64"),
                tf.keras.layers.Embedding(VOCAB, 8),
                tf.keras.layers.Flatten(),
                tf.keras.layers.Dense(16, activation="relu"),
                tf.keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=tf.keras.optimizers.Adagrad(0.1),
            loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
            steps_per_execution=5,
        )
    history = model.fit(
        tf.keras.utils.experimental.DatasetCreator(dataset_fn),
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        callbacks=[psguard.keras.CheckpointCallback(args.backup_dir, save_freq=5)],
        verbose=0,
    )
    done = {"event": "done", "iterations": int(model.optimizer.iterations.numpy()), "epochs_run": history.epoch}
    print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main()
