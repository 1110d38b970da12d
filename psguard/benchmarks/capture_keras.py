"""``psguard bench capture --keras``: a save of ``psguard.keras.CheckpointCallback`` in tf_keras ``model.fit``
against TF's own save of the same state, in the same run.

The table is the custom-loop benchmark's (:mod:`psguard.benchmarks.capture`): ``rows`` x ``dim`` float32 sharded
over 2 PS by ``FixedShardsPartitioner(2)``, lookups (``features`` ids per example) on a fixed hot set of 1% of
the rows, or on all rows with ``--ids uniform``. It is trained by tf_keras ``model.fit`` under
``ParameterServerStrategy`` on a real local cluster (2 PS + 2 worker processes, this process the chief):
``Embedding -> GlobalAveragePooling1D -> Dense(1)``, ``compile(optimizer, steps_per_execution=10)`` with a
tf_keras optimizer, and ``psguard.keras.CheckpointCallback(save_freq=...)`` saving once a round to a
local folder (the trainer-side path: no agents, rows read to the chief).

What is timed. Under PS, ``fit`` schedules steps without waiting for them (it runs ahead of the workers), so a
save first waits for every step scheduled so far (the coordinator's drain, while the workers train), then
captures. tf_keras' warning "``on_train_batch_end`` is slow compared to the batch time" counts both, and it
averages the first five batch ends of a fit only: the first save with its drain of the first executions, not a
per-save figure. Here a callback placed before psguard's drains first and times that apart, then waits until the
previous save is durable (nothing written behind the timing); psguard's ``on_train_batch_end`` is then timed
alone, from a drained coordinator to the capture in host memory, as the custom-loop benchmark times ``save()``
after a ``join()``. TF's save (``tf.train.CheckpointManager(..., max_to_keep=1).save()`` of the same model and
optimizer) is taken in the same batch end, so of the same state (no step is scheduled during the hooks), before
psguard's save in odd rounds and after it in even ones. Keys:

- ``stall_ratio``: median over rounds of (the callback's ``on_train_batch_end`` / TF's save). Issue 23's target
  at 1.5 GB of state with Adam: <= 0.15.
- ``psguard_stall_seconds``, ``psguard_capture_seconds`` (its capture), ``tf_stall_seconds``;
  ``psguard_saves_hashing_all_rows``: rounds whose capture hashed every row (none expected with tf_keras Adam,
  Adagrad or SGD; Adam's dense moment decay marks only the rows its moments hold).
- ``drain_seconds``, ``drain_steps``: what a save waited for first (median; training, not a stall: those steps
  run anyway); ``batch_end_with_drain_seconds``: both together, what tf_keras' warning sees.
- ``first_save_seconds``: the stall of the callback's first save, left to drain the first executions itself as
  in a job (the manager traces the capture function meanwhile): from the end of that drain (a thread waits for
  it too) to the end of the hook, a full base captured by a function instantiated on the PS at that call;
  against ``tf_first_save_seconds``, TF's save of the same state. ``first_batch_end_seconds``: that hook with
  its drain (``first_save_drain_steps`` steps).

Progress goes to stderr; ``--json`` prints one object on stdout.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from psguard.benchmarks.capture import (
    ID_DISTRIBUTIONS,
    OPTIMIZERS,
    Config,
    MiB,
    files_bytes,
    hot_rows,
    spread,
    steps_per_round,
    tf_checkpoint_files,
)
from psguard.benchmarks.common import median, progress

#: Saves before the timed rounds: the first is a full base (and traces psguard's capture function), the second
#: the first delta; TF's first save also runs once before.
WARM_UP_SAVES = 2

KEYS = (
    "stall_ratio",
    "psguard_stall_seconds",
    "psguard_capture_seconds",
    "tf_stall_seconds",
    "psguard_saves_hashing_all_rows",
    "drain_seconds",
    "drain_steps",
    "batch_end_with_drain_seconds",
    "first_save_seconds",
    "first_batch_end_seconds",
    "tf_first_save_seconds",
    "psguard_changed_rows_per_save",
    "ps_to_chief_bytes_per_capture",
    "tf_bytes_per_save",
    "table_bytes",
    "checkpoint_logical_bytes",
    "steps_per_round",
    "seconds",
)


def round_steps(cfg: Config) -> int:
    """Steps between two saves: the custom-loop benchmark's round, rounded up to whole executions (a batch end
    comes once per ``steps_per_execution`` steps)."""
    spe = cfg.steps_per_execution
    return max(1, math.ceil(steps_per_round(cfg) / spe)) * spe


@dataclass
class _Rounds:
    """What the two measuring callbacks share: the timings of each save, in order."""

    every: int
    saves: list[dict[str, Any]] = field(default_factory=list)
    tf_first: float | None = None


def _measuring_callbacks(cfg: Config, model: Any, psguard: Any, tf_manager: Any, rounds: _Rounds) -> tuple[Any, Any]:
    """Two tf_keras callbacks to place around psguard's: ``before`` readies a due save (drains, waits for the
    previous save), ``after`` times psguard's hook, records its capture and takes TF's save when it is its turn
    (:class:`_SaveTimer`)."""
    import tf_keras

    timer = _SaveTimer(cfg, model, psguard, tf_manager, rounds)

    class Hook(tf_keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self, on_step: Callable[[int], None]) -> None:
            super().__init__()
            self._supports_tf_logs = True  # never reads the logs: must not make fit wait for them either
            self._on_step = on_step

        def _implements_train_batch_hooks(self) -> bool:
            return True

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._on_step(int(batch) + 1)  # one epoch: the batch index is the global step

    return Hook(timer.before), Hook(timer.after)


class _SaveTimer:
    """Times each save around psguard's callback (:func:`_measuring_callbacks`).

    The first save is left as a job meets it: psguard's hook drains the first executions itself (and traces its
    capture function meanwhile); a thread waits for the same drain, so that the part of the hook after it (the
    stall: the capture of a full base) is timed apart.
    """

    def __init__(self, cfg: Config, model: Any, psguard: Any, tf_manager: Any, rounds: _Rounds) -> None:
        self.cfg, self.model, self.psguard, self.tf_manager, self.rounds = cfg, model, psguard, tf_manager, rounds
        self.started = 0.0
        self.watcher: threading.Thread | None = None

    def tf_save(self, record: dict[str, Any]) -> float:
        os.sync()
        t0 = time.perf_counter()
        prefix = self.tf_manager.save()
        stall = time.perf_counter() - t0
        os.sync()  # its dirty pages must not weigh on psguard's timing either
        record["tf_bytes"] = files_bytes(tf_checkpoint_files(prefix))
        return stall

    def stamp_drained(self, record: dict[str, Any]) -> None:
        self.model._cluster_coordinator.join()
        record["drained_at"] = time.perf_counter()

    def before(self, step: int) -> None:
        """Before psguard's hook: a due save drained and the previous one durable, TF's save in its turn."""
        rounds, model, psguard = self.rounds, self.model, self.psguard
        if step % rounds.every:
            return
        done = int(model.optimizer.iterations.numpy())  # before the drain: the steps it waits for
        record: dict[str, Any] = {"step": step, "drain_steps": step - done, "previous": psguard.last_save}
        rounds.saves.append(record)
        index = len(rounds.saves) - 1
        if index == 0:
            self.watcher = threading.Thread(target=self.stamp_drained, args=(record,), name="bench-drain-watch")
            self.started = time.perf_counter()
            self.watcher.start()
            return
        t0 = time.perf_counter()
        model._cluster_coordinator.join()  # set by fit
        record["drain_s"] = time.perf_counter() - t0
        if psguard.last_save is not None:
            psguard.last_save.result()  # durable: nothing runs behind the timing, and the save is taken
        if index >= WARM_UP_SAVES and index % 2:
            record["tf_s"] = self.tf_save(record)
        os.sync()
        self.started = time.perf_counter()

    def after(self, step: int) -> None:
        """After psguard's hook: its time and capture recorded, TF's save in its turn."""
        rounds, psguard = self.rounds, self.psguard
        if step % rounds.every:
            return
        end = time.perf_counter()
        record = rounds.saves[-1]
        record["psguard_s"] = end - self.started
        if psguard.last_save is record.pop("previous"):
            raise RuntimeError(f"psguard's callback did not save at step {record['step']}: the round is void")
        stats = psguard.manager.capturer.last_stats
        record.update(
            capture_s=stats.capture_seconds,
            hashed_all_rows=bool(stats.hashed_all),
            changed_rows=_changed_rows(self.cfg, stats),
            ps_to_chief_bytes=stats.bytes_read,
            logical_bytes=stats.logical_bytes,
        )
        index = len(rounds.saves) - 1
        if index == 0:
            assert self.watcher is not None
            self.watcher.join()
            record["drain_s"] = record.pop("drained_at") - self.started
            record["stall_s"] = end - self.started - record["drain_s"]
            psguard.last_save.result()
            rounds.tf_first = self.tf_save(record)  # of the same state: nothing was scheduled since
        elif index >= WARM_UP_SAVES and not index % 2:
            psguard.last_save.result()  # its write must not run behind TF's save
            record["tf_s"] = self.tf_save(record)
        self.report(index, record)

    def report(self, index: int, record: dict[str, Any]) -> None:
        if index >= WARM_UP_SAVES:
            progress(
                f"round {index - WARM_UP_SAVES + 1}/{self.cfg.runs}: psguard {record['psguard_s']:.3f}s "
                f"({record['changed_rows']} rows changed), TF {record['tf_s']:.3f}s; drained "
                f"{record['drain_steps']} steps in {record['drain_s']:.2f}s first"
            )
        elif index == 0:
            progress(
                f"first save: on_train_batch_end {record['psguard_s']:.2f}s, of which draining "
                f"{record['drain_steps']} steps {record['drain_s']:.2f}s and the stall (a full base) "
                f"{record['stall_s']:.2f}s; TF's first save {self.rounds.tf_first:.2f}s"
            )
        else:
            progress(f"warm-up save {index + 1}: psguard {record['psguard_s']:.2f}s")


def _changed_rows(cfg: Config, stats: Any) -> int:
    """Rows of the embedding in a capture (all of them when it went whole)."""
    name = next((n for n in [*stats.full, *stats.rows] if "embeddings" in n), None)
    if name is None:
        return 0
    return cfg.rows if name in stats.full else int(stats.rows[name])


def dataset_fn(cfg: Config) -> Any:
    """The per-worker dataset of ``fit``: batches of ``features`` ids per example drawn afresh, uniformly over
    the hot set (spread evenly over the whole table) or over all rows, labelled as the testbed's model is."""
    import tensorflow as tf

    from psguard.testbed.model import labels_for

    hot = hot_rows(cfg) if cfg.ids == "hot" else cfg.rows
    stride = max(1, cfg.rows // hot)
    shape = [cfg.batch_size, cfg.features]

    def batch(draws: Any) -> Any:
        ids = tf.reshape(tf.math.floormod(draws, hot) * stride, shape)
        return ids, labels_for(ids)

    def make(context: Any) -> Any:
        draws = tf.data.Dataset.random(seed=int(context.input_pipeline_id)).batch(cfg.batch_size * cfg.features)
        return draws.map(batch).prefetch(2)

    return make


def run(cfg: Config, *, strategy: Any = None, workdir: Path | None = None) -> dict[str, Any]:
    """The whole benchmark. Without ``strategy`` it starts (and always stops) its own cluster; a caller that is
    already a chief (a test) passes its strategy (tf_keras finds its ``ClusterCoordinator``)."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {cfg.optimizer!r} is not one of {OPTIMIZERS}")
    if cfg.ids not in ID_DISTRIBUTIONS:
        raise ValueError(f"ids {cfg.ids!r} is not one of {ID_DISTRIBUTIONS}")
    if cfg.steps_per_execution < 1:
        raise ValueError("steps_per_execution must be positive")
    tmp = Path(tempfile.mkdtemp(prefix="psguard-bench-capture-keras-", dir=workdir))
    started = time.perf_counter()
    try:
        if strategy is not None:
            return _run(cfg, strategy, tmp, started)
        import tensorflow as tf

        from psguard.testbed.cluster import LocalCluster

        progress(f"starting a cluster of {cfg.num_ps} PS + {cfg.num_workers} workers")
        with LocalCluster(num_ps=cfg.num_ps, num_workers=cfg.num_workers) as cluster:
            strategy = tf.distribute.experimental.ParameterServerStrategy(
                cluster.cluster_resolver(),
                variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(cfg.num_ps),
            )
            return _run(cfg, strategy, tmp, started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(cfg: Config, strategy: Any, tmp: Path, started: float) -> dict[str, Any]:
    import tensorflow as tf
    import tf_keras

    from psguard.testbed.model import make_optimizer
    from psguard.trainer.keras import CheckpointCallback
    from psguard.trainer.options import CallbackOptions

    every = round_steps(cfg)
    total = every * (WARM_UP_SAVES + cfg.runs)
    table_bytes = cfg.rows * cfg.dim * 4
    where = f"a fixed hot set of {hot_rows(cfg):,} rows" if cfg.ids == "hot" else "all rows"
    progress(
        f"model.fit: {cfg.rows:,} x {cfg.dim} embedding ({table_bytes / MiB:.0f} MiB) on {cfg.num_ps} PS, "
        f"tf_keras {cfg.optimizer}, steps_per_execution {cfg.steps_per_execution}; lookups over {where}; "
        f"a save every {every} steps, {total} steps"
    )
    with strategy.scope():
        model = tf_keras.Sequential(
            [
                tf_keras.Input((cfg.features,), dtype="int64"),
                tf_keras.layers.Embedding(cfg.rows, cfg.dim),
                tf_keras.layers.GlobalAveragePooling1D(),
                tf_keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=make_optimizer(cfg.optimizer, "tf_keras"),
            loss=tf_keras.losses.BinaryCrossentropy(from_logits=True),
            steps_per_execution=cfg.steps_per_execution,
        )
    psguard = CheckpointCallback(str(tmp / "psguard"), save_freq=every, options=CallbackOptions(save_at_end=False))
    tf_manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=model.optimizer), str(tmp / "tf"), max_to_keep=1
    )
    rounds = _Rounds(every)
    before, after = _measuring_callbacks(cfg, model, psguard, tf_manager, rounds)
    data = tf_keras.utils.experimental.DatasetCreator(dataset_fn(cfg))
    try:
        model.fit(data, epochs=1, steps_per_epoch=total, callbacks=[before, psguard, after], verbose=0)
    finally:
        psguard.close()  # on_train_end does it, but not when fit raised
    return _results(cfg, rounds, table_bytes, every, started)


def _results(cfg: Config, rounds: _Rounds, table_bytes: int, every: int, started: float) -> dict[str, Any]:
    timed = rounds.saves[WARM_UP_SAVES:]
    if len(timed) != cfg.runs or rounds.tf_first is None:
        raise RuntimeError(f"{len(timed)} of {cfg.runs} rounds were measured")
    ours = [float(r["psguard_s"]) for r in timed]
    theirs = [float(r["tf_s"]) for r in timed]
    ratios = [p / t for p, t in zip(ours, theirs, strict=True)]
    with_drain = [float(r["psguard_s"]) + float(r["drain_s"]) for r in timed]
    first = rounds.saves[0]
    progress(
        f"stall ratio {median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}]; first save's stall "
        f"{first['stall_s']:.2f}s (TF's first save {rounds.tf_first:.2f}s)"
    )

    def med(key: str) -> float:
        return median([float(r[key]) for r in timed])

    return {
        "stall_ratio": median(ratios),
        "psguard_stall_seconds": median(ours),
        "psguard_capture_seconds": med("capture_s"),
        "tf_stall_seconds": median(theirs),
        "psguard_saves_hashing_all_rows": sum(bool(r["hashed_all_rows"]) for r in timed),
        "drain_seconds": med("drain_s"),
        "drain_steps": int(med("drain_steps")),
        "batch_end_with_drain_seconds": median(with_drain),
        "first_save_seconds": float(first["stall_s"]),
        "first_batch_end_seconds": float(first["psguard_s"]),
        "first_save_drain_seconds": float(first["drain_s"]),
        "first_save_drain_steps": int(first["drain_steps"]),
        "tf_first_save_seconds": rounds.tf_first,
        "psguard_changed_rows_per_save": int(med("changed_rows")),
        "ps_to_chief_bytes_per_capture": int(med("ps_to_chief_bytes")),
        "tf_bytes_per_save": int(med("tf_bytes")),
        "table_bytes": table_bytes,
        "checkpoint_logical_bytes": int(first["logical_bytes"]),
        "steps_per_round": every,
        "optimizer": f"tf_keras {cfg.optimizer}",
        "ids": cfg.ids,
        "path": "model.fit with psguard.keras.CheckpointCallback (trainer-side capture)",
        "spread": {
            "stall_ratio": spread(ratios),
            "psguard_stall_seconds": spread(ours),
            "tf_stall_seconds": spread(theirs),
            "batch_end_with_drain_seconds": spread(with_drain),
        },
        "rounds": rounds.saves,
        "config": asdict(cfg),
        "seconds": time.perf_counter() - started,
    }
