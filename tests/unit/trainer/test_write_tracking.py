"""Dirty-row tracking on local variables (eager): which rows a write marks, and the apply counter."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

from psguard.trainer.variables import Shard
from psguard.trainer.write_tracking import DirtyRows, StepCounter


def test_a_sparse_write_marks_its_rows_and_a_dense_one_the_whole_shard() -> None:
    var = tf.Variable(tf.zeros([6, 2]))
    dirty = DirtyRows(Shard(var=var, offset=0, rows=6))
    assert not dirty.rows.numpy().any() and not bool(dirty.whole.numpy()) and dirty.live is None
    dirty.mark_rows(tf.constant([[1], [4]]))
    assert dirty.rows.numpy().tolist() == [False, True, False, False, True, False]
    assert not bool(dirty.whole.numpy())
    dirty.mark_whole()
    assert bool(dirty.whole.numpy())


def test_a_slots_live_rows_start_as_every_row() -> None:
    slot = DirtyRows(Shard(var=tf.Variable(tf.zeros([3])), offset=0, rows=3), slot=True)
    assert slot.live is not None and slot.live.numpy().all()


def test_the_step_counter_counts_applies() -> None:
    counter = StepCounter("/cpu:0")
    counter.increment()
    counter.increment()
    assert int(counter.var.numpy()) == 2
