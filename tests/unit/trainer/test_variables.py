"""Reading variables as numpy arrays: string values keep every byte (TF strings are bytes, NULs included)."""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

from psguard.trainer.variables import bitwise_equal, read_tensors, to_numpy


def test_a_scalar_string_is_read_with_its_trailing_nul_bytes() -> None:
    """``numpy()`` of a scalar string is ``bytes``; as a fixed-width numpy string (dtype ``S``) it lost its
    trailing NULs, so a capture or snapshot of it stored ``b"tail"`` for ``b"tail\\x00\\x00"``."""
    value = to_numpy(tf.constant(b"tail\x00\x00"))
    assert value.dtype == np.dtype(object) and value.shape == () and value.item() == b"tail\x00\x00"
    root = tf.train.Checkpoint(label=tf.Variable(b"\x00tail\x00"), names=tf.Variable([b"a\x00", b"\x00"]))
    tensors = read_tensors(root)
    assert tensors["label/.ATTRIBUTES/VARIABLE_VALUE"].item() == b"\x00tail\x00"
    assert tensors["names/.ATTRIBUTES/VARIABLE_VALUE"].tolist() == [b"a\x00", b"\x00"]


def test_numbers_are_read_as_they_are() -> None:
    # From an array: TF caches scalar Python constants by value, and -0.0 == 0.0 would hand back a cached +0.0.
    assert bitwise_equal(to_numpy(tf.constant(np.array(-0.0, np.float32))), np.array(-0.0, np.float32))
    assert bitwise_equal(to_numpy(tf.constant([1, 2], tf.int64)), np.array([1, 2], np.int64))
