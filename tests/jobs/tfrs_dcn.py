"""A TensorFlow Recommenders ranking model with a Deep & Cross Network layer (``tfrs.layers.dcn.Cross``),
written as in the TFRS tutorial "Deep & Cross Network (DCN)" (tensorflow.org/recommenders/examples/dcn) and
trained by tf_keras ``model.fit`` under ParameterServerStrategy with ``BackupAndRestore``.

Lookup and embedding layers per feature inside the model (partitioned embeddings), a ``tfrs.tasks.Ranking``
task, Adam, and a ``tf.data.Dataset`` given to ``fit`` (``steps_per_epoch``, as PS training needs). The data
is made up here (MovieLens is downloaded by ``tensorflow_datasets``: no network in tests). A
``ModelCheckpoint`` keeps the weights of every epoch. Runs as the chief of the cluster in ``TF_CONFIG``:

    psguard wrap --ps 2 --workers 2 -- python tfrs_dcn.py WORKING_DIR BACKUP_DIR

Only the last line (``report``) is the test's.
"""

import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras = tf_keras, which TFRS is written against
import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs
from final_state import report

os.environ["GRPC_FAIL_FAST"] = "use_caller"

working_dir, backup_dir = sys.argv[1], sys.argv[2]

rng = np.random.default_rng(0)
N = 2048
ratings = {
    "movie_id": rng.integers(0, 1500, N).astype(str).astype(object),
    "user_id": rng.integers(0, 900, N).astype(str).astype(object),
    "user_zip_code": rng.integers(0, 300, N).astype(str).astype(object),
    "user_occupation_text": rng.choice(["artist", "doctor", "engineer", "student", "writer"], N).astype(object),
    "user_gender": rng.integers(0, 2, N).astype(np.int64),
    "bucketized_user_age": rng.choice([1, 18, 25, 35, 45, 50, 56], N).astype(np.int64),
}
ratings["user_rating"] = (1.0 + (ratings["bucketized_user_age"] % 5)).astype(np.float32)

feature_names = ["movie_id", "user_id", "user_zip_code", "user_occupation_text", "user_gender", "bucketized_user_age"]
vocabularies = {name: np.unique(ratings[name]) for name in feature_names}

train = tf.data.Dataset.from_tensor_slices(ratings)
cached_train = train.shuffle(N).batch(64).repeat()


class DCN(tfrs.Model):
    def __init__(self, use_cross_layer, deep_layer_sizes, projection_dim=None):
        super().__init__()

        self.embedding_dimension = 32

        str_features = ["movie_id", "user_id", "user_zip_code", "user_occupation_text"]
        int_features = ["user_gender", "bucketized_user_age"]

        self._all_features = str_features + int_features
        self._embeddings = {}

        # Compute embeddings for string features.
        for feature_name in str_features:
            vocabulary = vocabularies[feature_name]
            self._embeddings[feature_name] = tf.keras.Sequential(
                [
                    tf.keras.layers.StringLookup(vocabulary=vocabulary, mask_token=None),
                    tf.keras.layers.Embedding(len(vocabulary) + 1, self.embedding_dimension),
                ]
            )

        # Compute embeddings for int features.
        for feature_name in int_features:
            vocabulary = vocabularies[feature_name]
            self._embeddings[feature_name] = tf.keras.Sequential(
                [
                    tf.keras.layers.IntegerLookup(vocabulary=vocabulary, mask_value=None),
                    tf.keras.layers.Embedding(len(vocabulary) + 1, self.embedding_dimension),
                ]
            )

        if use_cross_layer:
            self._cross_layer = tfrs.layers.dcn.Cross(
                projection_dim=projection_dim, kernel_initializer="glorot_uniform"
            )
        else:
            self._cross_layer = None

        self._deep_layers = [tf.keras.layers.Dense(layer_size, activation="relu") for layer_size in deep_layer_sizes]

        self._logit_layer = tf.keras.layers.Dense(1)

        # The tutorial's MeanSquaredError() (reduction AUTO) raises under a tf.distribute strategy ("Please use
        # `tf.keras.losses.Reduction.SUM` or `tf.keras.losses.Reduction.NONE` ..."): SUM, as the error says.
        self.task = tfrs.tasks.Ranking(
            loss=tf.keras.losses.MeanSquaredError(reduction=tf.keras.losses.Reduction.SUM),
            metrics=[tf.keras.metrics.RootMeanSquaredError("RMSE")],
        )

    def call(self, features):
        # Concatenate embeddings
        embeddings = []
        for feature_name in self._all_features:
            embedding_fn = self._embeddings[feature_name]
            embeddings.append(embedding_fn(features[feature_name]))

        x = tf.concat(embeddings, axis=1)

        # Build Cross Network
        if self._cross_layer is not None:
            x = self._cross_layer(x)

        # Build Deep Network
        for deep_layer in self._deep_layers:
            x = deep_layer(x)

        return self._logit_layer(x)

    def compute_loss(self, features, training=False):
        labels = features.pop("user_rating")
        scores = self(features)
        return self.task(labels=labels, predictions=scores)


cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
NUM_PS = len(cluster_resolver.cluster_spec().as_dict()["ps"])
strategy = tf.distribute.experimental.ParameterServerStrategy(
    cluster_resolver,
    variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=(64 << 10), max_shards=NUM_PS
    ),
)

with strategy.scope():
    model = DCN(use_cross_layer=True, deep_layer_sizes=[64, 32])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.001))
    model({name: tf.constant(ratings[name][:1]) for name in feature_names})  # built: BackupAndRestore needs it

model.fit(
    cached_train,
    epochs=4,
    steps_per_epoch=10,
    callbacks=[
        tf.keras.callbacks.ModelCheckpoint(os.path.join(working_dir, "weights"), save_weights_only=True),
        tf.keras.callbacks.BackupAndRestore(backup_dir),
    ],
    verbose=2,
)

report(model, step=model.optimizer.iterations.numpy())
