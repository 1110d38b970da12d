"""A PS agent's shard tier answering restores (psguard.agent.tiers.shards.ShardKeeper.export).

The chief's agent asks the PS agents to export ahead of a restore, while the PS restart and the trainer
rebuilds; the restore's own export must then get the same files without writing them again, and must never get
files of another state.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.agent.tiers.shards import ShardKeeper, shard_keys
from psguard.errors import CorruptCheckpointError
from psguard.handoff.parts import PartCapture, ShardFiles, ShardKey
from psguard.handoff.tensor_bundle import bundle_files, write_bundle
from psguard.tensors import Full, Rows
from tests.support.tensors import lazy_tf, restore_bundle

NAME = "model/embedding/.ATTRIBUTES/VARIABLE_VALUE"
KEY = ShardKey(NAME, 0, 1000)
TIER_NAME = f"{NAME}@0:1000"


def keeper_with(tmp_path: Path, value: np.ndarray, token: str) -> ShardKeeper:
    keeper = ShardKeeper(tmp_path / "parts", "ps:0").start()
    keeper._keys = {TIER_NAME: (KEY, (2000, value.shape[1]))}  # as the first capture's part would set it
    assert keeper.tier.apply({TIER_NAME: Full(value)}, step=5, token=token, parent=None).ok
    return keeper


def read_back(answer: dict[str, Any], like: np.ndarray) -> np.ndarray:
    """The file as the PS reads it (RestoreV2, checking its CRC32C, dtype and shape)."""
    (f,) = answer["files"]
    value = restore_bundle(f["path"], like.dtype)
    assert list(value.shape) == [f["rows"], *f["shape"][1:]] == list(like.shape)
    return np.asarray(value.numpy())


def test_an_export_for_the_same_state_reuses_the_files_and_any_other_state_is_written_again(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    value = rng.standard_normal((1000, 4)).astype(np.float32)
    keeper = keeper_with(tmp_path, value, "t1")
    try:
        first = keeper.export({"token": "t1"})
        assert first["status"] == "ok" and np.array_equal(read_back(first, value), value)
        again = keeper.export({"token": "t1"})
        assert again["files"] == first["files"]
        assert keeper.status()["exports"] == 1 and keeper.status()["exports_reused"] == 1

        # A capture changes the state: the old files are dropped, the old state is not exported any more.
        ids = np.array([0, 7], dtype=np.int64)
        rows = np.ones((2, 4), dtype=np.float32)
        assert keeper.tier.apply({TIER_NAME: Rows(ids, rows, value.shape)}, step=10, token="t2", parent="t1").ok
        keeper._drop_restore_files()  # what ShardKeeper.apply does before it applies a capture
        assert not any(p.exists() for p in bundle_files(first["files"][0]["path"]))
        assert keeper.export({"token": "t1"})["status"] == "mismatch"
        second = keeper.export({"token": "t2"})
        want = value.copy()
        want[ids] = rows
        assert second["status"] == "ok" and np.array_equal(read_back(second, value), want)
        assert keeper.status()["exports"] == 2

        # Files that went missing (a restore loaded and dropped them, someone cleaned tmpfs): written again.
        bundle_files(second["files"][0]["path"])[1].unlink()
        third = keeper.export({"token": "t2"})
        assert third["files"] != second["files"] and np.array_equal(read_back(third, value), want)
        assert keeper.status()["exports"] == 3 and keeper.status()["exports_reused"] == 1
    finally:
        keeper.close()


def test_two_exports_at_once_write_once_and_both_get_whole_files(tmp_path: Path) -> None:
    """The export ahead and the restore's export may overlap: one writes, the other waits and reuses (before,
    the second would have deleted the first's files while they were written)."""
    value = np.arange(1000 * 64, dtype=np.float32).reshape(1000, 64)
    keeper = keeper_with(tmp_path, value, "t1")
    answers: list[dict[str, Any]] = []
    start = threading.Barrier(2)

    def export() -> None:
        start.wait()
        answers.append(keeper.export({"token": "t1"}))

    try:
        threads = [threading.Thread(target=export) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [a["status"] for a in answers] == ["ok", "ok"] and answers[0]["files"] == answers[1]["files"]
        assert np.array_equal(read_back(answers[0], value), value)
        assert keeper.status()["exports"] == 1 and keeper.status()["exports_reused"] == 1
    finally:
        keeper.close()


def filed_keeper(tmp_path: Path, value: np.ndarray, token: str) -> ShardKeeper:
    """A keeper whose tier lives in files (as on tmpfs, the default part folder), whatever tmp_path is on."""
    keeper = ShardKeeper(tmp_path / "parts", "ps:0", tier_files=True).start()
    keeper._keys = {TIER_NAME: (KEY, (2000, value.shape[1]))}
    assert keeper.tier.apply({TIER_NAME: Full(value)}, step=5, token=token, parent=None).ok
    return keeper


def tier_file(keeper: ShardKeeper) -> Path:
    with keeper.tier.export() as snap:
        path = keeper.files.data_file(snap.tensors[TIER_NAME])
    assert path is not None
    return path


def test_a_restore_from_the_own_tier_writes_no_data_its_file_is_the_tiers(tmp_path: Path) -> None:
    value = np.random.default_rng(5).standard_normal((1000, 8)).astype(np.float32)
    keeper = filed_keeper(tmp_path, value, "t1")
    try:
        answer = keeper.export({"token": "t1"})
        index, data = bundle_files(answer["files"][0]["path"])
        assert data.stat().st_ino == tier_file(keeper).stat().st_ino and data.stat().st_nlink == 2
        assert keeper.status()["export_bytes_written"] == 0 and index.stat().st_size < 200
        assert np.array_equal(read_back(answer, value), value)
    finally:
        keeper.close()
    off = ShardKeeper(tmp_path / "off", "ps:0", tier_files=False).start()  # a part folder on a disk, say
    try:
        off._keys = {TIER_NAME: (KEY, (2000, value.shape[1]))}
        assert off.tier.apply({TIER_NAME: Full(value)}, step=5, token="t1", parent=None).ok
        answer = off.export({"token": "t1"})
        assert off.status()["export_bytes_written"] == value.nbytes
        assert np.array_equal(read_back(answer, value), value) and off.tier.status().leased_arrays == 0
    finally:
        off.close()


def test_while_its_restore_files_exist_the_tier_leaves_the_exported_file_as_it_was(tmp_path: Path) -> None:
    """A write into the tier while a restore may still be read (a rollback, a stripe for a parity rebuild)
    goes to a copy of the array: the PS reads the state its index describes. Once the files are dropped (the
    next capture), captures write into the tier's file in place again."""
    value = np.arange(1000 * 4, dtype=np.float32).reshape(1000, 4)
    keeper = filed_keeper(tmp_path, value, "t1")
    try:
        answer = keeper.export({"token": "t1"})
        exported = tier_file(keeper)
        ids = np.array([3, 999], np.int64)
        rows = np.full((2, 4), -5.0, np.float32)
        assert keeper.tier.apply({TIER_NAME: Rows(ids, rows, value.shape)}, step=6, token="t2", parent="t1").ok
        assert np.array_equal(read_back(answer, value), value)  # the restore still loads t1, CRC and all
        moved = tier_file(keeper)
        assert moved != exported and keeper.tier.status().copy_on_write_bytes == value.nbytes

        keeper._drop_restore_files()  # what ShardKeeper.apply does first
        assert not exported.exists()  # the tier let go of t1's array: its file went with its last link
        assert keeper.tier.apply({TIER_NAME: Rows(ids, rows + 1, value.shape)}, step=7, token="t3", parent="t2").ok
        assert tier_file(keeper) == moved and keeper.tier.status().copy_on_write_bytes == value.nbytes
    finally:
        keeper.close()


def test_a_capture_after_a_restore_writes_the_tier_file_and_a_stale_index_then_fails_the_load(tmp_path: Path) -> None:
    tf = lazy_tf()
    value = np.arange(1000 * 4, dtype=np.float32).reshape(1000, 4)
    keeper = filed_keeper(tmp_path, value, "t1")
    try:
        answer = keeper.export({"token": "t1"})
        index = bundle_files(answer["files"][0]["path"])[0].read_bytes()
        keeper._drop_restore_files()
        ids = np.array([0], np.int64)
        assert keeper.tier.apply({TIER_NAME: Rows(ids, value[:1] + 1, value.shape)}, step=6, token="t2", parent="t1")
        # The t1 index over the tier's file as it is now (a restore read after a capture changed the file).
        stale = tmp_path / "stale"
        stale_index, stale_data = bundle_files(stale)
        os.link(tier_file(keeper), stale_data)
        stale_index.write_bytes(index)
        with pytest.raises(tf.errors.DataLossError):
            restore_bundle(stale, np.float32)
    finally:
        keeper.close()


def test_the_rows_fingerprints_are_kept_beside_them_and_exported_only_for_the_same_state(tmp_path: Path) -> None:
    """A restore gets the fingerprints the captures computed (the PS loads them instead of hashing) only while
    every capture since the last whole one sent them: never ones of another state than the rows'."""
    rng = np.random.default_rng(7)
    value = rng.standard_normal((1000, 4)).astype(np.float32)
    fps = rng.integers(-(2**63), 2**63 - 1, size=1000, dtype=np.int64)
    keeper = ShardKeeper(tmp_path / "parts", "ps:0", tier_files=True).start()
    keys = {TIER_NAME: (KEY, (2000, 4))}

    def capture(token: str, parent: str | None, update: Any, fp: Any) -> None:
        fp_updates = None if fp is None else {TIER_NAME: fp}
        keeper._drop_restore_files()  # as ShardKeeper.apply does
        answer = keeper.apply_updates({TIER_NAME: update}, keys, step=1, token=token, parent=parent, fps=fp_updates)
        assert answer["status"] == "ok"

    def exported_fps(token: str) -> np.ndarray | None:
        (f,) = keeper.export({"token": token})["files"]
        return None if "fp_path" not in f else np.asarray(restore_bundle(f["fp_path"], np.int64).numpy())

    try:
        capture("t1", None, Full(value), Full(fps))
        got = exported_fps("t1")
        assert got is not None and np.array_equal(got, fps)
        ids = np.array([2, 500], np.int64)
        new_fps = np.array([11, 22], np.int64)
        capture("t2", "t1", Rows(ids, value[ids] + 1, value.shape), Rows(ids, new_fps, (1000,)))
        want = fps.copy()
        want[ids] = new_fps
        got = exported_fps("t2")
        assert got is not None and np.array_equal(got, want)
        capture("t3", "t2", Rows(ids, value[ids] + 2, value.shape), None)  # an older trainer: none sent
        assert exported_fps("t3") is None
        capture("t4", "t3", Rows(ids, value[ids] + 3, value.shape), Rows(ids, new_fps, (1000,)))
        assert exported_fps("t4") is None  # a delta over fingerprints it does not have
        capture("t5", "t4", Full(value), Full(fps))
        got = exported_fps("t5")
        assert got is not None and np.array_equal(got, fps)
    finally:
        keeper.close()


def test_a_whole_shard_from_an_older_trainer_a_tensor_file_not_a_bundle_is_applied_all_the_same(
    tmp_path: Path,
) -> None:
    """Trainers before 420f2bf wrote a shard sent whole as a tensor file (``serialize_tensor``), newer ones as a
    bundle (``SaveV2``): an agent upgraded before its job's trainer reads both, exactly."""
    tf = lazy_tf()
    rng = np.random.default_rng(5)
    keeper = ShardKeeper(tmp_path / "parts", "ps:0").start()
    try:
        parent = None
        for k, (nonce, fmt) in enumerate([("a" * 16, "tensor file"), ("b" * 16, "bundle")]):
            value = rng.standard_normal((1000, 4)).astype(np.float32)
            folder = tmp_path / "parts" / "incoming" / nonce
            folder.mkdir(mode=0o700, parents=True)
            if fmt == "tensor file":
                (folder / "0-0.full").write_bytes(tf.io.serialize_tensor(tf.constant(value)).numpy())
            else:
                write_bundle(folder / "0-0.full", value)
            part = PartCapture("ps:0", nonce, (ShardFiles(KEY, (2000, 4), "float32", "full", 1000, "0-0"),))
            token = f"t{k}"
            keeper.apply({"part": part.to_json(), "step": 5 + k, "token": token, "parent": parent})
            parent = token
            answer = keeper.export({"token": token})
            assert answer["status"] == "ok" and np.array_equal(read_back(answer, value), value), fmt
            assert not folder.exists()  # the part's files are deleted once applied
    finally:
        keeper.close()


@pytest.mark.parametrize(
    "raw",
    [None, {"emb": [0, 4]}, [["emb", 0]], [["emb", 0, -4]], [["emb", "0", 4]], [[7, 0, 4]], [["emb", 0, True]], ["e"]],
)
def test_a_request_naming_malformed_shards_is_refused_before_anything_is_read(raw: object) -> None:
    """A load request and a restore request name shards alike (``[[name, offset, rows], ...]``) and are read by one
    parser: anything else, a string number or a bool included, is refused with where it came from."""
    with pytest.raises(CorruptCheckpointError, match="bad 'shards' in a load request"):
        shard_keys(raw, "a load request")
    assert shard_keys([["emb", 0, 4], ["emb", 4, 2]], "x") == [ShardKey("emb", 0, 4), ShardKey("emb", 4, 2)]
