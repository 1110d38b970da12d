"""Retention with a corrupt newest checkpoint (a flipped bit in one of its chunks): the good one survives.

The fault is forced (a bit flipped in a chunk only the newest checkpoint uses), then retention runs both
ways it runs in production: the ``psguard gc`` CLI in a real process, and ``Store.retain`` as the agent's
persister calls it after every commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from psguard.storage.registry import open_backend
from psguard.store import Store
from psguard.store.index import MANIFEST_CACHE_ENTRIES, Index
from psguard.store.manifest import chunk_key
from psguard.tensors import Rows
from tests.support.paths import ROOT
from tests.support.storage_targets import Target, make_target


@pytest.fixture(
    params=[pytest.param("local", id="local"), pytest.param("seaweed", id="s3-seaweedfs", marks=pytest.mark.slow)]
)
def target(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Target:
    return make_target(request.param, request, tmp_path, unique)


def two_checkpoints_newest_corrupt(store: Store, *, delta: bool) -> tuple[str, str, np.ndarray]:
    """A good checkpoint, then a newer one (a full or a delta over it) with a bit flipped in its own chunk."""
    t = np.arange(8000, dtype=np.float32).reshape(1000, 8)
    good = store.save(10, {"t": t.copy()}).id
    t2 = t.copy()
    t2[500] = -1
    if delta:
        newest = store.save(20, {"t": Rows(np.array([500]), t2[500:501], t2.shape)}, parent=good).id
    else:
        newest = store.save(20, {"t": t2 * 3}).id
    own = {r.hash for r in store.manifest(newest).refs()} - {r.hash for r in store.manifest(good).refs()}
    victim = sorted(own)[0]
    data = bytearray(store.backend.get(chunk_key(victim)))
    data[len(data) // 2] ^= 0x10
    store.backend.put(chunk_key(victim), bytes(data))
    assert not store.verify(newest).ok and store.verify(good).ok
    return good, newest, t


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_retain_keeps_the_restorable_checkpoint_not_the_corrupt_newest(target: Target, delta: bool) -> None:
    with Store.open(target.url, target.options, chunk_bytes=4096) as store:
        good, newest, want = two_checkpoints_newest_corrupt(store, delta=delta)
        report = store.retain(keep_last=1, keep_every_hours=None)  # what the agent runs after each commit
        assert report is not None
        assert good in report.kept and newest not in report.kept
        assert report.corrupt_checkpoints == (newest,)
        assert report.deleted_checkpoints == (newest,)
    with Store.open(target.url, target.options) as fresh:
        restored = fresh.load_latest()
        assert restored.info.id == good
        assert np.array_equal(restored.tensors["t"], want)


def test_cli_gc_keep_last_1_keeps_the_good_checkpoint_and_reports_the_corrupt_one(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    with Store.open(url, chunk_bytes=4096) as store:
        good, newest, want = two_checkpoints_newest_corrupt(store, delta=False)
    out = subprocess.run(
        [sys.executable, "-m", "psguard.cli", "gc", url, "--keep-last", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 3, out.stderr  # the documented exit code for corruption
    doc = json.loads(out.stdout)
    assert doc["kept"] == [good]
    assert {p["checkpoint"] for p in doc["corrupt"]} == {newest}
    assert "CRC32C" in doc["corrupt"][0]["message"]
    text = subprocess.run(
        [sys.executable, "-m", "psguard.cli", "verify", url], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert text.returncode == 0, text.stdout  # what is left is all restorable
    with Store.open(url) as fresh:
        restored = fresh.load_latest()
        assert restored.info.id == good and np.array_equal(restored.tensors["t"], want)


def test_nothing_restorable_means_nothing_deleted(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "store"), chunk_bytes=4096) as store:
        t = np.arange(4000, dtype=np.float32)
        a = store.save(1, {"t": t}).id
        b = store.save(2, {"t": t + 1}).id
        for cid in (a, b):
            ref = store.manifest(cid).tensors["t"].chunks[0]
            data = bytearray(store.backend.get(chunk_key(ref.hash)))
            data[0] ^= 1
            store.backend.put(chunk_key(ref.hash), bytes(data))
        report = store.gc(keep_last=1)
        assert report.deleted_checkpoints == () and set(report.kept) == {a, b}
        assert set(report.corrupt_checkpoints) == {a, b}


def test_a_reader_keeps_a_bounded_number_of_manifests_however_many_were_committed(tmp_path: Path) -> None:
    """A PS agent reads the chain of every save it writes while the chief's retention deletes the old ones; it
    held every manifest it had ever parsed (the soak found the agent growing by each commit)."""

    table = np.zeros((4, 2), dtype=np.float32)
    with Store.open(str(tmp_path)) as writer:
        ids = [writer.save(step, {"t": table + step}).id for step in range(MANIFEST_CACHE_ENTRIES + 40)]
    reader = Index(open_backend(str(tmp_path)))
    for cid in ids:
        assert reader.manifest(cid).id == cid
    cached = reader._manifests
    assert len(cached) == MANIFEST_CACHE_ENTRIES
    assert ids[-1] in cached and ids[0] not in cached  # the least recently used went first
    reader.manifest(ids[-MANIFEST_CACHE_ENTRIES])  # read again: now the most recent, kept at the next insert
    reader.manifest(ids[0])
    assert ids[-MANIFEST_CACHE_ENTRIES] in cached and ids[-MANIFEST_CACHE_ENTRIES + 1] not in cached


def test_a_gc_with_no_grace_removes_what_a_writer_killed_a_moment_ago_left(tmp_path: Path) -> None:
    """The chaos harness's final gc runs once every writer is stopped: a PS agent killed mid-write shortly before
    the end left a temporary chunk that a gc with the usual grace (a lease) keeps, and the leak audit failed."""
    with Store.open(str(tmp_path)) as store:
        store.save(0, {"t": np.zeros((4, 2), dtype=np.float32)})
    leftover = tmp_path / "chunks" / "ab" / ("ab" * 32 + ".tmp.0123456789ab")
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(b"half a chunk")
    a_second_ago = time.time() - 1.0  # past the storage's mtime resolution, well within a lease
    os.utime(leftover, (a_second_ago, a_second_ago))
    with Store.open(str(tmp_path)) as store:
        store.gc(keep_last=1)
    assert leftover.exists(), "with the grace of a lease, a fresh leftover may be a live writer's: kept"
    with Store.open(str(tmp_path), chunk_grace=0.0) as store:
        store.gc(keep_last=1)
    assert not leftover.exists()


def test_a_gc_with_no_grace_removes_a_leftover_written_within_the_storages_mtime_resolution(tmp_path: Path) -> None:
    """CI failed once (test_faults, mid-manifest): a leftover younger than the storage's mtime resolution outlived a
    gc with chunk_grace=0, which kept it by the age rule that gc already skips for chunks. With no grace the caller
    says every lease has passed: nothing of a dead writer stays, whatever its mtime."""
    with Store.open(str(tmp_path)) as store:
        store.save(0, {"t": np.zeros((4, 2), dtype=np.float32)})
    leftover = tmp_path / "manifests" / ("000000000099-47e5c233.json.tmp.5f8dd5563c58")
    leftover.write_bytes(b'{"half a manif')
    just_now = time.time() + 0.005  # the storage's clock may read a little ahead of the gc's "now"
    os.utime(leftover, (just_now, just_now))
    with Store.open(str(tmp_path), chunk_grace=0.0) as store:
        store.gc(keep_last=1)
        assert store.backend.leftovers() == []
    assert not leftover.exists()


_GC_KILLED_AFTER_FIRST_MANIFEST_DELETE = """
import os, sys
from psguard.storage.metered import MeteredBackend
from psguard.storage.registry import open_backend
from psguard.store import Store

class DieAfterAManifestDelete(MeteredBackend):
    def delete(self, key):
        self.inner.delete(key)
        if key.startswith("manifests/"):
            os._exit(75)  # the process dies right after the deletion returns

backend = DieAfterAManifestDelete(open_backend(sys.argv[1]), lambda n: None)
Store(backend, chunk_grace=0).gc(keep_last=1)
"""


def test_a_gc_killed_after_any_manifest_deletion_leaves_only_whole_chains(tmp_path: Path) -> None:
    """Found by the crash-point enumeration (``psguard.testbed.crashpoints``, path gc, local, the point after
    "delete manifests/<step 1>"): gc deleted the oldest checkpoints first, so a gc killed right after deleting a
    delta chain's base left the deltas over it listed and unrestorable ("its parent is missing"). Children go
    first now: at whatever point a gc dies, every checkpoint left is whole."""
    t = np.arange(64, dtype=np.float32).reshape(16, 4)
    with Store.open(str(tmp_path), chunk_bytes=64) as store:
        parent = store.save(1, {"t": t}).id
        for step in (2, 3):
            t[step] = step
            parent = store.save(step, {"t": Rows(np.array([step]), t[step : step + 1], t.shape)}, parent=parent).id
        store.save(4, {"t": t * 2})
    child = subprocess.run(
        [sys.executable, "-c", _GC_KILLED_AFTER_FIRST_MANIFEST_DELETE, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 75, child.stderr
    with Store.open(str(tmp_path)) as store:
        ids = store.checkpoint_ids()
        assert len(ids) == 3  # one of the three doomed ones went
        assert [cid for cid in ids if not store.verify(cid).ok] == []


def test_gc_keeping_more_than_the_store_holds_deletes_nothing(tmp_path: Path) -> None:
    """keep_last larger than the number of checkpoints keeps them all, the oldest included."""
    with Store.open(str(tmp_path), chunk_grace=0.0) as store:
        ids = [store.save(step, {"t": np.full((4, 2), step, np.float32)}).id for step in (1, 2, 3)]
        report = store.gc(keep_last=5)
        assert report.deleted_checkpoints == ()
        assert sorted(report.kept) == sorted(ids) == store.checkpoint_ids()
