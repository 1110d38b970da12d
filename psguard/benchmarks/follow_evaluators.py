"""``psguard bench follow --evaluators``: an evaluator pod three ways, on one job's checkpoints.

A tf_keras model (a ``--rows`` x ``--dim`` embedding, a dense layer, Adam's two slots built) is checkpointed every
``--interval`` seconds with ``--changed`` of its rows (and their slot rows) changed each time, twice: through
``psguard.CheckpointManager`` to a local store and through ``tf.train.CheckpointManager`` to a local folder.
Three evaluator processes evaluate it as it goes, each until the last step:

- ``psguard``: ``psguard.keras.SidecarEvaluator`` on the store (the model moved by deltas);
- ``publish``: TF's ``SidecarEvaluator``, unchanged, on the folder a ``psguard publish`` process fills from the store;
- ``tf``: TF's ``SidecarEvaluator`` on TF's own checkpoints (the baseline).

Each evaluator polls once a second (TF's iterator does; the drop-in and the publisher are set alike); the two
saves of a step take turns going first. Per evaluation:
the lag from the commit of the checkpoint evaluated (psguard: the manifest's commit time; TF: the return of
``CheckpointManager.save``, its state file written) to the evaluation's start, and the bytes the evaluator process
read since its previous evaluation ended (``rchar`` of ``/proc/self/io``: the polls, the restore, everything; the
first, full load is left out). The publisher's own reads from the store are reported beside.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from psguard.benchmarks.common import median, progress

SIDES = ("psguard", "publish", "tf")
KEYS = (
    "rows",
    "dim",
    "model_bytes",
    "saves",
    "changed",
    *(f"{side}_{what}" for side in SIDES for what in ("evaluated", "lag_seconds_median", "bytes_per_evaluation")),
    "publisher_bytes_read_per_publication",
    "psguard_vs_tf_bytes_ratio",
    "publish_vs_tf_bytes_ratio",
    "psguard_vs_tf_lag_ratio",
    "publish_vs_tf_lag_ratio",
)
EVAL_EXAMPLES = 2048
_READY_TIMEOUT = 300.0


# ----------------------------------------------------------------------------------------------- the model
def bench_model(rows: int, dim: int, *, trainer: bool) -> Any:
    """The job's model: ``trainer`` compiles it with Adam and builds Adam's slots (a real checkpoint has them);
    an evaluator's is compiled for ``evaluate()`` only."""
    import tf_keras

    tf_keras.utils.set_random_seed(0 if trainer else 1)
    model = tf_keras.Sequential(
        [
            tf_keras.Input((1,), dtype="int64"),
            tf_keras.layers.Embedding(rows, dim),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer=tf_keras.optimizers.Adam(0.01) if trainer else "rmsprop",
        loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[tf_keras.metrics.BinaryAccuracy(threshold=0.0)],
    )
    if trainer:
        model.optimizer.build(model.trainable_variables)
    return model


def eval_data(rows: int) -> Any:
    import tensorflow as tf

    rng = np.random.default_rng(7)
    ids = rng.integers(0, rows, (EVAL_EXAMPLES, 1))
    return tf.data.Dataset.from_tensor_slices((ids, (ids % 2).astype(np.float32))).batch(512)


# ----------------------------------------------------------------------------------------------- an evaluator process
def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def child(kind: str, directory: str, rows: int, dim: int, last: int) -> None:
    """One evaluator (``kind``: ``psguard`` on a store, ``tf`` on a TF folder) until step ``last``; a JSON line
    per evaluation on stdout."""
    import tf_keras

    class Report(tf_keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.ended = _rchar()

        def on_test_begin(self, logs: Any = None) -> None:
            self.began, self.began_at = _rchar(), time.time()

        def on_test_end(self, logs: Any = None) -> None:
            step = int(self.model.optimizer.iterations.numpy())
            doc = {"step": step, "began_at": self.began_at, "read": self.began - self.ended}
            print(json.dumps(doc), flush=True)
            self.ended = _rchar()

    model = bench_model(rows, dim, trainer=False)
    if kind == "psguard":
        import psguard.keras

        evaluator: Any = psguard.keras.SidecarEvaluator(
            model, eval_data(rows), directory, max_evaluations=last, callbacks=[Report()], poll_interval=1.0
        )
    else:
        evaluator = tf_keras.utils.SidecarEvaluator(
            model, eval_data(rows), directory, max_evaluations=last, callbacks=[Report()]
        )
    evaluator.start()


# ----------------------------------------------------------------------------------------------- the figures
@dataclass
class Side:
    """What one evaluator reported: ``(step, began_at, bytes read)`` per evaluation, in order."""

    evaluations: list[tuple[int, float, int]] = field(default_factory=list)


def summarize(side: Side, commits: Mapping[int, float]) -> dict[str, float]:
    """An evaluator's evaluations after its first (the full load, and the checkpoint it started on, committed
    before it started): how many, the median lag from the commit of the checkpoint evaluated to the evaluation's
    start, and the median bytes read per evaluation."""
    later = side.evaluations[1:]
    if not later:
        return {"evaluated": 0.0, "lag_seconds_median": float("nan"), "bytes_per_evaluation": float("nan")}
    return {
        "evaluated": float(len(later)),
        "lag_seconds_median": median([began - commits[step] for step, began, _ in later]),
        "bytes_per_evaluation": median([float(read) for _, _, read in later]),
    }


def ratios(figures: Mapping[str, float]) -> dict[str, float]:
    def ratio(a: str, b: str) -> float:
        return figures[a] / figures[b] if figures[b] else float("nan")

    return {
        "psguard_vs_tf_bytes_ratio": ratio("psguard_bytes_per_evaluation", "tf_bytes_per_evaluation"),
        "publish_vs_tf_bytes_ratio": ratio("publish_bytes_per_evaluation", "tf_bytes_per_evaluation"),
        "psguard_vs_tf_lag_ratio": ratio("psguard_lag_seconds_median", "tf_lag_seconds_median"),
        "publish_vs_tf_lag_ratio": ratio("publish_lag_seconds_median", "tf_lag_seconds_median"),
    }


# ----------------------------------------------------------------------------------------------- the run
class _Process:
    """A child process whose JSON lines on stdout are collected by a thread, the first one also signalled."""

    def __init__(self, name: str, argv: Sequence[str], log: Path) -> None:
        self.name = name
        self.lines: list[dict[str, Any]] = []
        self.first: queue.Queue[bool] = queue.Queue()
        self._log: TextIO = log.open("w")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1")
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._reader = threading.Thread(target=self._read, name=f"bench-{name}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith("{"):
                continue  # evaluate(verbose=2)'s own lines
            self.lines.append(json.loads(line))
            if len(self.lines) == 1:
                self.first.put(True)
        self.first.put(False)

    def ready(self, timeout: float) -> None:
        try:
            ok = self.first.get(timeout=timeout)
        except queue.Empty:
            ok = False
        if not ok:
            raise RuntimeError(f"{self.name} reported nothing (its stderr: {self._log.name})")

    def finish(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join()
        self._log.close()


class _Job:
    """The training side: the model, its two checkpoint managers, and each save's commit time per side."""

    def __init__(self, work: Path, rows: int, dim: int) -> None:
        import tensorflow as tf

        from psguard.trainer.manager import CheckpointManager
        from psguard.trainer.options import ManagerOptions

        self.rows, self.dim = rows, dim
        self.model = bench_model(rows, dim, trainer=True)
        root = tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer)
        self.tables = [self.model.layers[0].embeddings]
        self.tables += [v for v in self.model.optimizer.variables if tuple(v.shape) == (rows, dim)]  # Adam's slots
        self.tf_manager = tf.train.CheckpointManager(root, str(work / "tf"), max_to_keep=3)
        self.manager = CheckpointManager(root, str(work / "store"), options=ManagerOptions(new_base_after=0))
        self.commits: dict[str, dict[int, float]] = {"psguard": {}, "tf": {}}
        self.rng = np.random.default_rng(0)

    def train(self, changed: float) -> None:
        """What a step of training does to the checkpoint: ``changed`` of the rows, and their slot rows."""
        import tensorflow as tf

        ids = np.unique(self.rng.integers(0, self.rows, size=max(1, int(self.rows * changed))))
        for table in self.tables:
            table.scatter_add(tf.IndexedSlices(tf.fill((len(ids), self.dim), 0.01), tf.constant(ids)))

    def save(self, step: int) -> None:
        """Both saves, in turn first: a side's lag runs from its own commit while the other side saves."""
        self.model.optimizer.iterations.assign(step)
        for one in (self._save_psguard, self._save_tf) if step % 2 == 0 else (self._save_tf, self._save_psguard):
            one(step)

    def _save_psguard(self, step: int) -> None:
        from psguard.store import CheckpointInfo

        handle = self.manager.save(step)
        assert handle is not None, "no checkpoint_interval: every save happens"
        info = handle.result()
        assert isinstance(info, CheckpointInfo), "the store is the manager's sink"
        self.commits["psguard"][step] = info.committed_at

    def _save_tf(self, step: int) -> None:
        self.tf_manager.save(checkpoint_number=step)
        self.commits["tf"][step] = time.time()

    def close(self) -> None:
        self.manager.close()


def _start(procs: list[_Process], work: Path, rows: int, dim: int, last: int) -> None:
    """The evaluator processes and the publisher, each appended to ``procs`` as it starts."""
    me = [sys.executable, "-m", "psguard.benchmarks.follow_evaluators", "child"]
    size = [str(rows), str(dim), str(last)]
    publish = [sys.executable, "-m", "psguard.cli", "publish", "--poll", "1", "--keep", "3", "--json"]
    store, published = str(work / "store"), str(work / "published")
    procs.append(_Process("psguard", [*me, "psguard", store, *size], work / "psguard.log"))
    procs.append(_Process("publisher", [*publish, store, published], work / "publisher.log"))
    procs.append(_Process("publish", [*me, "tf", published, *size], work / "publish.log"))
    procs.append(_Process("tf", [*me, "tf", str(work / "tf"), *size], work / "tf.log"))


def run(rows: int, dim: int, saves: int, changed: float, interval: float) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    work = Path(tempfile.mkdtemp(prefix="psguard-bench-evaluators-"))
    procs: list[_Process] = []
    try:
        job = _Job(work, rows, dim)
        try:
            job.save(0)
            _start(procs, work, rows, dim, saves)
            for p in procs:
                p.ready(_READY_TIMEOUT)  # each evaluated step 0 (the publisher published it)
            progress("evaluators ready")
            for step in range(1, saves + 1):
                time.sleep(interval)  # the job trains between saves; the evaluators poll meanwhile
                job.train(changed)
                job.save(step)
                progress(f"saved step {step}/{saves}")
            for p in procs:
                if p.name != "publisher":
                    p.finish(timeout=120 + 10 * interval)  # each stops after evaluating the last step
        finally:
            job.close()
    finally:
        for p in procs:
            p.proc.kill()
            p.finish(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    figures: dict[str, Any] = {"rows": rows, "dim": dim, "model_bytes": rows * dim * 4, "saves": saves}
    figures["changed"] = changed
    return {**figures, **_figures({p.name: p.lines for p in procs}, job.commits)}


def _figures(reports: Mapping[str, list[dict[str, Any]]], commits: Mapping[str, Mapping[int, float]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for side in SIDES:
        evaluations = [(d["step"], d["began_at"], d["read"]) for d in reports[side]]
        figures[f"{side}_steps"] = [s for s, _, _ in evaluations]
        summary = summarize(Side(evaluations), commits["tf" if side == "tf" else "psguard"])
        figures.update({f"{side}_{k}": v for k, v in summary.items()})
    publications = reports["publisher"][1:]
    figures["publisher_bytes_read_per_publication"] = (
        median([float(d["bytes_read"]) for d in publications]) if publications else float("nan")
    )
    figures.update(ratios(figures))
    return figures


if __name__ == "__main__":  # an evaluator process of run()
    parser = argparse.ArgumentParser(prog="python -m psguard.benchmarks.follow_evaluators")
    parser.add_argument("what", choices=("child",))
    parser.add_argument("kind", choices=("psguard", "tf"))
    parser.add_argument("directory")
    for name in ("rows", "dim", "last"):
        parser.add_argument(name, type=int)
    args = parser.parse_args()
    child(args.kind, args.directory, args.rows, args.dim, args.last)
