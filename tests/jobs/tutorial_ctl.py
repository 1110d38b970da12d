"""The custom training loop of TensorFlow's tutorial "Parameter server training with ParameterServerStrategy"
(tensorflow.org/tutorials/distribute/parameter_server_training), as a script a user copies from it.

Keras preprocessing layers (StringLookup) built under the strategy's scope and applied in the workers'
``dataset_fn``, a tf_keras Embedding partitioned by ``MinSizePartitioner``, a legacy RMSprop that is never
built before the restore, an ``Accuracy`` metric on the PS, epochs ended by ``coordinator.join()``, a
``tf.train.CheckpointManager`` saved after every epoch and the tutorial's restore lines ("Handling task
failure"). Runs as the chief of the cluster in ``TF_CONFIG`` ("Clusters in the real world"):

    psguard wrap --ps 2 --workers 2 -- python tutorial_ctl.py CHECKPOINT_DIR

Only the last line (``report``) is the test's.
"""

import os
import random
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras = tf_keras: Keras 3 has no ParameterServerStrategy support
import tensorflow as tf
from final_state import report

# Set the environment variable to allow reporting worker and ps failure to the
# coordinator. This is a workaround and won't be necessary in the future.
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

feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]

with strategy.scope():
    feature_lookup_layer = tf.keras.layers.StringLookup(vocabulary=feature_vocab, mask_token=None)
    label_lookup_layer = tf.keras.layers.StringLookup(vocabulary=label_vocab, num_oov_indices=0, mask_token=None)

    raw_feature_input = tf.keras.layers.Input(shape=(3,), dtype=tf.string, name="feature")
    feature_id_input = feature_lookup_layer(raw_feature_input)
    feature_preprocess_stage = tf.keras.Model({"features": raw_feature_input}, feature_id_input)

    raw_label_input = tf.keras.layers.Input(shape=(1,), dtype=tf.string, name="label")
    label_id_input = label_lookup_layer(raw_label_input)

    label_preprocess_stage = tf.keras.Model({"label": raw_label_input}, label_id_input)


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


examples = feature_and_label_gen()


def dataset_fn(_):
    raw_dataset = tf.data.Dataset.from_tensor_slices(examples)

    train_dataset = (
        raw_dataset.map(
            lambda x: ({"features": feature_preprocess_stage(x["features"])}, label_preprocess_stage(x["label"]))
        )
        .shuffle(200)
        .batch(32)
        .repeat()
    )
    return train_dataset


# These variables created under the `Strategy.scope` will be placed on parameter
# servers in a round-robin fashion.
with strategy.scope():
    # Create the model. The input needs to be compatible with Keras processing layers.
    model_input = tf.keras.layers.Input(shape=(3,), dtype=tf.int64, name="model_input")

    emb_layer = tf.keras.layers.Embedding(input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384)
    emb_output = tf.reduce_mean(emb_layer(model_input), axis=1)
    dense_output = tf.keras.layers.Dense(units=1, activation="sigmoid")(emb_output)
    model = tf.keras.Model({"features": model_input}, dense_output)

    optimizer = tf.keras.optimizers.legacy.RMSprop(learning_rate=0.1)
    accuracy = tf.keras.metrics.Accuracy()

assert len(emb_layer.weights) == 2


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

        actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
        accuracy.update_state(labels, actual_pred)
        return loss

    batch_data, labels = next(iterator)
    losses = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)


@tf.function
def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

num_epoches = 4
steps_per_epoch = 5

checkpoint_manager = tf.train.CheckpointManager(
    tf.train.Checkpoint(model=model, optimizer=optimizer), checkpoint_dir, max_to_keep=3
)
if checkpoint_manager.latest_checkpoint:
    checkpoint = checkpoint_manager.checkpoint
    checkpoint.restore(checkpoint_manager.latest_checkpoint).assert_existing_objects_matched()

global_steps = int(optimizer.iterations.numpy())
starting_epoch = global_steps // steps_per_epoch
print("Starting at epoch %d (global step %d)." % (starting_epoch, global_steps))

for i in range(starting_epoch, num_epoches):
    accuracy.reset_states()
    for _ in range(steps_per_epoch):
        coordinator.schedule(step_fn, args=(per_worker_iterator,))
    # Wait at epoch boundaries.
    coordinator.join()
    checkpoint_manager.save()
    print("Finished epoch %d, accuracy is %f." % (i, accuracy.result().numpy()))

report(checkpoint_manager.checkpoint, step=optimizer.iterations.numpy())
