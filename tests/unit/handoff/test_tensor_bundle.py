"""The PS agents' restore files: one-tensor TensorFlow bundles written without TensorFlow, read by RestoreV2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psguard.codec.dtypes import dtype_name
from psguard.codec.tensor_bytes import byte_view, crc32c
from psguard.errors import CorruptCheckpointError
from psguard.handoff.tensor_bundle import BUNDLE_KEY, bundle_files, read_bundle, write_bundle, write_index
from psguard.handoff.tensor_file import TF_DTYPES
from tests.support.tensors import every_dtype, lazy_tf, restore_bundle

DTYPES = every_dtype()
NUMERIC = sorted(k for k, v in DTYPES.items() if dtype_name(v.dtype) in TF_DTYPES.values())


@pytest.mark.parametrize("case", NUMERIC)
def test_the_files_are_byte_identical_to_tensorflows_own_and_restore_exactly(tmp_path: Path, case: str) -> None:
    tf = lazy_tf()
    value = DTYPES[case]
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    write_bundle(ours, value)
    tensor = tf.constant(value)
    tf.raw_ops.SaveV2(prefix=str(theirs), tensor_names=[BUNDLE_KEY], shape_and_slices=[""], tensors=[tensor])
    for mine, tfs in zip(bundle_files(ours), bundle_files(theirs), strict=True):
        assert mine.read_bytes() == tfs.read_bytes(), mine.name
        assert mine.stat().st_mode & 0o777 == 0o600
    back = restore_bundle(ours, value.dtype).numpy()
    assert back.shape == value.shape and back.dtype == value.dtype
    assert back.tobytes() == np.ascontiguousarray(value).tobytes()


def test_a_damaged_or_mismatched_bundle_fails_the_restore(tmp_path: Path) -> None:
    """What the PS's load relies on to refuse a file before assigning anything: RestoreV2 checks them all."""
    tf = lazy_tf()
    value = DTYPES["f32"]  # 64 x 4
    prefix = tmp_path / "b"
    write_bundle(prefix, value)
    index, data = bundle_files(prefix)
    good = data.read_bytes()
    with pytest.raises(tf.errors.InvalidArgumentError):  # the dtype asked for is not the file's
        restore_bundle(prefix, np.float64)
    flipped = bytearray(good)
    flipped[100] ^= 0x01
    data.write_bytes(bytes(flipped))
    with pytest.raises(tf.errors.DataLossError, match=r"(?i)checksum|crc"):
        restore_bundle(prefix, np.float32)
    data.write_bytes(good[:-4])
    with pytest.raises((tf.errors.OutOfRangeError, tf.errors.DataLossError, tf.errors.InvalidArgumentError)):
        restore_bundle(prefix, np.float32)
    data.write_bytes(good)
    table = bytearray(index.read_bytes())
    table[12] ^= 0x40  # inside the data block: its CRC no longer matches
    index.write_bytes(bytes(table))
    with pytest.raises((tf.errors.DataLossError, tf.errors.InvalidArgumentError)):
        restore_bundle(prefix, np.float32)


@pytest.mark.parametrize("case", sorted(set(DTYPES) - set(NUMERIC)))
def test_only_numeric_tensors_are_written(tmp_path: Path, case: str) -> None:
    """Strings, and dtypes TensorFlow's enum lacks here (float8), are refused before a file is made."""
    with pytest.raises(ValueError, match="numeric tensors only"):
        write_bundle(tmp_path / "s", DTYPES[case])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("case", ["f32", "bf16", "int64", "bool"])
def test_an_index_for_a_data_file_already_there_is_the_one_write_bundle_writes(tmp_path: Path, case: str) -> None:
    """A PS agent whose tier is its data files writes only the index (write_index); it must be the same bytes."""
    value = np.ascontiguousarray(DTYPES[case])
    write_bundle(tmp_path / "whole", value)
    bundle_files(tmp_path / "whole")[1].rename(bundle_files(tmp_path / "index_only")[1])
    write_index(tmp_path / "index_only", value.dtype, value.shape, value.nbytes, crc32c(byte_view(value)))
    assert bundle_files(tmp_path / "index_only")[0].read_bytes() == bundle_files(tmp_path / "whole")[0].read_bytes()
    assert restore_bundle(tmp_path / "index_only", value.dtype).numpy().tobytes() == value.tobytes()


@pytest.mark.parametrize("case", NUMERIC)
def test_a_bundle_tensorflow_saved_reads_back_exactly_without_tensorflow(tmp_path: Path, case: str) -> None:
    """A PS's capture writes a shard sent whole with SaveV2; its agent (no TensorFlow) reads it with read_bundle,
    into the array ``allocate`` gives (its tier file). Also for a shard of no rows (what a capture that did not
    send it whole writes)."""
    tf = lazy_tf()
    value = np.ascontiguousarray(DTYPES[case])
    given: list[np.ndarray] = []

    def allocate(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        given.append(np.empty(shape, dtype))
        return given[-1]

    for name, v in (("whole", value), ("empty", value[:0])):
        prefix = tmp_path / name
        tf.raw_ops.SaveV2(
            prefix=str(prefix), tensor_names=[BUNDLE_KEY], shape_and_slices=[""], tensors=[tf.constant(v)]
        )
        given.clear()
        got = read_bundle(prefix, dtype=dtype_name(v.dtype), shape=v.shape, allocate=allocate)
        assert got is given[0] and got.shape == v.shape and got.dtype == v.dtype
        assert got.tobytes() == v.tobytes()


def test_a_damaged_truncated_or_other_bundle_is_refused_before_it_is_used(tmp_path: Path) -> None:
    tf = lazy_tf()
    value = np.ascontiguousarray(DTYPES["f32"])  # 64 x 4
    prefix = tmp_path / "b"
    tf.raw_ops.SaveV2(
        prefix=str(prefix), tensor_names=[BUNDLE_KEY], shape_and_slices=[""], tensors=[tf.constant(value)]
    )
    index, data = bundle_files(prefix)
    good_data, good_index = data.read_bytes(), index.read_bytes()
    assert read_bundle(prefix, dtype="float32", shape=value.shape).tobytes() == value.tobytes()
    cases = {
        "a flipped bit in the data": (bytes([good_data[0] ^ 1]) + good_data[1:], good_index),
        "a truncated data file": (good_data[:-4], good_index),
        "a damaged index": (good_data, good_index[:-1] + bytes([good_index[-1] ^ 1])),
        "an empty index": (good_data, b""),
    }
    for why, (d, i) in cases.items():
        data.write_bytes(d)
        index.write_bytes(i)
        with pytest.raises(CorruptCheckpointError):
            read_bundle(prefix, dtype="float32", shape=value.shape)
            pytest.fail(why)
    data.write_bytes(good_data)
    index.write_bytes(good_index)
    with pytest.raises(CorruptCheckpointError, match="does not describe"):  # same bytes, read as another dtype
        read_bundle(prefix, dtype="int32", shape=value.shape)
    with pytest.raises(CorruptCheckpointError, match="bytes of data"):
        read_bundle(prefix, dtype="float32", shape=(32, 4))
    with pytest.raises(CorruptCheckpointError, match="numeric tensors only"):
        read_bundle(prefix, dtype="string", shape=value.shape)
    data.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        read_bundle(prefix, dtype="float32", shape=value.shape)
