"""``psguard bench follow``: an evaluator following a job's log vs restoring each TF checkpoint whole.

A trainer saves a ``--rows`` x ``--dim`` table every ``--interval`` seconds with ``--changed`` of its rows
changed each time, twice: with ``psguard.CheckpointManager`` to a local store and with TF's own
``tf.train.Checkpoint.write`` to a local folder. A :class:`psguard.Follower` in a thread (polling every
``--poll`` seconds) applies each psguard checkpoint as it lands; the baseline restores each TF checkpoint into a
fresh model, as ``tf.train.checkpoints_iterator`` evaluators do. Printed: bytes read and seconds per applied
checkpoint on each side and their ratios, and the follower's lag from each commit to its application.

``--evaluators``: whole evaluator pods instead (:mod:`psguard.benchmarks.follow_evaluators`): the drop-in
``psguard.keras.SidecarEvaluator``, TF's ``SidecarEvaluator`` on a ``psguard publish`` folder, and TF's on TF's
own checkpoints, each a process: lag from commit to evaluation and bytes read per evaluation.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from psguard.benchmarks.common import median, print_results, progress

KEYS = (
    "rows",
    "dim",
    "state_bytes",
    "saves",
    "changed",
    "follower_bytes_per_checkpoint",
    "tf_bytes_per_restore",
    "bytes_ratio",
    "follower_apply_seconds",
    "tf_restore_seconds",
    "apply_vs_restore_ratio",
    "lag_seconds_median",
    "lag_seconds_max",
)


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(rows: int, dim: int, saves: int, changed: float, interval: float, poll: float) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf  # lazy: only the benchmark that runs needs it

    rng = np.random.default_rng(0)
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    work = Path(tempfile.mkdtemp(prefix="psguard-bench-follow-"))
    try:
        emb = tf.Variable(table)
        trainer = tf.train.Checkpoint(emb=emb, step=tf.Variable(0, dtype=tf.int64))
        del table
        store_url = str(work / "store")
        model = tf.train.Checkpoint(emb=tf.Variable(tf.zeros((rows, dim))), step=tf.Variable(0, dtype=tf.int64))
        follower = _Following(model, store_url, poll)
        tf_dirs = _save_both(trainer, store_url, work, follower, rng, saves, changed, interval)
        if follower.errors:
            raise follower.errors[0]
        tf_seconds, tf_bytes = _restore_each(tf_dirs, rows, dim)
        assert np.array_equal(model.emb.numpy(), emb.numpy()), "the follower ended at another state"
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    deltas = [a for a in follower.applied if a[0] > 0]
    apply_s = median([a[1] for a in deltas]) if deltas else float("nan")
    follower_bytes = median([float(a[3]) for a in deltas]) if deltas else float("nan")
    tf_s, tf_b = median(tf_seconds), median([float(b) for b in tf_bytes])
    lags = [a[2] for a in deltas]
    return {
        "rows": rows,
        "dim": dim,
        "state_bytes": rows * dim * 4,
        "saves": saves,
        "changed": changed,
        "applied_steps": [a[0] for a in follower.applied],
        "follower_bytes_per_checkpoint": follower_bytes,
        "tf_bytes_per_restore": tf_b,
        "bytes_ratio": follower_bytes / tf_b,
        "follower_apply_seconds": apply_s,
        "tf_restore_seconds": tf_s,
        "apply_vs_restore_ratio": apply_s / tf_s,
        "lag_seconds_median": median(lags) if lags else float("nan"),
        "lag_seconds_max": max(lags) if lags else float("nan"),
    }


class _Following:
    """A :class:`psguard.Follower` of the store on a thread, polling every ``poll`` seconds: per checkpoint it
    applied, (step, apply seconds, lag seconds, bytes read); what failed it, surfaced after :meth:`join`."""

    def __init__(self, model: Any, store_url: str, poll: float) -> None:
        from psguard.trainer.follower import Follower  # imported here, not on the follower's thread

        self._follower = Follower
        self.model, self.store_url, self.poll = model, store_url, poll
        self.applied: list[tuple[int, float, float, int]] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-follower")

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self.stop.set()
        self._thread.join()

    def wait_for(self, step: int, timeout: float) -> None:
        """Until the follower applied ``step`` (its last poll: bounded), or it failed."""
        deadline = time.monotonic() + timeout
        while (not self.applied or self.applied[-1][0] < step) and time.monotonic() < deadline and not self.errors:
            time.sleep(0.05)

    def _run(self) -> None:
        try:
            self._follow()
        except BaseException as e:  # surfaced after the join, not lost with the thread
            self.errors.append(e)
            self.stop.set()

    def _follow(self) -> None:
        with self._follower(self.model, self.store_url) as f:
            while not self.stop.is_set():
                before, t0 = f.stats.bytes_read, time.perf_counter()
                info = f.poll()
                if info is None:
                    self.stop.wait(self.poll)
                    continue
                seconds = time.perf_counter() - t0
                self.applied.append((info.step, seconds, f.stats.lag_seconds or 0.0, f.stats.bytes_read - before))


def _save_both(
    trainer: Any,
    store_url: str,
    work: Path,
    follower: _Following,
    rng: np.random.Generator,
    saves: int,
    changed: float,
    interval: float,
) -> list[Path]:
    """Train (``changed`` of the rows each time) and save each step with psguard and with TF's own write, the
    follower applying psguard's meanwhile; the TF checkpoints' folders."""
    import tensorflow as tf

    from psguard.trainer.manager import CheckpointManager
    from psguard.trainer.options import ManagerOptions

    emb = trainer.emb
    rows, dim = emb.shape
    tf_dirs: list[Path] = []
    with CheckpointManager(trainer, store_url, options=ManagerOptions(new_base_after=0)) as manager:
        first = manager.save(0)
        assert first is not None, "no checkpoint_interval: every save happens"
        first.result()
        follower.start()
        try:
            for step in range(1, saves + 1):
                time.sleep(interval)  # the job trains between saves; the follower polls meanwhile
                ids = np.unique(rng.integers(0, rows, size=int(rows * changed)))
                emb.scatter_add(tf.IndexedSlices(tf.ones((len(ids), dim)), tf.constant(ids)))
                trainer.step.assign(step)
                handle = manager.save(step)
                assert handle is not None
                handle.result()
                tf_dir = work / f"tf-{step}"
                trainer.write(str(tf_dir / "ckpt"))
                tf_dirs.append(tf_dir)
                progress(f"saved step {step}/{saves}")
            follower.wait_for(saves, 120)
        finally:
            follower.join()
    return tf_dirs


def _restore_each(tf_dirs: list[Path], rows: int, dim: int) -> tuple[list[float], list[int]]:
    """What an evaluator does without psguard: restore each checkpoint whole; the seconds and bytes of each."""
    import tensorflow as tf

    tf_seconds: list[float] = []
    tf_bytes: list[int] = []
    for tf_dir in tf_dirs:
        fresh = tf.train.Checkpoint(emb=tf.Variable(tf.zeros((rows, dim))), step=tf.Variable(0, dtype=tf.int64))
        _ = fresh.save_counter  # the trainer's checkpoint has it (the manager creates it); so must the reader
        t0 = time.perf_counter()
        fresh.read(str(tf_dir / "ckpt")).assert_consumed()
        _ = fresh.emb.numpy()[0, 0]  # the restore is lazy until a value is used
        tf_seconds.append(time.perf_counter() - t0)
        tf_bytes.append(_folder_bytes(tf_dir))
    return tf_seconds, tf_bytes


def _cmd(args: argparse.Namespace) -> int:
    if args.evaluators:
        from psguard.benchmarks import follow_evaluators  # lazy: only this variant starts evaluator processes

        results = follow_evaluators.run(args.rows, args.dim, args.saves, args.changed, args.interval)
        print_results(results, as_json=args.json, keys=follow_evaluators.KEYS)
        return 0
    results = run(args.rows, args.dim, args.saves, args.changed, args.interval, args.poll)
    print_results(results, as_json=args.json, keys=KEYS)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("follow", help="psguard.Follower vs restoring each TF checkpoint whole")
    p.add_argument("--rows", type=int, default=2_000_000, help="table rows (default 2,000,000)")
    p.add_argument("--dim", type=int, default=32, help="row width (default 32)")
    p.add_argument("--saves", type=int, default=5, help="checkpoints after the first (default 5)")
    p.add_argument("--changed", type=float, default=0.01, help="fraction of rows changed per save (default 0.01)")
    p.add_argument("--interval", type=float, default=3.0, help="seconds between saves (default 3)")
    p.add_argument("--poll", type=float, default=1.0, help="the follower's poll interval (default 1 s)")
    p.add_argument(
        "--evaluators",
        action="store_true",
        help="evaluator processes instead: psguard's SidecarEvaluator, TF's on a psguard publish folder, TF's on "
        "TF's own checkpoints (each polls every second; --poll is not used)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd)
