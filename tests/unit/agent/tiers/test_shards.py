"""A PS agent's shard tier answering restores (psguard.agent.tiers.shards.ShardKeeper.export).

The chief's agent asks the PS agents to export ahead of a restore, while the PS restart and the trainer
rebuilds; the restore's own export must then get the same files without writing them again, and must never get
files of another state.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from psguard.agent.tiers.shards import ShardKeeper
from psguard.handoff.parts import ShardKey
from psguard.handoff.tensor_bundle import bundle_files
from psguard.tensors import Full, Rows
from tests.support.tensors import restore_bundle

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
