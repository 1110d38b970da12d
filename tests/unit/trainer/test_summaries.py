"""psguard's TensorBoard scalars: written by the manager of a custom loop (no cluster) at its training steps, read
back with TensorBoard's own event reader, and never in training's way.

The ``model.fit`` side (the TensorBoard callback's folder) is in tests/cluster/test_keras_callback.py.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

from psguard.handoff.parts import PartCapture, ShardFiles, ShardKey
from psguard.tensors import Full, Rows, Same
from psguard.trainer.durable_lag import LagStatus
from psguard.trainer.export import object_graph_bytes
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.options import ManagerOptions
from psguard.trainer.summaries import Summaries, handed_off_bytes
from psguard.trainer.variables import TensorInfo
from tests.support.tensorboard import scalars

ROWS, WIDTH = 4096, 8  # row-tracked (1024 rows or more): a save after a few rows changed hands off those rows only
SAVE_TAGS = {
    "psguard/capture_stall_seconds",
    "psguard/save_bytes",
    "psguard/held_seconds",
    "psguard/durable_lag_steps",
    "psguard/durable_lag_seconds",
}
RESTORE_TAGS = {"psguard/restores/durable", "psguard/restore_seconds", "psguard/lost_steps"}


def lag() -> LagStatus:
    return LagStatus(steps=4, seconds=2.5, pending=1, holds=1, held_seconds=0.5, failing=False, last_durable_step=1)


def no_lag() -> LagStatus:
    raise AssertionError("the lag is asked only when it is written")


def test_a_custom_loops_saves_and_restores_are_scalars_at_their_steps(tmp_path: Path) -> None:
    logdir = tmp_path / "logs"
    table = tf.Variable(tf.zeros((ROWS, WIDTH)))
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(table=table, step=step)
    seen: dict[int, dict[str, float]] = {}
    with CheckpointManager(
        checkpoint, str(tmp_path / "store"), step_counter=step, options=ManagerOptions(summaries=logdir)
    ) as manager:
        assert manager.summaries == str(logdir)
        graph = len(object_graph_bytes(checkpoint))  # with TF's save_counter, which the manager makes
        ids = []
        for at, rows in ((3, None), (5, [1, 7])):
            if rows is not None:
                table.scatter_nd_update([[r] for r in rows], tf.ones((len(rows), WIDTH)))
            step.assign(at)
            handle = manager.save()
            assert handle is not None
            ids.append(handle.result(timeout=60).id)
            status = manager.durable_lag
            seen[at] = {
                "psguard/capture_stall_seconds": handle.stall_seconds,
                "psguard/held_seconds": manager.last_hold_seconds,
                "psguard/durable_lag_steps": status.steps,
                "psguard/durable_lag_seconds": status.seconds,
            }
        checkpoint.restore(ids[0]).assert_consumed()  # back to step 3, two steps after this process saw step 5
        assert int(step.numpy()) == 3
    got = scalars(logdir)
    assert set(got) == SAVE_TAGS | RESTORE_TAGS
    for tag in SAVE_TAGS:
        assert sorted(got[tag]) == [3, 5], tag
    for at, figures in seen.items():
        for tag, value in figures.items():
            assert got[tag][at] == pytest.approx(value, rel=1e-6, abs=1e-9), (tag, at)
    # Step 3 is whole (the table, the step, TF's save_counter, the object graph); step 5 two rows and their ids,
    # the two counters, and no graph (unchanged).
    assert got["psguard/save_bytes"] == {3: ROWS * WIDTH * 4 + 8 + 8 + graph, 5: 2 * (WIDTH * 4 + 8) + 8 + 8}
    assert got["psguard/restores/durable"] == {3: 1.0}
    assert got["psguard/lost_steps"] == {3: 2.0}
    assert set(got["psguard/restore_seconds"]) == {3} and 0 < got["psguard/restore_seconds"][3] < 60


def test_off_unless_asked(tmp_path: Path) -> None:
    step = tf.Variable(1, dtype=tf.int64)
    with CheckpointManager(tf.train.Checkpoint(step=step), str(tmp_path / "store")) as manager:
        assert manager.summaries is None
        manager.save(1)
    assert not [p for p in tmp_path.rglob("events.out.tfevents.*")]


def test_a_folder_it_cannot_write_is_logged_once_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(step=step)
    logs = tmp_path / "a-file" / "logs"
    with (
        caplog.at_level(logging.WARNING, logger="psguard.trainer.summaries"),
        CheckpointManager(checkpoint, str(tmp_path / "store"), options=ManagerOptions(summaries=logs)) as manager,
    ):
        for at in (1, 2, 3):
            step.assign(at)
            handle = manager.save(at)
            assert handle is not None and handle.result(timeout=60).step == at
        manager.restore_or_initialize()
        assert manager.restored is not None and manager.restored.step == 3
    off = [r for r in caplog.records if "event=summaries_off" in r.getMessage()]
    assert len(off) == 1 and "a-file" in off[0].getMessage()


def test_they_are_written_inside_a_record_if_false(tmp_path: Path) -> None:
    """The Keras TensorBoard callback records only every ``update_freq``-th step while it trains, with its own
    ``record_if``; psguard's scalars are written at the saves' steps whatever it says."""
    summaries = Summaries(tmp_path)
    with tf.summary.record_if(False):
        summaries.captured(7, 0.25, 1000)
        summaries.held(7, 0.0, lag)
    summaries.close()
    got = scalars(tmp_path)
    assert got["psguard/capture_stall_seconds"] == {7: 0.25}
    assert got["psguard/save_bytes"] == {7: 1000.0}
    assert got["psguard/durable_lag_steps"] == {7: 4.0}
    assert got["psguard/durable_lag_seconds"] == {7: 2.5}


def test_a_hold_is_written_at_a_step_without_a_save_and_nothing_at_one_that_did_not_wait(tmp_path: Path) -> None:
    summaries = Summaries(tmp_path)
    summaries.held(8, 0.0, no_lag)  # no save, no wait: nothing written, the lag not asked
    summaries.held(9, 1.5, no_lag)  # a wait at a step without a save: its seconds only
    summaries.close()
    assert scalars(tmp_path) == {"psguard/held_seconds": {9: 1.5}}


def test_handed_off_bytes_count_values_rows_ids_strings_and_the_rows_on_ps_nodes() -> None:
    table = TensorInfo("t", (100, 4), np.dtype(np.float32), shards=())
    updates = {
        "a": Full(np.zeros((3, 2), np.float64)),  # 48
        "t": Rows(np.array([1, 5], np.int64), np.ones((2, 4), np.float32), (100, 4)),  # 2 * 16 + 2 * 8
        "s": Same((9,), np.dtype(np.int32)),  # 0
        "graph": Full(np.array(b"x" * 37, dtype=object)),  # 37
        "names": Full(np.array([b"ab", b"cde"], dtype=object)),  # 5
    }
    shards = (
        ShardFiles(ShardKey("t", 0, 50), (100, 4), "float32", "full", 50, "0-0"),  # 50 * 16
        ShardFiles(ShardKey("t", 50, 50), (100, 4), "float32", "rows", 3, "0-1"),  # 3 * (16 + 8)
        ShardFiles(ShardKey("t", 50, 50), (100, 4), "float32", "same", 0, "0-2"),
    )
    parts = [PartCapture("ps:0", "n" * 16, shards)]
    assert handed_off_bytes(updates, parts, {"t": table}) == 48 + 48 + 37 + 5 + 800 + 72
