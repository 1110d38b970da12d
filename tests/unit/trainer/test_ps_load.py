"""The restore's PS-side load on local variables: shards read from one-tensor bundles, rebased, all or nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

from psguard.handoff.tensor_bundle import BUNDLE_KEY
from psguard.trainer.capture_graph import Plan, ShardPlan, TensorPlan, functions_for
from psguard.trainer.ps_load import run_load

ROWS, DIM = 40, 3


def local_cpu() -> str:
    """The device eager ops run on here: ``/job:localhost`` in a fresh process, the chief's job once a cluster test
    in the same xdist worker has connected TensorFlow to its cluster (the context stays connected)."""
    return str(tf.zeros([]).device)


def plan(shards: int) -> Plan:
    cpu = local_cpu()
    shard = ShardPlan(device=cpu, rows=ROWS)
    tensor = TensorPlan(by_row=True, spill=True, marks=False, live=False, row_bytes=4 * DIM, dtype=np.float32,
                        tail=(DIM,), shards=(shard,) * shards)  # fmt: skip
    return Plan((tensor,), counter_device=None, iterations=0, chunk_bytes=1 << 20, probe_rows=0, spill_dirs=(),
                local=cpu)  # fmt: skip


def shard_vars(shards: int) -> tuple[Any, ...]:
    per_shard = tuple(
        (tf.Variable(tf.zeros([ROWS, DIM])), tf.Variable(tf.zeros([ROWS], tf.int64)), None, None, None)
        for _ in range(shards)
    )
    return ((per_shard,), None, ())


def bundle(path: Path, value: np.ndarray) -> str:
    tf.raw_ops.SaveV2(prefix=str(path), tensor_names=[BUNDLE_KEY], shape_and_slices=[""], tensors=[value])
    return str(path)


def test_each_shard_is_read_from_its_bundle_and_its_fingerprints_hashed_from_the_value(tmp_path: Path) -> None:
    values = [np.random.default_rng(i).standard_normal((ROWS, DIM)).astype(np.float32) for i in range(2)]
    files = [bundle(tmp_path / f"s{j}.full", v) for j, v in enumerate(values)]
    variables = shard_vars(2)
    gap, mapped = run_load(functions_for(plan(2)), [((0, j), f, None, False) for j, f in enumerate(files)], (), (),
                           variables)  # fmt: skip
    assert int(gap) == 0 and mapped == 0
    for (var, fps, *_), value in zip(variables[0][0], values, strict=True):
        assert np.array_equal(var.numpy(), value)
        assert np.array_equal(fps.numpy(), tf.bitcast(tf.fingerprint(value), tf.int64).numpy().reshape(-1))


def test_a_file_of_the_wrong_shape_fails_the_load_before_any_shard_is_assigned(tmp_path: Path) -> None:
    good = bundle(tmp_path / "good.full", np.ones((ROWS, DIM), np.float32))
    short = bundle(tmp_path / "short.full", np.ones((ROWS - 1, DIM), np.float32))
    variables = shard_vars(2)
    with pytest.raises(tf.errors.InvalidArgumentError):
        run_load(functions_for(plan(2)), [((0, 0), good, None, False), ((0, 1), short, None, False)], (), (),
                 variables)  # fmt: skip
    assert not any(var.numpy().any() for var, *_ in variables[0][0])  # the good shard was not assigned either
