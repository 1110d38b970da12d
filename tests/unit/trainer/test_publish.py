"""``psguard publish``: TF checkpoints of a store's commits in a folder, for readers that only read TF's.

TF's own tools are the judges: ``tf.train.latest_checkpoint``, ``Checkpoint.restore``, TF's ``CheckpointManager``
and an unchanged ``tf.keras.utils.SidecarEvaluator``. The crash test kills a real ``psguard publish`` process with
SIGKILL while it writes a checkpoint. No cluster.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf
import tf_keras

from psguard import cli
from psguard.policy.engine import EveryInterval, EverySteps
from psguard.store import Store
from psguard.store.manifest import chunk_key
from psguard.trainer.export import STATE_FILE, ExportFolder
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.options import ManagerOptions
from psguard.trainer.publish import Publisher
from psguard.trainer.variables import bitwise_equal
from tests.support.evaluators import SAVES, STEPS_PER_SAVE, Seen, build, data, in_thread, next_evaluation
from tests.support.paths import QUIET, ROOT
from tests.support.processes import wait_until


def table_root(rows: int, seed: int = 0) -> tf.train.Checkpoint:
    rng = np.random.default_rng(seed)
    return tf.train.Checkpoint(emb=tf.Variable(rng.standard_normal((rows, 8)).astype(np.float32)))


def change_rows(root: tf.train.Checkpoint, seed: int, fraction: float = 0.01) -> None:
    rows = int(root.emb.shape[0])
    ids = np.unique(np.random.default_rng(seed).integers(0, rows, int(rows * fraction)))
    root.emb.scatter_add(tf.IndexedSlices(tf.ones((len(ids), 8)), tf.constant(ids)))


def restored(prefix: str, rows: int) -> np.ndarray:
    fresh = table_root(rows, seed=99)
    tf.train.Checkpoint(emb=fresh.emb).restore(prefix).expect_partial().assert_existing_objects_matched()
    return np.asarray(fresh.emb.numpy())


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ----------------------------------------------------------------------------------------------- what TF reads
@pytest.mark.slow
def test_tfs_unchanged_sidecar_evaluator_evaluates_each_published_checkpoint(tmp_path: Path) -> None:
    trainer = build(0, trainer=True)
    root = tf.train.Checkpoint(model=trainer, optimizer=trainer.optimizer)
    last = SAVES * STEPS_PER_SAVE
    seen = Seen()
    out = tmp_path / "tf"
    sidecar = tf_keras.utils.SidecarEvaluator(
        build(1, trainer=False), data(), str(out), max_evaluations=last, callbacks=[seen]
    )
    published = []
    stop = threading.Event()
    with (
        CheckpointManager(root, str(tmp_path / "store"), options=ManagerOptions(new_base_after=0)) as manager,
        ExportFolder(out, keep_last=2) as folder,
    ):
        publisher = Publisher(manager.store, folder)
        running = in_thread(lambda: publisher.run(poll_interval=0.05, stop=stop, on_published=published.append), seen)
        evaluating = in_thread(sidecar.start, seen)
        step = 0
        try:
            for _ in range(SAVES):
                trainer.fit(data().repeat(), steps_per_epoch=STEPS_PER_SAVE, epochs=1, verbose=0)
                step = int(trainer.optimizer.iterations.numpy())
                manager.save(step).result(timeout=60)
                want = {k: float(v) for k, v in trainer.evaluate(data(), return_dict=True, verbose=0).items()}
                assert next_evaluation(seen) == (step, want)
        finally:
            if evaluating.is_alive() and step < last:  # failed early: a last commit stops the evaluator
                manager.save(last).result(timeout=60)
            evaluating.join(timeout=120)
            stop.set()
            running.join(timeout=60)
    assert not evaluating.is_alive()
    assert [p.step for p in published] == [2, 4, 6]
    assert [p.via for p in published] == ["a full read", "deltas", "deltas"]
    assert tf.train.get_checkpoint_state(str(out)).all_model_checkpoint_paths == [
        str(out / "ckpt-4"),
        str(out / "ckpt-6"),
    ]
    assert files(out) == [STATE_FILE, *(f"ckpt-{n}.{s}" for n in (4, 6) for s in ("data-00000-of-00001", "index"))]


def test_a_published_checkpoint_restores_to_the_commit_bit_for_bit_whichever_way_it_was_read(tmp_path: Path) -> None:
    root = table_root(20_000)
    out = tmp_path / "tf"
    with (
        CheckpointManager(root, str(tmp_path / "store"), options=ManagerOptions(new_base_after=0)) as manager,
        ExportFolder(out) as folder,
    ):
        publisher = Publisher(manager.store, folder)
        for step in range(1, 5):
            change_rows(root, step)
            manager.save(step).result(timeout=60)
            if step == 3:
                continue  # two commits at once: both deltas applied, the newest published
            got = publisher.poll()
            assert got is not None and got.step == step
            assert bitwise_equal(restored(got.prefix, 20_000), root.emb.numpy()), f"step {step}"
            assert got.via == ("a full read" if step == 1 else "deltas")
            base = manager.store.chain(got.checkpoint)[0]
            full = sum(r.size for e in base.tensors.values() for r in e.refs())
            assert step == 1 or got.bytes_read < full / 10
        assert publisher.poll() is None  # nothing newer
    assert tf.train.latest_checkpoint(str(out)) == str(out / "ckpt-4")


# ----------------------------------------------------------------------------------------------- cadence, retention
def test_every_n_steps_publishes_the_first_commit_n_steps_after_the_last_published(tmp_path: Path) -> None:
    root = table_root(1_000)
    with (
        CheckpointManager(root, str(tmp_path / "store")) as manager,
        ExportFolder(tmp_path / "tf") as folder,
    ):
        publisher = Publisher(manager.store, folder, cadence=EverySteps(3))
        steps = []
        for step in range(1, 9):
            manager.save(step).result(timeout=60)
            got = publisher.poll()
            steps += [got.step] if got else []
    assert steps == [1, 4, 7]


def test_a_minimum_interval_counts_between_commit_times(tmp_path: Path) -> None:
    root = table_root(1_000)
    with (
        CheckpointManager(root, str(tmp_path / "store")) as manager,
        ExportFolder(tmp_path / "tf") as folder,
    ):
        publisher = Publisher(manager.store, folder, cadence=EveryInterval(3600))
        manager.save(1).result(timeout=60)
        assert publisher.poll() is not None  # the first: nothing published yet
        manager.save(2).result(timeout=60)
        assert publisher.poll() is None  # committed within the hour
        later = Publisher(manager.store, folder, cadence=EveryInterval(0.001))
        got = later.poll()
        assert got is not None and got.step == 2


def test_keep_lists_the_newest_and_deletes_the_files_of_the_others_after_the_state_file(tmp_path: Path) -> None:
    root = table_root(1_000)
    out = tmp_path / "tf"
    with (
        CheckpointManager(root, str(tmp_path / "store")) as manager,
        ExportFolder(out, keep_last=2) as folder,
    ):
        publisher = Publisher(manager.store, folder)
        for step in range(1, 5):
            manager.save(step).result(timeout=60)
            assert publisher.poll() is not None
    assert files(out) == [STATE_FILE, *(f"ckpt-{n}.{s}" for n in (3, 4) for s in ("data-00000-of-00001", "index"))]
    manager_of_tf = tf.train.CheckpointManager(table_root(1_000), str(out), max_to_keep=2)
    assert manager_of_tf.checkpoints == [str(out / "ckpt-3"), str(out / "ckpt-4")]


def test_a_restarted_publisher_carries_on_from_the_folder_and_rewrites_nothing_listed(tmp_path: Path) -> None:
    root = table_root(1_000)
    out = tmp_path / "tf"
    with CheckpointManager(root, str(tmp_path / "store")) as manager:
        manager.save(1).result(timeout=60)
        with ExportFolder(out) as folder:
            assert Publisher(manager.store, folder).poll() is not None
        written = (out / "ckpt-1.index").stat().st_mtime_ns
        manager.save(2).result(timeout=60)
        with ExportFolder(out) as folder:
            again = Publisher(manager.store, folder, cadence=EverySteps(2))
            assert again.poll() is None  # step 2 is 1 step after the folder's ckpt-1
            manager.save(3).result(timeout=60)
            got = again.poll()
            assert got is not None and got.step == 3
    assert (out / "ckpt-1.index").stat().st_mtime_ns == written
    assert [p.rsplit("/", 1)[-1] for p in tf.train.get_checkpoint_state(str(out)).all_model_checkpoint_paths] == [
        "ckpt-1",
        "ckpt-3",
    ]


def test_a_corrupt_commit_is_skipped_and_an_older_due_one_published(tmp_path: Path) -> None:
    root = table_root(1_000)
    out = tmp_path / "tf"
    with CheckpointManager(root, str(tmp_path / "store")) as manager:
        manager.save(1).result(timeout=60)
        change_rows(root, 2)
        bad = manager.save(2).result(timeout=60)
    with Store.open(str(tmp_path / "store")) as store, ExportFolder(out) as folder:
        ref = store.manifest(bad.id).tensors["emb/.ATTRIBUTES/VARIABLE_VALUE"].refs()[-1]  # rows only step 2 has
        store.backend.put(chunk_key(ref.hash), b"not the chunk")
        got = Publisher(store, folder).poll()
    assert got is not None and got.step == 1
    assert tf.train.latest_checkpoint(str(out)) == str(out / "ckpt-1")


# ----------------------------------------------------------------------------------------------- crash
ROWS = 4_000_000  # 128 MB: SaveV2 takes long enough to be killed in the middle


def start_publisher(store: str, out: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "psguard.cli", "publish", store, str(out), "--poll", "0.02", "--json"]
    env = dict(os.environ, **QUIET, PYTHONPATH=str(ROOT))
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def published_line(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready, "psguard publish published nothing"
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else "no output"
    doc: dict[str, object] = json.loads(line)
    return doc


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=60)


@pytest.mark.slow
def test_a_publisher_killed_while_writing_leaves_a_folder_tf_reads_and_the_next_one_cleans_up(tmp_path: Path) -> None:
    root = table_root(ROWS)
    url, out = str(tmp_path / "store"), tmp_path / "tf"
    states: list[np.ndarray] = []
    caught = 0
    with CheckpointManager(root, url, options=ManagerOptions(new_base_after=0)) as manager:
        manager.save(1).result(timeout=120)
        states.append(root.emb.numpy())
        proc = start_publisher(url, out)
        try:
            assert published_line(proc)["step"] == 1
            for step in (2, 3, 4):  # a kill may come after the write (the race is lost): the folder must do then too
                change_rows(root, step)
                manager.save(step).result(timeout=120)
                states.append(root.emb.numpy())
                writing = lambda s=step: any(n.startswith(f"ckpt-{s}.") for n in files(out))  # noqa: E731
                wait_until(writing, 120, f"the publisher's write of ckpt-{step}", every=0.001)
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                latest = tf.train.latest_checkpoint(str(out))
                assert latest is not None
                listed = int(latest.rsplit("-", 1)[1])
                assert listed in (step - 1, step)  # the one before, or this one if the kill came after its state
                assert bitwise_equal(restored(latest, ROWS), states[listed - 1]), f"kill at step {step}"
                assert next(tf.train.checkpoints_iterator(str(out), timeout=1)) == latest
                proc = start_publisher(url, out)  # cleans up, then publishes the commit the kill interrupted
                if listed == step:
                    continue  # the race was lost: the write had ended; the next round kills again
                caught += 1
                assert published_line(proc)["step"] == step
                assert tf.train.latest_checkpoint(str(out)) == str(out / f"ckpt-{step}")
                assert bitwise_equal(restored(str(out / f"ckpt-{step}"), ROWS), states[step - 1])
                names = [
                    p.rsplit("/", 1)[-1] for p in tf.train.get_checkpoint_state(str(out)).all_model_checkpoint_paths
                ]
                want = [f"{n}.{s}" for n in sorted(names) for s in ("data-00000-of-00001", "index")]
                assert files(out) == sorted([STATE_FILE, *want]), "files the kill left, not cleaned up"
                break
        finally:
            stop(proc)
    assert caught, "no kill came in the middle of a write"


# ----------------------------------------------------------------------------------------------- the command
def test_the_cli_publishes_with_retention_and_exits_after_n(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = table_root(1_000)
    url, out = str(tmp_path / "store"), tmp_path / "tf"
    with CheckpointManager(root, url) as manager:
        for step in (1, 2):
            manager.save(step).result(timeout=60)
    assert cli.main(["publish", url, str(out), "--keep", "1", "--exit-after", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["step"], doc["prefix"], doc["via"]) == (2, str(out / "ckpt-2"), "a full read")
    assert files(out) == [STATE_FILE, "ckpt-2.data-00000-of-00001", "ckpt-2.index"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--keep", "0"], "--keep must be at least 1"),
        (["--every", "0"], "steps: expected (>= 1), got 0"),
        (["--poll", "0"], "--poll must be a number of seconds > 0"),
    ],
)
def test_the_cli_refuses_bad_arguments_as_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert cli.main(["publish", str(tmp_path / "store"), str(tmp_path / "tf"), *args]) == cli.EXIT_USAGE
    assert message in capsys.readouterr().err
