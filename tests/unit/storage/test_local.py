"""The local-folder store as a hostile local user meets it: a FIFO, a device or a link in place of a chunk or a
manifest is refused at once, as damage, where reading it hung ``verify``, ``gc``, ``ls`` and restores."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import pytest

from psguard.errors import CorruptCheckpointError, ObjectNotFoundError
from psguard.storage.local import LocalBackend
from psguard.store import Store
from psguard.store.manifest import chunk_key, manifest_key
from tests.support.fifos import Fifos


def two_checkpoints(root: Path) -> tuple[str, str, dict[str, np.ndarray]]:
    first = {"w": np.arange(64, dtype=np.float32)}
    with Store.open(str(root)) as store:
        one = store.save(1, first).id
        two = store.save(2, {"w": np.arange(64, dtype=np.float32) * 2}).id
    return one, two, first


def chunk_of(store: Store, checkpoint: str) -> Path:
    """The file of a chunk that ``checkpoint`` needs and no other checkpoint does."""

    def refs(cid: str) -> set[str]:
        return {ref.hash for t in store.manifest(cid).tensors.values() for ref in t.refs()}

    own = refs(checkpoint) - {h for c in store.checkpoint_ids() if c != checkpoint for h in refs(c)}
    return Path(store.backend.url) / chunk_key(sorted(own)[0])


def test_a_fifo_as_a_chunk_is_damage_verify_reports_and_a_restore_falls_back_from(tmp_path: Path, fifos: Fifos) -> None:
    one, two, first = two_checkpoints(tmp_path)
    with Store.open(str(tmp_path)) as store:
        fifos.put(chunk_of(store, two))
        report = fifos.within(lambda: store.verify(two))
        assert not report.ok and "FIFO" in str(report.to_json()["problems"])
        assert fifos.within(lambda: store.verify(one)).ok
        loaded = fifos.within(store.load_latest)
        assert loaded.info.id == one and np.array_equal(loaded.tensors["w"], first["w"])
        assert [c.id for c in fifos.within(store.checkpoints)] == [one, two]  # ls reads manifests only
        fifos.within(lambda: store.gc(keep_last=2))


def test_a_fifo_as_a_manifest_is_skipped_by_ls_gc_and_restores(tmp_path: Path, fifos: Fifos) -> None:
    one, two, first = two_checkpoints(tmp_path)
    fifos.put(tmp_path / manifest_key(two))
    with Store.open(str(tmp_path)) as store:
        assert [c.id for c in fifos.within(store.checkpoints)] == [one]
        loaded = fifos.within(store.load_latest)
        assert loaded.info.id == one and np.array_equal(loaded.tensors["w"], first["w"])
        report = fifos.within(lambda: store.verify(two))
        assert not report.ok and "FIFO" in str(report.to_json()["problems"])
        fifos.within(lambda: store.gc(keep_last=1))
        assert fifos.within(store.latest) is not None


def test_only_regular_files_are_read_and_never_through_a_link(tmp_path: Path, fifos: Fifos) -> None:
    backend = LocalBackend(str(tmp_path))
    backend.put("a/regular", b"data")
    assert backend.get("a/regular") == b"data"
    buf = bytearray(8)
    assert backend.get_into("a/regular", memoryview(buf)) == 4 and buf[:4] == b"data"
    fifos.put(tmp_path / "a" / "fifo")
    (tmp_path / "a" / "zero").symlink_to("/dev/zero")  # a link to a device that never ends
    (tmp_path / "a" / "link").symlink_to(tmp_path / "a" / "regular")
    os.mkdir(tmp_path / "a" / "folder")
    for key, kind in [("fifo", "FIFO"), ("zero", "symbolic link"), ("link", "symbolic link"), ("folder", "folder")]:
        with pytest.raises(CorruptCheckpointError, match=f"object a/{key} in {tmp_path}: {key} is a {kind}"):
            fifos.within(functools.partial(backend.get, f"a/{key}"))
        with pytest.raises(CorruptCheckpointError, match=kind):
            fifos.within(functools.partial(backend.get_into, f"a/{key}", memoryview(buf)))
    with pytest.raises(ObjectNotFoundError):
        backend.get("a/missing")
