"""The PS agents' restore files: one-tensor TensorFlow bundles written without TensorFlow, read by RestoreV2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from psguard.handoff.tensor_bundle import BUNDLE_KEY, bundle_files, write_bundle


def _tf() -> Any:
    import tensorflow as tf

    return tf


def _restore(prefix: Path, dtype: Any) -> Any:
    tf = _tf()
    return tf.raw_ops.RestoreV2(
        prefix=str(prefix), tensor_names=[BUNDLE_KEY], shape_and_slices=[""], dtypes=[tf.as_dtype(dtype)]
    )[0]


CASES = [
    ("float32", (2, 3)),
    ("float32", (1000, 32)),
    ("float64", (7,)),
    ("float16", (3, 4, 5)),
    ("bfloat16", (130, 8)),
    ("int64", (300,)),
    ("int32", (0, 4)),
    ("uint8", (5, 3)),
    ("bool", (9, 2)),
    ("complex64", (4, 2)),
]


def _value(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == "bfloat16":
        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    if dtype == "complex64":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)
    if dtype.startswith(("int", "uint")):
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize(("dtype", "shape"), CASES, ids=[f"{d}{list(s)}" for d, s in CASES])
def test_the_files_are_byte_identical_to_tensorflows_own_and_restore_exactly(
    tmp_path: Path, dtype: str, shape: tuple[int, ...]
) -> None:
    tf = _tf()
    value = _value(dtype, shape)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    write_bundle(ours, value)
    tf.raw_ops.SaveV2(
        prefix=str(theirs), tensor_names=[BUNDLE_KEY], shape_and_slices=[""], tensors=[tf.constant(value)]
    )
    for mine, tfs in zip(bundle_files(ours), bundle_files(theirs), strict=True):
        assert mine.read_bytes() == tfs.read_bytes(), mine.name
        assert mine.stat().st_mode & 0o777 == 0o600
    back = _restore(ours, value.dtype).numpy()
    assert back.shape == shape and back.dtype == value.dtype
    assert back.tobytes() == value.tobytes()


def test_a_damaged_or_mismatched_bundle_fails_the_restore(tmp_path: Path) -> None:
    """What the PS's load relies on to refuse a file before assigning anything: RestoreV2 checks them all."""
    tf = _tf()
    value = _value("float32", (64, 8))
    prefix = tmp_path / "b"
    write_bundle(prefix, value)
    index, data = bundle_files(prefix)
    good = data.read_bytes()
    with pytest.raises(tf.errors.InvalidArgumentError):  # the dtype asked for is not the file's
        _restore(prefix, np.float64)
    flipped = bytearray(good)
    flipped[100] ^= 0x01
    data.write_bytes(bytes(flipped))
    with pytest.raises(tf.errors.DataLossError, match=r"(?i)checksum|crc"):
        _restore(prefix, np.float32)
    data.write_bytes(good[:-4])
    with pytest.raises((tf.errors.OutOfRangeError, tf.errors.DataLossError, tf.errors.InvalidArgumentError)):
        _restore(prefix, np.float32)
    data.write_bytes(good)
    table = bytearray(index.read_bytes())
    table[12] ^= 0x40  # inside the data block: its CRC no longer matches
    index.write_bytes(bytes(table))
    with pytest.raises((tf.errors.DataLossError, tf.errors.InvalidArgumentError)):
        _restore(prefix, np.float32)


def test_only_numeric_tensors_are_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="numeric tensors only"):
        write_bundle(tmp_path / "s", np.array([b"a", b"b"], dtype=object))
    assert not any(tmp_path.iterdir())
