"""Local stand-ins the CheckpointManager tests share: a sharded model without a cluster, one training step
of it, its variables read back, and stores that are slow or failing exactly when a test says so."""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf
from tensorflow.python.distribute import sharded_variable

from psguard.storage.base import Backend, Buffer
from psguard.storage.retry import RetryingBackend
from psguard.store import Store
from psguard.trainer.export import OBJECT_GRAPH_KEY
from psguard.trainer.variables import bitwise_equal, read_tensors


def make_local(seed: int = 0, rows: tuple[int, ...] = (1500, 1500)) -> tuple[tf.train.Checkpoint, Any, Any]:
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((sum(rows), 8)).astype(np.float32)
    bounds = np.cumsum([0, *rows])
    emb = sharded_variable.ShardedVariable(
        [tf.Variable(table[a:b], name=f"emb/part_{i}") for i, (a, b) in enumerate(itertools.pairwise(bounds))]
    )
    dense = tf.Variable(rng.standard_normal((8, 4)).astype(np.float32))
    step = tf.Variable(0, dtype=tf.int64)
    return tf.train.Checkpoint(emb=emb, dense=dense, step=step), emb, dense


def train_local(emb: Any, dense: Any, ckpt: tf.train.Checkpoint, rng: np.random.Generator, rows: int = 20) -> None:
    ids = np.unique(rng.integers(0, emb.shape[0], size=rows))
    for i in ids:
        shard = 0 if i < emb.variables[0].shape[0] else 1
        local = i - (0 if shard == 0 else emb.variables[0].shape[0])
        emb.variables[shard][local].assign(emb.variables[shard][local] + 1.0)
    dense.assign_add(tf.ones_like(dense) * 0.5)
    ckpt.step.assign_add(1)


def snapshot(ckpt: Any) -> dict[str, np.ndarray]:
    return {k: v for k, v in read_tensors(ckpt).items()}


def assert_restores(store: Store, checkpoint_id: str, expected: dict[str, np.ndarray]) -> None:
    got = store.load(checkpoint_id)
    got.pop(OBJECT_GRAPH_KEY)
    assert sorted(got) == sorted(expected)
    bad = [n for n in expected if not bitwise_equal(expected[n], got[n])]
    assert not bad, bad


class GatedBackend(RetryingBackend):
    """Chunk writes wait for ``gate``: a store that is slow exactly as long as the test wants."""

    def __init__(self, inner: Backend, gate: threading.Event) -> None:
        super().__init__(inner)
        self.gate = gate
        self.entered = threading.Event()  # a write is waiting at the gate

    def put(self, key: str, data: Buffer) -> None:
        if key.startswith("chunks/"):
            self.entered.set()
            assert self.gate.wait(60), "gate never opened"
        super().put(key, data)


class FlakyBackend(RetryingBackend):
    failing = False

    def put(self, key: str, data: Buffer) -> None:
        if self.failing and key.startswith("chunks/"):
            raise PermissionError("disk on fire")
        super().put(key, data)
