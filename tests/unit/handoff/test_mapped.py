"""The zero-copy restore op (psguard/handoff/map_bundle.cc, built by `psguard build-op`) and what keeps it safe.

A PS given a tier file maps it privately; the variable it is assigned to is trained on (its writes copy pages
into the PS, never into the file) and the agent must never write that file in place again (it copies the array
on its next write: MemoryTier hand-off). These run the real op in TensorFlow and the real tier on tmpfs.
"""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.tier_files import TierFiles
from psguard.handoff import mapped
from psguard.handoff.tensor_bundle import BUNDLE_KEY, bundle_files, write_bundle
from psguard.tensors import Full, Rows
from tests.support.tensors import lazy_tf


@pytest.fixture(scope="module")
def op() -> Any:
    """The op, built for this TensorFlow when it is not yet (a few seconds, once per machine)."""
    mapped.build()
    mapped.map_op.cache_clear()
    fn = mapped.map_op()
    assert fn is not None, "built, yet not loadable"
    return fn


def _bundle(folder: Path, value: np.ndarray) -> Path:
    prefix = folder / "b"
    write_bundle(prefix, value)
    return prefix


def test_a_mapped_bundle_is_bit_exact_and_training_on_it_never_writes_the_file(tmp_path: Path, op: Any) -> None:
    tf = lazy_tf()
    value = np.random.default_rng(3).standard_normal((4096, 8)).astype(np.float32)  # 32 pages
    prefix = _bundle(tmp_path, value)
    data = bundle_files(prefix)[1]
    before = data.read_bytes()
    var = tf.Variable(tf.zeros(value.shape))
    var.assign(op(str(prefix), dtype=tf.float32, key=BUNDLE_KEY, verify=True))
    assert var.numpy().tobytes() == value.tobytes()
    var.scatter_add(tf.IndexedSlices(tf.ones([2, 8]), tf.constant([0, 4000])))
    got = var.numpy()
    assert np.array_equal(got[[0, 4000]], value[[0, 4000]] + 1) and np.array_equal(got[1:4000], value[1:4000])
    assert data.read_bytes() == before  # the writes stayed in this process


def test_a_bundle_that_does_not_match_its_index_is_refused(tmp_path: Path, op: Any) -> None:
    tf = lazy_tf()
    value = np.arange(4096 * 4, dtype=np.float32).reshape(4096, 4)
    prefix = _bundle(tmp_path, value)
    with pytest.raises(tf.errors.InvalidArgumentError, match="holds float, not int64"):
        op(str(prefix), dtype=tf.int64, key=BUNDLE_KEY)
    with pytest.raises(tf.errors.NotFoundError, match="holds no tensor"):
        op(str(prefix), dtype=tf.float32, key="another")
    data = bundle_files(prefix)[1]
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(tf.errors.DataLossError, match="checksum"):
        op(str(prefix), dtype=tf.float32, key=BUNDLE_KEY, verify=True)
    data.write_bytes(bytes(raw[:-4096]))
    with pytest.raises(tf.errors.DataLossError, match="shorter than its index"):
        op(str(prefix), dtype=tf.float32, key=BUNDLE_KEY, verify=False)
    bundle_files(prefix)[0].unlink()
    with pytest.raises(tf.errors.NotFoundError):
        op(str(prefix), dtype=tf.float32, key=BUNDLE_KEY)


def test_the_library_is_refused_when_someone_else_could_have_written_it(op: Any) -> None:
    path = mapped.library_path()
    assert path is not None and mapped.built() == path
    mode = stat.S_IMODE(os.stat(path).st_mode)
    os.chmod(path, mode | 0o020)
    try:
        assert mapped.built() is None
    finally:
        os.chmod(path, mode)
    assert mapped.built() == path


def test_turned_off_nothing_is_mapped(op: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mapped.ENV_MAP_OP, "0")
    assert mapped.built() is None and not mapped.load_into_server()


def test_an_op_not_built_is_said_once_as_a_warning_and_not_when_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``pip install`` does not build the op: a job without it restores 3-4x slower, so the chief says why."""
    monkeypatch.setenv("PSGUARD_CACHE", str(tmp_path / "empty-cache"))
    mapped.map_op.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=mapped.__name__):
            assert mapped.map_op() is None and mapped.map_op() is None
        said = [r.getMessage() for r in caplog.records if "map_op_not_built" in r.getMessage()]
        assert len(said) == 1 and "psguard build-op" in said[0] and str(tmp_path) in said[0], said
        caplog.clear()
        monkeypatch.setenv(mapped.ENV_MAP_OP, "0")
        mapped.map_op.cache_clear()
        with caplog.at_level("WARNING", logger=mapped.__name__):
            assert mapped.map_op() is None
        assert not [r for r in caplog.records if "map_op" in r.getMessage()]
    finally:
        mapped.map_op.cache_clear()


def test_an_exported_tier_file_a_ps_mapped_is_never_written_in_place_again(tmp_path: Path) -> None:
    """The hand-off: after the export's restore files are dropped (the next capture), the tier's next write copies
    the array; the file the PS mapped keeps the bytes it had. Without it the write would show in the PS's pages
    that training had not written yet (a private mapping shares them with the file until then)."""
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    files = TierFiles(folder / f"psguard-test-{os.getpid()}-handoff", enabled=True).open()
    try:
        tier = MemoryTier(home=files)
        value = np.arange(4096 * 4, dtype=np.float32).reshape(4096, 4)
        assert tier.apply({"a": Full(value)}, step=1, token="t1", parent=None).ok
        snap = tier.export()
        path = files.data_file(snap.tensors["a"])
        assert path is not None
        with open(path, "rb") as f:  # what the PS holds: a private mapping of the file
            ps_view = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), np.float32).reshape(4096, 4)
        snap.release(hand_off=True)
        ids = np.array([3, 4000], np.int64)
        assert tier.apply({"a": Rows(ids, np.full((2, 4), -7, np.float32), (4096, 4))}, step=2, token="t2", parent="t1")
        assert np.array_equal(ps_view, value)  # the tier wrote a copy
        with tier.export() as now:
            assert np.array_equal(now.tensors["a"][ids], np.full((2, 4), -7, np.float32))
            assert files.data_file(now.tensors["a"]) != path
        # Handed off once: the copy is the tier's own, written in place from now on.
        with tier.export() as now:
            copy_path = files.data_file(now.tensors["a"])
        assert tier.apply({"a": Rows(ids, np.zeros((2, 4), np.float32), (4096, 4))}, step=3, token="t3", parent="t2")
        with tier.export() as now:
            assert copy_path is not None and files.data_file(now.tensors["a"]) == copy_path
    finally:
        files.close()


def test_build_op_builds_the_digest_even_when_the_op_fails_and_names_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`psguard build-op` builds both libraries, each whatever the other did: a C++ compiler that fails (or no
    TensorFlow) still leaves the row digest built, and the command fails naming what did not build."""
    from psguard.errors import ConfigError
    from psguard.handoff import native

    monkeypatch.setenv("PSGUARD_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    said: list[Path] = []
    with pytest.raises(ConfigError, match="building psguard's op failed"):
        mapped.build_all(say=said.append)
    assert said == [native.digest_library()] and native.digest_library().exists()
    assert mapped.library_path() is not None and not mapped.library_path().exists()  # type: ignore[union-attr]
