"""``psguard bench capture``: a psguard save against ``tf.train.CheckpointManager.save``, same job, same run.

The job: the testbed's :class:`~psguard.testbed.model.RecModel` (a ``rows`` x ``dim`` float32 embedding sharded
over 2 PS by ``FixedShardsPartitioner(2)``, two dense layers, a step counter) trained by
:class:`~psguard.testbed.model.Trainer` with tf_keras **Adagrad** on a real local cluster (2 PS + 2 worker
processes, this process the chief). Adagrad's accumulator is a second table of the same size whose rows change
only where the gradients are, like the embedding's: every checkpoint holds two ``rows`` x ``dim`` tables and a
delta the changed rows of both. (``--optimizer sgd``: no slots, one table.) Lookups (batch 256, 2 ids per
example) fall uniformly on a fixed hot set of 1% of the rows spread over the whole table, so about 1% of the
rows change between two saves however far apart they are, as the targets assume; ``--ids uniform`` spreads them
over all rows instead (at ~120 steps/s here a save every 10 s then finds ~25% of the rows changed).

Both managers save the same ``tf.train.Checkpoint(model=..., optimizer=...)`` to local folders. The stall of a
save is the wall time of the ``save()`` call after a ``coordinator.join()`` that both sides get alike: for
psguard the capture until ``save()`` returns (the write goes on in the background), for TF the whole save,
which is synchronous (``max_to_keep=1``, so it also deletes the previous one, as a job keeping a few would).
Keys:

- ``stall_ratio``: median over rounds of (psguard stall / TF stall), steady-state saves: each round trains
  until ~1% of the rows changed since the previous round, then saves with both (order alternating), both of
  the same state. Target <= 0.1.
- ``stall_ratio_amortized``: the same with the one save in ``verify_every`` (16) that hashes every row weighed
  in: psguard finds changed rows from the rows the training steps marked as written, and every 16th capture
  hashes all rows as a safety net; that save's stall (``psguard_verify_stall_seconds``) is measured once after
  a round. ``psguard_saves_hashing_all_rows``: how many steady-state saves hashed every row (expected 0).
- ``bytes_ratio``: median of (stored bytes of psguard's delta / bytes of the files TF wrote) in those rounds.
  Target <= 0.05.
- ``overhead_pct``: training throughput (steps/s read from the model's step variable) lost with a psguard
  save every ``--save-interval`` seconds (10) against no saves: ``--overhead-seconds`` per side in 10 s
  segments alternating no saves / saves (ABBA...). Target <= 3.
- ``ps_to_chief_bytes_per_capture`` (against ``table_bytes``: one embedding table), and psguard's stall
  with 1%, 10% and 100% of the embedding's rows changed (by a scatter on the PS, no training).
- ``ps_side_stall_seconds_at_{1,10,100}pct`` and ``ps_side_stall_ratio_at_100pct`` (over ``tf_stall_seconds``):
  the same captures with the PS-side path of issue 12 (each shard's rows written to files on its own PS node,
  what runs when PS agents keep the shards): the stall no longer grows with the bytes crossing to the chief.

``--keras`` runs another job instead: the same table trained by tf_keras ``model.fit`` and saved by
``psguard.keras.CheckpointCallback``, timed against TF's save of the same state
(:mod:`psguard.benchmarks.capture_keras`).

Progress goes to stderr; ``--json`` prints one object on stdout (``spread`` holds min/median/max across runs).
Results are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from psguard.benchmarks.common import alternate, median, print_results, progress
from psguard.store import CheckpointInfo
from psguard.trainer.sinks import NEW_BASE_AFTER

MiB = 1 << 20
#: adagrad/sgd: slots (if any) change only in the rows of the gradients; adam: its moments decay in every
#: row that was ever touched, at every step (with the hot set: all of its rows at every save; with ``--ids
#: uniform``: eventually every row), and its dense writes make every capture hash every row.
OPTIMIZERS = ("adagrad", "sgd", "adam")
ID_DISTRIBUTIONS = ("hot", "uniform")
#: A steady-state round trains until this share of the hot set was looked up (so ~all of it changed).
HOT_COVERAGE = 0.99
#: Adam's rounds: its moments change in every row ever touched at every step, so more steps add little to what
#: a save holds; they cost time (each step rewrites both moments whole: 1.3 steps/s at 2,000,000 rows here).
ADAM_STEPS_PER_ROUND = 10
EMBEDDING = "model/embedding/.ATTRIBUTES/VARIABLE_VALUE"


@dataclass(frozen=True)
class Config:
    rows: int = 2_000_000
    dim: int = 32
    runs: int = 7  # steady-state rounds (one save per side each)
    overhead_seconds: float = 60.0  # training time per side for overhead_pct
    save_interval: float = 10.0
    segment_seconds: float = 10.0  # overhead sides alternate in segments of this length (noise drifts slowly)
    changed_fraction: float = 0.01
    ids: str = "hot"  # "hot": lookups fall on a fixed set of changed_fraction * rows rows; "uniform": all rows
    sweep: tuple[float, ...] = (0.01, 0.1, 1.0)
    sweep_runs: int = 3
    optimizer: str = "adagrad"
    batch_size: int = 256
    features: int = 2
    hidden: int = 64
    in_flight: int = 32  # steps kept scheduled ahead of the workers while measuring throughput
    num_ps: int = 2
    num_workers: int = 2
    steps_per_execution: int = 10  # ``--keras``: steps per ``model.fit`` execution (one batch end each)


# --------------------------------------------------------------------------------------------- pure helpers


def steps_for_fraction(rows: int, ids_per_step: int, fraction: float) -> int:
    """Steps of uniformly drawn ids after which about ``fraction`` of ``rows`` were drawn at least once."""
    if not 0 < fraction < 1:
        raise ValueError("fraction must be in (0, 1)")
    draws = -rows * math.log1p(-fraction)  # E[distinct] = rows * (1 - exp(-draws / rows))
    return max(1, math.ceil(draws / ids_per_step))


def hot_rows(cfg: Config) -> int:
    return max(1, round(cfg.rows * cfg.changed_fraction))


def steps_per_round(cfg: Config) -> int:
    """Training steps between two steady-state saves, for about ``changed_fraction`` of the rows changed
    (with Adam: all the rows of its moments whatever the steps, see :data:`ADAM_STEPS_PER_ROUND`)."""
    ids_per_step = cfg.batch_size * cfg.features
    if cfg.optimizer == "adam":
        return ADAM_STEPS_PER_ROUND
    if cfg.ids == "hot":
        return steps_for_fraction(hot_rows(cfg), ids_per_step, HOT_COVERAGE)
    return steps_for_fraction(cfg.rows, ids_per_step, cfg.changed_fraction)


def spread(xs: Sequence[float]) -> dict[str, float]:
    return {"min": min(xs), "median": median(list(xs)), "max": max(xs)}


def files_bytes(paths: Sequence[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def tf_checkpoint_files(prefix: str) -> list[Path]:
    """The files one ``tf.train.CheckpointManager.save`` wrote: data shards, index, and the state file."""
    p = Path(prefix)
    return [*sorted(p.parent.glob(p.name + ".*")), p.parent / "checkpoint"]


# --------------------------------------------------------------------------------------------- cluster parts


def touch_rows_fn(table: Any) -> Callable[[float, int], None]:
    """A function that changes ``fraction`` of the rows of every shard of ``table``, on the PS itself.

    Distinct rows (a stateless shuffle), nothing sent to or from the chief: it changes rows at an exact rate
    without training, for the stall-versus-changed-rows sweep. It flips the lowest mantissa bit of every
    element of those rows: every row's bytes change, its values by one ulp, so the model trains on unharmed
    (adding 1 to every row, as a first version did, killed most ReLUs and with them most gradients).
    """
    import tensorflow as tf
    from tensorflow.python.distribute import ps_values

    shards = [v.get() if isinstance(v, ps_values.CachingVariable) else v for v in table.variables]

    def touch(fraction: Any, seed: Any) -> Any:
        for i, shard in enumerate(shards):
            with tf.device(shard.device):
                n = tf.shape(shard, out_type=tf.int64)[0]
                k = tf.cast(tf.math.round(tf.cast(n, tf.float64) * fraction), tf.int32)
                perm = tf.random.experimental.stateless_shuffle(tf.range(n), seed=tf.stack([seed, i]))
                ids = perm[:k]
                bits = tf.bitwise.bitwise_xor(tf.bitcast(shard.sparse_read(ids), tf.int32), tf.constant(1, tf.int32))
                shard.scatter_update(tf.IndexedSlices(tf.bitcast(bits, shard.dtype), ids))
        return tf.constant(True)

    fn = tf.function(touch, autograph=False)

    def call(fraction: float, seed: int) -> None:
        fn(tf.constant(fraction, tf.float64), tf.constant(seed, tf.int64))

    return call


def hot_set_model(model: Any, hot: int) -> Any:
    """``model`` seen through lookups folded onto ``hot`` rows spread evenly over its table (every shard).

    A recommendation job's lookups concentrate on a working set; this one is fixed and of ``hot`` rows, so
    the rows that change between two saves are that set, whatever the time between them. The wrapper has
    what :class:`~psguard.testbed.model.Trainer` uses (``config``, ``step``, the variables, ``__call__``); the
    checkpoint keeps tracking the model itself, so its keys are the model's.
    """
    import tensorflow as tf

    class HotSet(tf.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(name="hot_set")
            self.model = model
            self.config = model.config
            self.step = model.step
            self.hot = hot
            self.stride = max(1, int(model.config.vocab_size) // hot)

        def __call__(self, ids: Any) -> Any:
            return self.model((ids % self.hot) * self.stride)

    return HotSet()


class _Job:
    """The model, its trainer, and both checkpoint managers on one cluster, in one TF context."""

    def __init__(self, cfg: Config, strategy: Any, coordinator: Any, workdir: Path) -> None:
        import tensorflow as tf

        from psguard.testbed.model import ModelConfig, RecModel, Trainer, make_optimizer
        from psguard.trainer.manager import CheckpointManager
        from psguard.trainer.options import ManagerOptions

        self.cfg = cfg
        self.coordinator = coordinator
        model_cfg = ModelConfig(
            vocab_size=cfg.rows,
            embedding_dim=cfg.dim,
            hidden=cfg.hidden,
            features=cfg.features,
            batch_size=cfg.batch_size,
        )
        with strategy.scope():
            self.model = RecModel(model_cfg)
            self.optimizer = make_optimizer(cfg.optimizer, "tf_keras")
        trained = hot_set_model(self.model, hot_rows(cfg)) if cfg.ids == "hot" else self.model
        self.trainer = Trainer(strategy, coordinator, trained, self.optimizer)
        self.root = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer)
        self.psguard = CheckpointManager(
            self.root,
            workdir / "psguard",
            options=ManagerOptions(coordinator=coordinator),
            step_counter=self.model.step,
        )
        # max_to_keep=1: TF deletes the previous checkpoint inside save(), as a job keeping a few would.
        self.tf = tf.train.CheckpointManager(self.root, str(workdir / "tf"), max_to_keep=1)
        self.touch = touch_rows_fn(self.model.embedding)
        self._seed = 0
        self.spill_root = workdir / "ps-side"
        self._ps_side: Any = None

    def ps_side_capturer(self) -> Any:
        """The PS-side capture (issue 12): the same capture with every shard's rows written to files on its
        own PS node (here: folders on this host, as the PS agents' part folders would be). Made only after
        the psguard manager's last capture: two capturers of one model take over each other's write tracking."""
        if self._ps_side is None:
            from psguard.trainer.capture import Capturer

            dirs = {}
            for i in range(self.cfg.num_ps):
                folder = self.spill_root / f"ps-{i}"
                folder.mkdir(parents=True, mode=0o700)
                dirs[f"ps:{i}"] = str(folder)
            self._ps_side = Capturer(self.root, coordinator=self.coordinator, spill_dirs=dirs)
        return self._ps_side

    def step(self) -> int:
        return int(self.model.step.numpy())

    def train(self, steps: int) -> None:
        self.trainer.train(steps)  # joins: nothing in flight when a timed save starts

    def touch_rows(self, fraction: float) -> None:
        self._seed += 1
        self.touch(fraction, self._seed)

    def quiesce(self) -> None:
        """Drain the steps in flight and flush dirty pages, so that no earlier write (TF's previous checkpoint
        still being written back by the kernel) weighs on the next timed save, of either side."""
        self.coordinator.join()
        os.sync()

    def psguard_save(self) -> dict[str, Any]:
        """One timed psguard save, then wait until it is durable (so nothing runs behind the next timing)."""
        self.quiesce()
        t0 = time.perf_counter()
        handle = self.psguard.save()
        t1 = time.perf_counter()
        assert handle is not None, "no checkpoint_interval: every save happens"
        info = handle.result()
        t2 = time.perf_counter()
        assert isinstance(info, CheckpointInfo), "the benchmark writes to the store itself"
        stats = self.psguard.capturer.last_stats
        return {
            "stall_s": t1 - t0,
            "persist_s": t2 - t1,
            "capture_s": stats.capture_seconds,
            "bytes": info.stored_bytes,
            "kind": info.kind,
            "ps_to_chief_bytes": stats.bytes_read,
            "logical_bytes": stats.logical_bytes,
            "changed_rows": self.changed_rows(stats),
            "hashed_all_rows": bool(stats.hashed_all),
        }

    def ps_side_capture(self) -> dict[str, Any]:
        """One timed PS-side capture (the stall: until the files are on every PS node); the files are then
        removed, as the PS agents do once applied."""
        capturer = self.ps_side_capturer()
        self.quiesce()
        t0 = time.perf_counter()
        capturer.capture()
        stall = time.perf_counter() - t0
        stats = capturer.last_stats
        for part in capturer.last_parts:
            shutil.rmtree(self.spill_root / part.task.replace(":", "-") / "incoming", ignore_errors=True)
        return {"stall_s": stall, "ps_to_chief_bytes": stats.bytes_read, "rows_spilled": stats.rows_spilled}

    def changed_rows(self, stats: Any) -> int:
        """Rows of the embedding in the last capture (all of them when it went whole)."""
        if EMBEDDING in stats.full:
            return self.cfg.rows
        return int(stats.rows.get(EMBEDDING, 0))

    def tf_save(self) -> dict[str, Any]:
        self.quiesce()
        t0 = time.perf_counter()
        prefix = self.tf.save()
        stall = time.perf_counter() - t0
        return {"stall_s": stall, "bytes": files_bytes(tf_checkpoint_files(prefix))}

    def close(self) -> None:
        self.psguard.close()


# --------------------------------------------------------------------------------------------- phases


def warm_up(job: _Job, steps_per_round: int) -> dict[str, Any]:
    """Trace the step, both savers and psguard's delta path; the first psguard save is a full base."""
    t0 = time.perf_counter()
    job.train(steps_per_round)
    base = job.psguard_save()
    job.tf_save()
    job.train(steps_per_round)
    job.psguard_save()
    job.tf_save()
    progress(
        f"warm-up {time.perf_counter() - t0:.1f}s: psguard base {base['bytes'] / MiB:.0f} MiB stored, "
        f"captured in {base['stall_s']:.2f}s"
    )
    return {"psguard_base_bytes": base["bytes"], "checkpoint_logical_bytes": base["logical_bytes"]}


def steady_state(job: _Job, steps_per_round: int) -> dict[str, Any]:
    """``runs`` rounds: train ~1% of rows, then one save per side (order alternating), both of the same state."""
    cfg = job.cfg
    trained: set[int] = set()
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []

    def ensure_trained(i: int) -> None:
        if i not in trained:
            job.train(steps_per_round)
            trained.add(i)

    def report(i: int) -> None:
        if len(ours) == len(theirs) == i + 1:
            p, t = ours[-1], theirs[-1]
            progress(
                f"round {i + 1}/{cfg.runs}: psguard {p['stall_s']:.3f}s, {p['bytes'] / MiB:.1f} MiB "
                f"({p['changed_rows']} rows changed); TF {t['stall_s']:.3f}s, {t['bytes'] / MiB:.0f} MiB"
            )

    def a(i: int) -> float:
        ensure_trained(i)
        ours.append(job.psguard_save())
        report(i)
        return float(ours[-1]["stall_s"])

    def b(i: int) -> float:
        ensure_trained(i)
        theirs.append(job.tf_save())
        report(i)
        return float(theirs[-1]["stall_s"])

    ps_stalls, tf_stalls = alternate(cfg.runs, a, b)
    stall_ratios = [p / t for p, t in zip(ps_stalls, tf_stalls, strict=True)]
    # One save in every `verify_every` hashes every row (the safety net of write tracking): measure one such
    # save after the same training, and weigh it in.
    capturer = job.psguard.capturer
    job.train(steps_per_round)
    capturer.verify_next()
    verify = job.psguard_save()
    every = capturer.verify_every if capturer.tracks_writes else 1
    amortized = ((every - 1) * median(ps_stalls) + float(verify["stall_s"])) / every
    progress(
        f"a save that hashes every row: {verify['stall_s']:.3f}s; amortized over {every} saves "
        f"{amortized:.3f}s, ratio {amortized / median(tf_stalls):.3f}"
    )
    bytes_ratios = [p["bytes"] / t["bytes"] for p, t in zip(ours, theirs, strict=True)]
    changed = [int(p["changed_rows"]) for p in ours]
    progress(
        f"steady state: stall ratio {median(stall_ratios):.3f} [{min(stall_ratios):.3f}..{max(stall_ratios):.3f}], "
        f"bytes ratio {median(bytes_ratios):.4f}"
    )
    return {
        "stall_ratio": median(stall_ratios),
        "bytes_ratio": median(bytes_ratios),
        "psguard_stall_seconds": median(ps_stalls),
        "tf_stall_seconds": median(tf_stalls),
        "psguard_saves_hashing_all_rows": sum(bool(p["hashed_all_rows"]) for p in ours),
        "psguard_verify_stall_seconds": float(verify["stall_s"]),
        "stall_ratio_amortized": amortized / median(tf_stalls),
        "psguard_capture_seconds": median([float(p["capture_s"]) for p in ours]),
        "psguard_persist_seconds": median([float(p["persist_s"]) for p in ours]),
        "psguard_bytes_per_save": int(median([float(p["bytes"]) for p in ours])),
        "tf_bytes_per_save": int(median([float(t["bytes"]) for t in theirs])),
        "ps_to_chief_bytes_per_capture": int(median([float(p["ps_to_chief_bytes"]) for p in ours])),
        "changed_rows_per_save": int(median([float(c) for c in changed])),
        "changed_fraction_per_save": median([float(c) for c in changed]) / cfg.rows,
        "steps_per_save": steps_per_round,
        "spread": {
            "stall_ratio": spread(stall_ratios),
            "bytes_ratio": spread(bytes_ratios),
            "psguard_stall_seconds": spread(ps_stalls),
            "tf_stall_seconds": spread(tf_stalls),
        },
        "runs": {"psguard": ours, "tf": theirs},
    }


def sweep(job: _Job) -> dict[str, Any]:
    """psguard's stall when a given fraction of the embedding's rows changed (scattered on the PS)."""
    out: dict[str, Any] = {}
    for fraction in job.cfg.sweep:
        runs = []
        for _ in range(job.cfg.sweep_runs):
            job.touch_rows(fraction)
            runs.append(job.psguard_save())
        stalls = [float(r["stall_s"]) for r in runs]
        key = f"stall_seconds_at_{fraction * 100:g}pct"
        out[key] = median(stalls)
        out.setdefault("spread", {})[key] = spread(stalls)
        out.setdefault("sweep", {})[f"{fraction * 100:g}pct"] = {
            "stall_s": spread(stalls),
            "capture_s": median([float(r["capture_s"]) for r in runs]),
            "ps_to_chief_bytes": int(median([float(r["ps_to_chief_bytes"]) for r in runs])),
            "stored_bytes": int(median([float(r["bytes"]) for r in runs])),
            "changed_rows": int(runs[-1]["changed_rows"]),
        }
        progress(
            f"{fraction:.0%} rows changed: psguard stall {median(stalls):.3f}s "
            f"[{min(stalls):.3f}..{max(stalls):.3f}], read {runs[-1]['ps_to_chief_bytes'] / MiB:.1f} MiB from the PS"
        )
    return out


def ps_side_sweep(job: _Job) -> dict[str, Any]:
    """The sweep's stalls again with the PS-side capture (after the psguard manager's last capture)."""
    out: dict[str, Any] = {}
    job.ps_side_capture()  # its first capture is whole; from here on each sees the rows touched before it
    for fraction in job.cfg.sweep:
        runs = []
        for _ in range(job.cfg.sweep_runs):
            job.touch_rows(fraction)
            runs.append(job.ps_side_capture())
        stalls = [float(r["stall_s"]) for r in runs]
        key = f"ps_side_stall_seconds_at_{fraction * 100:g}pct"
        out[key] = median(stalls)
        out[f"ps_side_to_chief_bytes_at_{fraction * 100:g}pct"] = int(median([r["ps_to_chief_bytes"] for r in runs]))
        out.setdefault("spread", {})[key] = spread(stalls)
        progress(f"{fraction:.0%} rows changed, PS-side capture: stall {median(stalls):.3f}s")
    return out


def compaction(job: _Job) -> dict[str, Any]:
    """How long folding the current delta chain into a new base takes (background work, every 16 deltas)."""
    job.psguard.wait()
    store = job.psguard.store
    newest = [c for c in store.checkpoints() if c.kind == "delta"][-1]
    t0 = time.perf_counter()
    store.compact(newest.id)
    seconds = time.perf_counter() - t0
    chain = newest.chain_length
    every = (job.psguard.new_base_after or NEW_BASE_AFTER) * job.cfg.save_interval
    progress(f"compaction of a chain of {chain} deltas into a new base: {seconds:.1f}s (background, every {every:g}s)")
    return {
        "psguard_compaction_seconds": seconds,
        "psguard_compacted_chain": chain,
        # the share of the time the chief's writer thread spends compacting, at one save per interval
        "compaction_busy_pct": seconds / every * 100 if every else 0.0,
    }


class _Throughput:
    """Training at full speed for a while, optionally with a psguard save every ``save_interval`` seconds.

    Steps are scheduled ``in_flight`` ahead of what the step variable says is done, so the workers never
    starve and a save's drain waits for at most that many steps (as a job scheduling in chunks would).
    The manager's compaction (a new base every 16 deltas) is off here: one would land in one segment of a
    few and weigh several times its share; :func:`compaction` measures it apart.
    """

    POLL_S = 0.02

    def __init__(self, job: _Job, seconds: float) -> None:
        self.job = job
        self.seconds = seconds
        self.saves: list[dict[str, float]] = []

    def _top_up(self, offset: int) -> None:
        pending = self.job.trainer.next_index - (self.job.step() - offset)
        if pending < self.job.cfg.in_flight:
            self.job.trainer.train(self.job.cfg.in_flight - pending, join=False)

    def segment(self, with_saves: bool) -> float:
        """Steps/s over one segment. With saves: one every interval, each covering one interval of training.

        Before the clock starts, a save catches up with what earlier segments changed and is waited for; the
        clock stops when the last save is durable (training goes on meanwhile), so every save's stall and
        its background write fall inside the segment.
        """
        job, cfg = self.job, self.job.cfg
        if with_saves:
            job.psguard.save()
            job.psguard.wait()
        job.coordinator.join()
        s0, t0 = job.step(), time.perf_counter()
        offset = s0 - job.trainer.next_index
        due = [t0 + k * cfg.save_interval for k in range(1, int(self.seconds / cfg.save_interval) + 1)]
        due = due if with_saves else []
        last: Any = None
        while True:
            now = time.perf_counter()
            if due and now >= due[0]:
                due.pop(0)
                # save() would drain too, but part of that wait would show up in its other steps; draining
                # first keeps the workers' last busy moments (the drain) apart from their idle ones (save()).
                job.coordinator.join()
                drained = time.perf_counter()
                last = job.psguard.save()
                call = time.perf_counter() - drained
                stats = job.psguard.capturer.last_stats
                self.saves.append(
                    {
                        "call_s": call,
                        "drain_s": drained - now,
                        "capture_s": stats.capture_seconds,
                        "changed_rows": job.changed_rows(stats),
                        "ps_to_chief_bytes": stats.bytes_read,
                    }
                )
                continue
            if now >= t0 + self.seconds and not due and (last is None or last.done()):
                break
            self._top_up(offset)
            time.sleep(self.POLL_S)
        job.coordinator.join()
        t1, s1 = time.perf_counter(), job.step()
        if last is not None:
            last.result()
        rate = (s1 - s0) / (t1 - t0)
        progress(f"throughput {'with saves' if with_saves else 'no saves  '}: {rate:.1f} steps/s over {t1 - t0:.1f}s")
        return rate

    def run(self) -> dict[str, Any]:
        cfg, manager = self.job.cfg, self.job.psguard
        segments = max(1, round(cfg.overhead_seconds / cfg.segment_seconds))
        self.seconds = cfg.overhead_seconds / segments
        new_base_after, manager.new_base_after = manager.new_base_after, 0
        try:
            none, saves = alternate(segments, lambda _: self.segment(False), lambda _: self.segment(True))
        finally:
            manager.new_base_after = new_base_after
        # Pairs are neighbours in time (ABBA...), so their ratio cancels the slow drift of the machine's load.
        per_pair = [(1 - s / n) * 100 for n, s in zip(none, saves, strict=True)]
        overhead = median(per_pair)
        pairs = ", ".join(f"{x:.1f}" for x in per_pair)
        progress(f"overhead of a save every {cfg.save_interval:g}s: {overhead:.2f}% (median of pairs: {pairs})")

        def med(key: str) -> float:
            return median([d[key] for d in self.saves]) if self.saves else 0.0

        # While save() runs (after the drain) no step can run: the part of the overhead that is not noise.
        idle = med("call_s")
        return {
            "overhead_pct": overhead,
            "overhead_idle_pct": idle / cfg.save_interval * 100,
            "steps_per_s_no_saves": median(none),
            "steps_per_s_with_saves": median(saves),
            "overhead_save_call_seconds": med("call_s"),  # after the drain: no step runs meanwhile
            "overhead_save_drain_seconds": med("drain_s"),
            "overhead_save_capture_seconds": med("capture_s"),
            "overhead_saves": len(self.saves),
            "overhead_changed_rows_per_save": int(med("changed_rows")),
            "overhead_saves_detail": self.saves,
            "spread": {
                "overhead_pct_per_pair": spread(per_pair),
                "steps_per_s_no_saves": spread(none),
                "steps_per_s_with_saves": spread(saves),
            },
        }


# --------------------------------------------------------------------------------------------- driver


def run(cfg: Config, *, strategy: Any = None, coordinator: Any = None, workdir: Path | None = None) -> dict[str, Any]:
    """The whole benchmark. Without ``strategy``/``coordinator`` it starts (and always stops) its own cluster.

    A process can be the chief of one cluster only, so a caller that already is one (a test) passes its own.
    """
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {cfg.optimizer!r} is not one of {OPTIMIZERS}")
    if cfg.ids not in ID_DISTRIBUTIONS:
        raise ValueError(f"ids {cfg.ids!r} is not one of {ID_DISTRIBUTIONS}")
    tmp = Path(tempfile.mkdtemp(prefix="psguard-bench-capture-", dir=workdir))
    started = time.perf_counter()
    try:
        if strategy is not None and coordinator is not None:
            return _run(cfg, strategy, coordinator, tmp, started)
        import tensorflow as tf

        from psguard.testbed.cluster import LocalCluster

        progress(f"starting a cluster of {cfg.num_ps} PS + {cfg.num_workers} workers")
        with LocalCluster(num_ps=cfg.num_ps, num_workers=cfg.num_workers) as cluster:
            strategy = tf.distribute.experimental.ParameterServerStrategy(
                cluster.cluster_resolver(),
                variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(cfg.num_ps),
            )
            coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
            return _run(cfg, strategy, coordinator, tmp, started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(cfg: Config, strategy: Any, coordinator: Any, tmp: Path, started: float) -> dict[str, Any]:
    table_bytes = cfg.rows * cfg.dim * 4
    ids_per_step = cfg.batch_size * cfg.features
    steps = steps_per_round(cfg)
    where = f"a fixed hot set of {hot_rows(cfg):,} rows" if cfg.ids == "hot" else "all rows"
    progress(
        f"model: {cfg.rows:,} x {cfg.dim} embedding ({table_bytes / MiB:.0f} MiB) on {cfg.num_ps} PS, {cfg.optimizer}; "
        f"lookups uniform over {where}; {steps} steps of {ids_per_step} ids between steady-state saves"
    )
    job = _Job(cfg, strategy, coordinator, tmp)
    try:
        results: dict[str, Any] = {
            "table_bytes": table_bytes,
            "optimizer": f"tf_keras {cfg.optimizer}",
            "ids": cfg.ids,
        }
        results.update(warm_up(job, steps))
        parts = [
            steady_state(job, steps),
            _Throughput(job, cfg.overhead_seconds).run(),
            sweep(job),
            compaction(job),
            ps_side_sweep(job),
        ]
        spreads: dict[str, Any] = {}
        for part in parts:
            spreads.update(part.pop("spread", {}))
            results.update(part)
        results["ps_to_chief_vs_table"] = results["ps_to_chief_bytes_per_capture"] / table_bytes
        if "ps_side_stall_seconds_at_100pct" in results:
            # Every row changed (Adam, a new base): the PS-side capture against TF's own save of the same state.
            results["ps_side_stall_ratio_at_100pct"] = (
                results["ps_side_stall_seconds_at_100pct"] / results["tf_stall_seconds"]
            )
        results["spread"] = spreads
        results["config"] = asdict(cfg)
        results["seconds"] = time.perf_counter() - started
        return results
    finally:
        job.close()


KEYS = (
    "stall_ratio",
    "stall_ratio_amortized",
    "psguard_verify_stall_seconds",
    "psguard_saves_hashing_all_rows",
    "bytes_ratio",
    "overhead_pct",
    "overhead_idle_pct",
    "psguard_stall_seconds",
    "tf_stall_seconds",
    "psguard_bytes_per_save",
    "tf_bytes_per_save",
    "ps_to_chief_bytes_per_capture",
    "table_bytes",
    "changed_fraction_per_save",
    "stall_seconds_at_1pct",
    "stall_seconds_at_10pct",
    "stall_seconds_at_100pct",
    "ps_side_stall_seconds_at_1pct",
    "ps_side_stall_seconds_at_10pct",
    "ps_side_stall_seconds_at_100pct",
    "ps_side_stall_ratio_at_100pct",
    "steps_per_s_no_saves",
    "steps_per_s_with_saves",
    "overhead_changed_rows_per_save",
    "seconds",
)


def cmd(args: argparse.Namespace) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    cfg = Config(
        rows=args.rows,
        dim=args.dim,
        runs=args.runs,
        overhead_seconds=args.overhead_seconds,
        save_interval=args.save_interval,
        optimizer=args.optimizer,
        ids=args.ids,
        steps_per_execution=args.steps_per_execution,
    )
    if args.keras:
        from psguard.benchmarks import capture_keras

        results = capture_keras.run(cfg, workdir=args.workdir)
        print_results(results, as_json=args.json, keys=capture_keras.KEYS)
        return 0
    results = run(cfg, workdir=args.workdir)
    print_results(results, as_json=args.json, keys=KEYS)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "capture", help="psguard save vs tf.train.CheckpointManager.save on a local PS cluster (starts its own)"
    )
    p.add_argument("--rows", type=int, default=Config.rows, help="embedding rows (default 2,000,000)")
    p.add_argument("--dim", type=int, default=Config.dim, help="embedding width (default 32)")
    p.add_argument("--runs", type=int, default=Config.runs, help="steady-state saves per side (default 7)")
    p.add_argument(
        "--overhead-seconds",
        type=float,
        default=Config.overhead_seconds,
        help="training time per side for overhead_pct (default 60)",
    )
    p.add_argument("--save-interval", type=float, default=Config.save_interval, help="seconds (default 10)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=Config.optimizer, help="tf_keras optimizer")
    p.add_argument(
        "--ids",
        choices=ID_DISTRIBUTIONS,
        default=Config.ids,
        help="lookups over a fixed hot 1%% of the rows (default) or over all rows (then a save every 10 s finds "
        "far more than 1%% changed)",
    )
    p.add_argument(
        "--keras",
        action="store_true",
        help="train the same table with tf_keras model.fit and time psguard.keras.CheckpointCallback's save against "
        "TF's save of the same state (psguard.benchmarks.capture_keras; --rows, --dim, --optimizer, --ids, --runs "
        "apply, the overhead and sweep phases do not run)",
    )
    p.add_argument(
        "--steps-per-execution",
        type=int,
        default=Config.steps_per_execution,
        help="with --keras: model.compile(steps_per_execution=...) (default 10)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="where the checkpoint folders go (default: temp)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd)
