"""A PS agent's tier in files laid out as bundle data files (psguard.agent.tiers.tier_files.TierFiles).

What a restore relies on: the tier's own file is the data file TensorFlow's RestoreV2 reads, bit-exactly, with
an index written beside it; and a file changed under its index fails the load instead of loading wrong values.
"""

from __future__ import annotations

import errno
import gc
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.tier_files import TierFiles, on_memory_fs
from psguard.codec.dtypes import dtype_name
from psguard.errors import ConfigError, CorruptCheckpointError
from psguard.handoff.tensor_bundle import bundle_files
from psguard.handoff.tensor_file import TF_DTYPES, read_tensor_file
from psguard.tensors import Full, FullStream, Rows
from tests.support.fifos import Fifos
from tests.support.tensors import every_dtype, lazy_tf, restore_bundle

DTYPES = every_dtype()
NUMERIC = sorted(k for k, v in DTYPES.items() if dtype_name(v.dtype) in TF_DTYPES.values() and v.size)


@pytest.fixture
def files(tmp_path: Path) -> Any:
    f = TierFiles(tmp_path / "tier", enabled=True).open()
    yield f
    f.close()


def test_an_array_lives_in_an_owner_only_file_removed_when_the_tier_drops_it(files: TierFiles) -> None:
    arr = files.new((10, 4), np.dtype(np.float32))
    assert arr is not None and arr.flags.writeable and arr.flags.c_contiguous
    path = files.data_file(arr)
    assert path is not None and path.parent == files.folder and path.name.endswith(".data-00000-of-00001")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(files.folder.stat().st_mode) == 0o700
    arr[:] = 3.5
    assert np.fromfile(path, dtype=np.float32).tolist() == [3.5] * 40  # the file is the array
    view = arr.view()
    view.flags.writeable = False
    assert files.owns(view) and not files.owns(arr[1:]) and not files.owns(np.zeros((10, 4), np.float32))
    assert files.adopt(arr) is arr and files.adopt(arr, copy=True) is not arr
    del arr, view
    gc.collect()
    assert files.status()["files"] == 0 and not any(files.folder.iterdir())


def test_an_array_made_without_its_pages_is_filled_by_writes_that_allocate_them(
    files: TierFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reserve=False`` (a peer copy's fetch): the file has no pages until :meth:`TierFiles.write_rows` writes
    rows there, and the array (the tier's shared mapping) sees them; a full file system fails the write with
    ``OSError``, never a ``SIGBUS`` in the agent."""
    arr = files.new((1024, 1024), np.dtype(np.float32), reserve=False)  # 4 MB
    assert arr is not None
    path = files.data_file(arr)
    assert path is not None and path.stat().st_size == arr.nbytes and path.stat().st_blocks == 0
    head, rest = np.full((256, 1024), 2.0, np.float32), np.arange(768 * 1024, dtype=np.float32).reshape(768, 1024)
    files.write_rows(arr, 0, head)
    quarter = path.stat().st_blocks * 512
    assert arr.nbytes // 4 <= quarter < arr.nbytes // 2
    files.write_rows(arr, 256, rest)
    assert path.stat().st_blocks * 512 >= arr.nbytes
    want = np.concatenate([head, rest])
    assert np.array_equal(arr, want) and np.array_equal(np.fromfile(path, dtype=np.float32).reshape(1024, 1024), want)
    plain = np.zeros((4, 4), np.float32)
    files.write_rows(plain, 1, np.ones((2, 4), np.float32))  # not a tier file: assigned
    assert plain.sum() == 8 and plain[1:3].all()

    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    other = files.new((64, 64), np.dtype(np.float32), reserve=False)
    assert other is not None
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space"):
        files.write_rows(other, 0, np.ones((64, 64), np.float32))


def test_a_folder_others_could_write_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)
    with pytest.raises(ConfigError, match="lets group or others write"):
        TierFiles(folder, enabled=True).open()


def test_without_room_or_outside_memory_the_array_stays_anonymous(
    tmp_path: Path, files: TierFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full tmpfs fails at creation (its pages are allocated then), not as a SIGBUS at a later write."""

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    value = np.ones((4, 2), np.float32)
    assert files.new((4, 2), np.dtype(np.float32)) is None and files.adopt(value) is value
    assert files.status()["failures"] == 2 and not any(files.folder.iterdir())
    monkeypatch.undo()
    assert files.new((0, 4), np.dtype(np.float32)) is None  # nothing to map
    assert files.new((2,), np.dtype(object)) is None  # not a bundle's dtype
    if on_memory_fs(tmp_path):
        pytest.skip("the test's folder is in memory")
    auto = TierFiles(tmp_path / "auto").open()
    assert not auto.enabled and auto.new((4, 2), np.dtype(np.float32)) is None
    if Path("/dev/shm").is_dir():
        assert on_memory_fs("/dev/shm")


@pytest.mark.parametrize("case", NUMERIC)
def test_an_export_links_the_tiers_own_file_and_restores_bit_exactly(files: TierFiles, case: str) -> None:
    value = DTYPES[case]
    arr = files.adopt(value)
    assert files.owns(arr)
    prefix = files.folder.parent / "restore-0"
    assert files.export(arr, prefix)
    index, data = bundle_files(prefix)
    tier_file = files.data_file(arr)
    assert tier_file is not None and data.stat().st_ino == tier_file.stat().st_ino  # no byte written
    assert stat.S_IMODE(index.stat().st_mode) == 0o600
    back = restore_bundle(prefix, value.dtype).numpy()
    assert back.shape == value.shape and back.tobytes() == np.ascontiguousarray(value).tobytes()
    assert files.status()["bytes_linked"] == value.nbytes


def test_an_array_without_a_file_or_a_link_refused_is_not_exported_by_link(
    tmp_path: Path, files: TierFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller then writes the bundle, as before the zero-copy restore."""
    off = TierFiles(tmp_path / "off", enabled=False).open()
    assert not off.export(np.ones((3, 2), np.float32), tmp_path / "b")
    assert not bundle_files(tmp_path / "b")[1].exists()

    def refused(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    arr = files.adopt(np.ones((3, 2), np.float32))
    monkeypatch.setattr(os, "link", refused)
    assert not files.export(arr, tmp_path / "c") and not bundle_files(tmp_path / "c")[0].exists()


def test_a_file_changed_under_its_index_fails_the_load(files: TierFiles) -> None:
    """What keeps a torn read from loading wrong values: RestoreV2 checks the CRC32C of what it read."""
    tf = lazy_tf()
    arr = files.adopt(np.arange(4000, dtype=np.float32).reshape(1000, 4))
    prefix = files.folder.parent / "restore-0"
    assert files.export(arr, prefix)
    arr[7] = -1.0  # a write into the tier file after the index was written
    with pytest.raises(tf.errors.DataLossError, match=r"[Cc]hecksum"):
        restore_bundle(prefix, np.float32)


def test_a_tier_with_files_keeps_every_array_it_takes_in_them(files: TierFiles) -> None:
    """Whole values, seeds and copy-on-write copies all land in files; rows are written into the file."""
    tier = MemoryTier(home=files)
    value = np.arange(40, dtype=np.float32).reshape(10, 4)
    assert tier.apply({"a": Full(value)}, step=1, token="t1", parent=None).ok
    with tier.export() as snap:
        first = snap.tensors["a"]
        assert files.owns(first)
        # Held by an export: a write copies the array into a new file; the exported one keeps its bytes.
        ids = np.array([2], np.int64)
        assert tier.apply({"a": Rows(ids, np.full((1, 4), 9, np.float32), (10, 4))}, step=2, token="t2", parent="t1")
        assert np.array_equal(first, value)
    with tier.export() as snap:
        second = snap.tensors["a"]
        assert files.owns(second) and files.data_file(second) != files.data_file(first)
    path = files.data_file(second)
    assert tier.apply({"a": Rows(ids, np.zeros((1, 4), np.float32), (10, 4))}, step=3, token="t3", parent="t2").ok
    with tier.export() as snap:
        assert files.data_file(snap.tensors["a"]) == path  # not held: written in place
    tier.seed(4, {"b": np.ones((3, 2), np.float32)})
    with tier.export() as snap:
        assert files.owns(snap.tensors["b"])


def test_a_capture_file_is_read_straight_into_a_tier_file(files: TierFiles, tmp_path: Path) -> None:
    """A whole shard from the PS's capture lands where the tier keeps it: the apply then takes it as it is."""
    tf = lazy_tf()
    value = np.random.default_rng(1).standard_normal((50, 3)).astype(np.float32)
    (tmp_path / "0.full").write_bytes(tf.io.serialize_tensor(tf.constant(value)).numpy())
    got = read_tensor_file(tmp_path / "0.full", dtype="float32", shape=(50, 3), allocate=files.new)
    assert files.owns(got) and np.array_equal(got, value)
    tier = MemoryTier(home=files)
    assert tier.apply({"a": Full(got)}, step=1, token="t1", parent=None).ok
    with tier.export() as snap:
        assert files.data_file(snap.tensors["a"]) == files.data_file(got)  # no copy


def test_a_persist_reading_a_tier_file_sees_its_state_while_captures_write_into_the_file(files: TierFiles) -> None:
    """The durable write's lease saves the rows a capture overwrites (row-level copy-on-write), with files too:
    the capture writes into the tier's file, the persist reads the rows as they were."""
    tier = MemoryTier(home=files, stream_min_bytes=1)
    value = np.arange(400, dtype=np.float32).reshape(100, 4)
    assert tier.apply({"a": Full(value)}, step=1, token="t1", parent=None).ok
    with tier.export() as snap:
        path = files.data_file(snap.tensors["a"])
    take = tier.take_dirty()
    assert take is not None
    ids = np.array([0, 50], np.int64)
    assert tier.apply({"a": Rows(ids, np.zeros((2, 4), np.float32), (100, 4))}, step=2, token="t2", parent="t1").ok
    stream = take.updates["a"]
    assert isinstance(stream, FullStream) and np.array_equal(stream.read(0, 100), value)
    with tier.export() as snap:
        assert files.data_file(snap.tensors["a"]) == path and not snap.tensors["a"][50].any()  # in place
    assert path is not None and not np.fromfile(path, dtype=np.float32).reshape(100, 4)[0].any()
    take.commit()


def test_a_copy_of_a_tier_array_is_made_file_to_file_not_through_this_process(files: TierFiles) -> None:
    """What keeps a PS agent's RSS flat when it copies a shard a restore was given (MemoryTier hand-off): the copy's
    pages are its file's; this process maps none of them until it writes one."""
    value = files.adopt(np.random.default_rng(5).standard_normal((8192, 64)).astype(np.float32))  # 2 MB
    copy = files.adopt(value, copy=True)
    path = files.data_file(copy)
    assert path is not None and path != files.data_file(value)
    assert _rss_kb_of_mapping(path) == 0
    assert copy.tobytes() == value.tobytes()  # reads the pages in
    assert _rss_kb_of_mapping(path) >= value.nbytes // 1024


def _rss_kb_of_mapping(path: Path) -> int:
    """This process's resident kB of its mapping of ``path`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith(str(path)))
    rss = next(line for line in lines[start + 1 :] if line.startswith("Rss:"))
    return int(rss.split()[1])


def test_a_fifo_in_place_of_a_tier_file_is_refused_not_waited_on(files: TierFiles, fifos: Fifos) -> None:
    """The tier writes rows into its files and copies them by path: whatever stands there must be a regular file."""
    arr = files.new((4, 4), np.dtype(np.float32), reserve=False)
    assert arr is not None
    path = files.data_file(arr)
    assert path is not None
    fifos.put(path)
    with pytest.raises(CorruptCheckpointError, match=r"tier file: .* is a FIFO"):
        fifos.within(lambda: files.write_rows(arr, 0, np.ones((1, 4), np.float32)))
    with pytest.raises(CorruptCheckpointError, match=r"tier file: .* is a FIFO"):
        fifos.within(lambda: files.adopt(arr, copy=True))
