"""The ``Model.fit`` section of TensorFlow's tutorial "Parameter server training with ParameterServerStrategy"
(tensorflow.org/tutorials/distribute/parameter_server_training), as a script a user copies from it.

tf_keras (``TF_USE_LEGACY_KERAS=1``: Keras 3's fit does not support ParameterServerStrategy), a
``DatasetCreator``, ``steps_per_execution``, and the tutorial's callbacks: ``TensorBoard``, ``ModelCheckpoint``
and ``BackupAndRestore``, which brings a restarted coordinator back to the last finished epoch. Runs as the
chief of the cluster in ``TF_CONFIG``:

    psguard wrap --ps 2 --workers 2 -- python tutorial_fit.py WORKING_DIR BACKUP_DIR

Only the last line (``report``) is the test's.
"""

import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras = tf_keras: Keras 3 has no ParameterServerStrategy support
import tensorflow as tf
from final_state import report

# Set the environment variable to allow reporting worker and ps failure to the
# coordinator. This is a workaround and won't be necessary in the future.
os.environ["GRPC_FAIL_FAST"] = "use_caller"

working_dir, backup_dir = sys.argv[1], sys.argv[2]
cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
NUM_PS = len(cluster_resolver.cluster_spec().as_dict()["ps"])

variable_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
    min_shard_bytes=(256 << 10), max_shards=NUM_PS
)

strategy = tf.distribute.experimental.ParameterServerStrategy(
    cluster_resolver, variable_partitioner=variable_partitioner
)


def dataset_fn(input_context):
    global_batch_size = 64
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)

    x = tf.random.uniform((10, 10))
    y = tf.random.uniform((10,))

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(2)

    return dataset


dc = tf.keras.utils.experimental.DatasetCreator(dataset_fn)

with strategy.scope():
    # The tutorial's model has no input shape: BackupAndRestore then warns that the model "must be built before
    # you call `fit()`" and backs nothing up (a restarted job starts over). Built, as the warning says.
    model = tf.keras.models.Sequential([tf.keras.Input(shape=(10,)), tf.keras.layers.Dense(10)])

    model.compile(tf.keras.optimizers.SGD(), loss="mse", steps_per_execution=10)

log_dir = os.path.join(working_dir, "log")
ckpt_filepath = os.path.join(working_dir, "ckpt")

callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir=log_dir),
    tf.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
    tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
]

model.fit(dc, epochs=5, steps_per_epoch=20, callbacks=callbacks)

report(model, step=model.optimizer.iterations.numpy())
