"""The custom training loop of TensorFlow's tutorial "Parameter server training with ParameterServerStrategy"
(train.py beside this file), rewritten for an in-process recovery (docs/user-guide.md, "Recovery flows"): what
holds variables (model, optimizer, metric, step function, per-worker dataset, ``psguard.CheckpointManager``) is
made by ``build()``, which restores; ``train(job)`` runs the epochs left. When a PS fails,
``psguard.run_with_recovery`` has the chief's agent restart the PS that died (the others keep running:
``peers.keep_survivors``), resets TensorFlow's view of the cluster and calls ``build`` again in this process,
which restores from the memory tier: no new process, no import, no second trace of anything outside ``build``.

The tutorial's other parts stay as it writes them: Keras ``StringLookup`` preprocessing made once in the
strategy's scope and applied in the workers' ``dataset_fn``, a ``MinSizePartitioner`` over the PS, a partitioned
tf_keras ``Embedding``, a legacy RMSprop not built before the restore, an ``Accuracy`` metric, a save after each
epoch's ``join``. Run it with the same URL as ``--store``:

    psguard wrap --ps 2 --workers 2 --store /tmp/ckpt -- python train_in_process.py /tmp/ckpt
"""

import os
import random
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras = tf_keras: Keras 3 has no ParameterServerStrategy support
import tensorflow as tf

import psguard

os.environ["GRPC_FAIL_FAST"] = "use_caller"

checkpoint_dir = sys.argv[1]
cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
NUM_PS = len(cluster_resolver.cluster_spec().as_dict()["ps"])
variable_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
    min_shard_bytes=(256 << 10), max_shards=NUM_PS
)
strategy = tf.distribute.experimental.ParameterServerStrategy(
    cluster_resolver, variable_partitioner=variable_partitioner
)
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]

with strategy.scope():
    feature_lookup_layer = tf.keras.layers.StringLookup(vocabulary=feature_vocab, mask_token=None)
    label_lookup_layer = tf.keras.layers.StringLookup(vocabulary=label_vocab, num_oov_indices=0, mask_token=None)
    raw_feature_input = tf.keras.layers.Input(shape=(3,), dtype=tf.string, name="feature")
    feature_preprocess_stage = tf.keras.Model({"features": raw_feature_input}, feature_lookup_layer(raw_feature_input))
    raw_label_input = tf.keras.layers.Input(shape=(1,), dtype=tf.string, name="label")
    label_preprocess_stage = tf.keras.Model({"label": raw_label_input}, label_lookup_layer(raw_label_input))


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        examples["features"].append(features)
        examples["label"].append(["yes"] if "avenger" in features else ["no"])
    return examples


examples = feature_and_label_gen()


def dataset_fn(_):
    raw_dataset = tf.data.Dataset.from_tensor_slices(examples)
    return (
        raw_dataset.map(
            lambda x: ({"features": feature_preprocess_stage(x["features"])}, label_preprocess_stage(x["label"]))
        )
        .shuffle(200)
        .batch(32)
        .repeat()
    )


num_epoches = 4
steps_per_epoch = 5


def build():
    with strategy.scope():
        model_input = tf.keras.layers.Input(shape=(3,), dtype=tf.int64, name="model_input")
        emb_layer = tf.keras.layers.Embedding(input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384)
        emb_output = tf.reduce_mean(emb_layer(model_input), axis=1)
        dense_output = tf.keras.layers.Dense(units=1, activation="sigmoid")(emb_output)
        model = tf.keras.Model({"features": model_input}, dense_output)
        optimizer = tf.keras.optimizers.legacy.RMSprop(learning_rate=0.1)
        accuracy = tf.keras.metrics.Accuracy()

    @tf.function
    def step_fn(iterator):
        def replica_fn(batch_data, labels):
            with tf.GradientTape() as tape:
                pred = model(batch_data, training=True)
                per_example_loss = tf.keras.losses.BinaryCrossentropy(reduction=tf.keras.losses.Reduction.NONE)(
                    labels, pred
                )
                loss = tf.nn.compute_average_loss(per_example_loss)
                gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            accuracy.update_state(labels, tf.cast(tf.greater(pred, 0.5), tf.int64))
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    @tf.function
    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    manager = psguard.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=optimizer), checkpoint_dir, max_to_keep=3
    )
    manager.restore_or_initialize()
    return {
        "optimizer": optimizer,
        "accuracy": accuracy,
        "step_fn": step_fn,
        "iterator": per_worker_iterator,
        "manager": manager,
    }


def train(job):
    global_steps = int(job["optimizer"].iterations.numpy())
    starting_epoch = global_steps // steps_per_epoch
    print("Starting at epoch %d (global step %d)." % (starting_epoch, global_steps))
    for i in range(starting_epoch, num_epoches):
        job["accuracy"].reset_states()
        for _ in range(steps_per_epoch):
            coordinator.schedule(job["step_fn"], args=(job["iterator"],))
        coordinator.join()
        job["manager"].save()
        print("Finished epoch %d, accuracy is %f." % (i, job["accuracy"].result().numpy()))
    return job


job, recovery = psguard.run_with_recovery(
    build, train, restart_ps=lambda failed_at: psguard.restart_ps_servers(failed_at=failed_at)
)
print("Recovered %d time(s) in process." % len(recovery.recoveries))
job["manager"].close()
