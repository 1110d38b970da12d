"""The two trainers ``psguard bench recovery`` (:mod:`psguard.benchmarks.recovery`) runs as child processes.

:func:`agent_trainer` is psguard's, run by the chief's ``psguard agent``; :func:`baseline_child` is the
plain-TF job's chief, run by the benchmark's own process (the "script"). Both train the same model and write
the same timestamped progress records (:class:`psguard.demo_trainer.Progress`), which the parent reads back
to measure each side: nothing else passes between them (parameters come as JSON on the command line).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from psguard.benchmarks.common import reset_peak_rss, rss_bytes, settle_rss
from psguard.benchmarks.recovery_job import Params, read_records
from psguard.handoff.contract import QUIET_TENSORFLOW
from psguard.ports import port_open

__all__ = ["agent_trainer", "baseline_child", "main", "raw_restore", "restarted_generation", "state_layout"]


def _model(tf: Any, p: Params) -> tuple[Any, Any]:
    from psguard.testbed.model import ModelConfig, RecModel, make_optimizer

    cfg = ModelConfig(vocab_size=p.vocab_size, embedding_dim=p.embedding_dim, batch_size=p.batch_size)
    return RecModel(cfg), make_optimizer("adagrad")


def _strategy(tf: Any, resolver: Any, num_ps: int) -> tuple[Any, Any]:
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps)
    )
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


def _wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.005)


def state_layout(root: Any, spilled: Any = ()) -> tuple[int, dict[str, int]]:
    """(bytes of every variable of ``root``, bytes per PS task of the tensors in ``spilled``).

    ``spilled``: the names of the tensors whose shards the PS agents keep (the table and its slot).
    """
    from psguard.handoff.parts import task_of_device
    from psguard.trainer.variables import list_tensors

    total, per_ps = 0, dict[str, int]()
    for name, info in list_tensors(root).items():
        if info.alias_of is not None:
            continue
        total += info.nbytes
        if name in spilled:
            row = info.nbytes // max(1, info.shape[0])
            for s in info.shards:
                task = task_of_device(s.device) or "?"
                per_ps[task] = per_ps.get(task, 0) + s.rows * row
    return total, per_ps


def raw_restore(tf: Any, root: Any, folder: Path, repeats: int = 2) -> dict[str, Any]:
    """The raw PS-side restore ``restore_vs_raw_ratio`` compares with: every shard of ``root`` written to a file
    by its own PS (``serialize_tensor``), then read and assigned back on its own device by one ``tf.function``
    (``parse_tensor(read_file)`` + ``assign``, all PS in parallel, nothing through the chief). The function is
    traced before the timing; returns the file bytes and the best of ``repeats`` timed loads."""
    from psguard.trainer.variables import list_tensors

    shards = [s for info in list_tensors(root).values() if info.alias_of is None for s in info.shards]
    folder.mkdir(parents=True, exist_ok=True)
    paths = tf.constant([str(folder / f"{k}.tp") for k in range(len(shards))])

    def write(paths: Any) -> Any:
        for k, s in enumerate(shards):
            with tf.device(s.device):
                tf.io.write_file(paths[k], tf.io.serialize_tensor(s.var.read_value()))
        return tf.constant(0)

    def load(paths: Any) -> Any:
        values = []
        for k, s in enumerate(shards):
            with tf.device(s.device):
                value = tf.io.parse_tensor(tf.io.read_file(paths[k]), s.var.dtype)
                values.append(tf.ensure_shape(value, s.var.shape))
        with tf.control_dependencies(values):
            ops = []
            for value, s in zip(values, shards, strict=True):
                with tf.device(s.device):
                    ops.append(s.var.assign(value, read_value=False))
        with tf.control_dependencies(ops):
            return tf.constant(0)

    tf.function(write, autograph=False)(paths).numpy()
    nbytes = sum(os.path.getsize(folder / f"{k}.tp") for k in range(len(shards)))
    load_fn = tf.function(load, autograph=False)
    load_fn.get_concrete_function(paths)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        load_fn(paths).numpy()
        times.append(time.perf_counter() - t0)
    shutil.rmtree(folder, ignore_errors=True)
    return {"bytes": nbytes, "seconds": min(times), "seconds_runs": times}


# ------------------------------------------------------------------------------------------- child: psguard


def agent_trainer(progress_path: str, store_url: str, shm: str, params_json: str) -> None:
    """The psguard trainer, run by the chief's ``psguard agent`` (``TF_CONFIG``, the spool and the PS agents'
    part folders come from it). Writes progress records; after its first capture it writes ``settle`` and waits
    for the file ``<shm>/settled`` (the parent saw the peer copies made), at the kill step it writes ``kill``
    and waits for ``<shm>/killed`` (the parent has killed PS 0 then, or, with ``fault="chief"``, this process);
    at the end it measures :func:`raw_restore`. A process started after a ``kill`` record (the agent's restart of
    a killed trainer) is generation 1: it restores and trains on."""
    t_started = time.time()
    os.environ.update(QUIET_TENSORFLOW)
    p = Params(**json.loads(params_json))
    first_gen = restarted_generation(Path(progress_path))
    import tensorflow as tf

    t_imported = time.time()  # a warm standby imported it before it was told to go

    from psguard.demo_trainer import Progress
    from psguard.trainer.recovery import run_with_recovery

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("psguard").setLevel(logging.INFO)  # its capture and restore lines, in the chief agent's log
    rec = Progress(progress_path)
    rec.emit("started", gen=first_gen, t=t_started)  # with a warm standby: when it was told to go
    rec.emit("imported", gen=first_gen, t=t_imported)
    strategy, coordinator = _strategy(tf, tf.distribute.cluster_resolver.TFConfigClusterResolver(), p.num_ps)
    reset_peak_rss()
    rec.emit("ready", gen=first_gen, pid=os.getpid(), rss=rss_bytes())
    job = _AgentJob(p, rec, store_url, Path(shm), strategy, coordinator, first_gen=first_gen)
    root, report = run_with_recovery(job.build, job.train, restart_ps=job.restart_ps, close=job.close)
    rec.emit("trainer-peak", hwm=rss_bytes("VmHWM"), recoveries=len(report.recoveries))
    rec.emit("raw", **raw_restore(tf, root, Path(shm) / "raw"))
    rec.emit("done")
    rec.close()


def restarted_generation(progress: Path) -> int:
    """The generation a trainer process starts at: 1 after a ``kill`` record (it replaces a killed trainer:
    ``fault="chief"``), else 0. The progress file is the one thing each trainer process and the parent share."""
    return 1 if read_records(progress).of("kill") else 0


#: One generation of the psguard trainer: its model, trainer, CheckpointManager and tf.train.Checkpoint.
Generation = tuple[Any, Any, Any, Any]


class _AgentJob:
    """The psguard trainer's generations (:func:`agent_trainer`): what ``run_with_recovery`` builds, trains
    and closes, each step recorded."""

    def __init__(
        self, p: Params, rec: Any, store_url: str, shm: Path, strategy: Any, coordinator: Any, *, first_gen: int = 0
    ) -> None:
        from psguard.policy.engine import EverySteps, Schedule

        self.p, self.rec, self.store_url, self.shm = p, rec, store_url, shm
        self.strategy, self.coordinator = strategy, coordinator
        self.schedule = Schedule(memory=EverySteps(p.memory_every), durable=EverySteps(p.durable_every))
        self.gen = first_gen - 1
        self.killed = first_gen > 0  # a process after the kill: the fault is behind it
        self.based = first_gen > 0  # the first capture is restorable and the job settled

    def build(self) -> Generation:
        import tensorflow as tf

        from psguard.testbed.model import Trainer
        from psguard.trainer.manager import CheckpointManager
        from psguard.trainer.options import ManagerOptions

        p, rec = self.p, self.rec
        self.gen += 1
        t0 = time.time()
        with self.strategy.scope():
            model, optimizer = _model(tf, p)
        trainer = Trainer(self.strategy, self.coordinator, model, optimizer)
        root = tf.train.Checkpoint(model=model, optimizer=optimizer)
        # Building the model peaks at ~0.8x the table on the chief (TF's variable creation, psguard or not):
        # psguard's own growth is counted from here (the kernel's peak mark reset).
        built_hwm = rss_bytes("VmHWM")
        settle_rss()
        built_rss = rss_bytes()
        reset_peak_rss()
        manager = CheckpointManager(
            root,
            self.store_url,
            options=ManagerOptions(coordinator=self.coordinator),
            step_counter=model.step,
            policy=self.schedule,
        )
        parts = _timed_parts(manager)
        t1 = time.time()
        manager.restore_or_initialize()
        t2 = time.time()
        step = int(model.step.numpy())
        trainer.next_index = step
        r = manager.restored
        rec.emit("restore", gen=self.gen, t0=t1, t1=t2, build_s=t1 - t0, step=step,
                 source=r.source if r is not None else None, parts=parts, built_rss=built_rss, built_hwm=built_hwm,
                 rss=rss_bytes(), hwm=rss_bytes("VmHWM"))  # fmt: skip
        if self.gen == 0:
            spilled = manager.capturer.spilled
            total, per_ps = state_layout(root, spilled)
            rec.emit("state", state_bytes=total, ps_bytes=per_ps, spilled=sorted(spilled))
        return model, trainer, manager, root

    def train(self, job: Generation) -> Any:
        p, rec = self.p, self.rec
        model, trainer, manager, root = job
        restored = int(model.step.numpy())
        end = p.kill_at + 1 if self.gen == 0 else restored + p.after_steps
        while (step := int(model.step.numpy())) < end:
            handle = manager.maybe_save(step)
            if handle is not None:
                stats = manager.capturer.last_stats  # rows written on the PS nodes: all of them when full
                rows = stats.rows_spilled
                rec.emit("capture", gen=self.gen, step=step, stall=handle.stall_seconds, rows_spilled=rows,
                         hwm=rss_bytes("VmHWM"))  # fmt: skip
                if self.gen == 0 and not self.based:
                    self.settle(handle, step)
            if step == p.kill_at and not self.killed:
                self.killed = True
                rec.emit("kill", step=step)
                _wait_file(self.shm / "killed", p.timeout)
            trainer.train(1)
            rec.emit("step", gen=self.gen, step=step + 1, cap=handle is not None)
        if self.gen == 0:
            raise RuntimeError(f"trained past the kill step {p.kill_at} without a failure")
        manager.close(timeout=p.timeout)
        return root

    def settle(self, handle: Any, step: int) -> None:
        """A job that has trained for a while has its first (full) capture in the memory tiers long since: wait for
        it, so the kill finds the steady state (its cost is reported apart). And its peer copies made (the first
        whole copy of a GB shard takes seconds, once per job): the pace before the kill is then the steady
        state's (the parent waits for them)."""
        self.based = True
        t0 = time.time()
        handle.restorable(timeout=self.p.timeout)
        self.rec.emit("first-restorable", seconds=time.time() - t0)
        self.rec.emit("settle", step=step)
        _wait_file(self.shm / "settled", self.p.timeout)

    def close(self, job: Generation) -> None:
        self.rec.emit("failure", seen=int(self.p.kill_at))
        job[2].close(timeout=30)
        self.rec.emit("closed")

    def restart_ps(self, failed_at: float) -> None:
        from psguard.handoff.client import restart_ps_servers

        self.rec.emit("restart-ps")
        restart_ps_servers(failed_at=failed_at)
        self.rec.emit("ps-restarted")


def _timed_parts(manager: Any) -> dict[str, float]:
    """Time the phases of ``manager.restore_or_initialize()`` (filled in as it runs): ``snapshot_s`` (the
    chief's agent gets every PS agent to write its shards' files: ``memory_snapshot``), ``load_s`` (each PS
    reads and assigns its files, the small tensors from the chief, and hashes what it did not load the
    fingerprints of, in one function: ``restore_parts``) and ``rebase_s`` (a separate rebase: the fingerprints of
    every row for the next capture, after a restore that is not PS-side; 0 after a PS-side one). Wraps the
    instance's methods only."""
    times: dict[str, float] = {}

    def wrap(obj: Any, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times[key] = times.get(key, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)

    wrap(manager._sink, "memory_snapshot", "snapshot_s")
    wrap(manager.capturer, "restore_parts", "load_s")
    wrap(manager.capturer, "rebase", "rebase_s")
    return times


# ------------------------------------------------------------------------------------------- child: baseline


def baseline_child(workdir: str, params_json: str, mode: str, progress_path: str) -> None:
    """A plain-TF chief (``TF_CONFIG`` from the env). ``first``: train, kill PS 0 at the kill step, exit 1 on
    the failure (``fault="chief"``: SIGKILL itself at the kill step instead). ``restart``: wait for the servers,
    restore_or_initialize, train ``after_steps`` steps, exit 0.
    Writes the same progress records as :func:`agent_trainer`."""
    t_started = time.time()
    os.environ.update(QUIET_TENSORFLOW)
    p = Params(**json.loads(params_json))
    import tensorflow as tf

    t_imported = time.time()
    from psguard.demo_trainer import Progress
    from psguard.testbed.model import Trainer

    rec = Progress(progress_path)
    gen = 0 if mode == "first" else 1
    rec.emit("started", gen=gen, t=t_started)
    rec.emit("imported", gen=gen, t=t_imported)
    spec = json.loads(os.environ["TF_CONFIG"])["cluster"]
    for addr in spec["ps"] + spec["worker"]:  # the script's readiness check: every server port open
        host, port = addr.rsplit(":", 1)
        while not port_open(host, int(port)):
            time.sleep(0.02)
    strategy, coordinator = _strategy(tf, tf.distribute.cluster_resolver.TFConfigClusterResolver(), p.num_ps)
    reset_peak_rss()
    rec.emit("ready", gen=gen, pid=os.getpid(), rss=rss_bytes())
    t0 = time.time()
    with strategy.scope():
        model, optimizer = _model(tf, p)
    trainer = Trainer(strategy, coordinator, model, optimizer)
    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
    built_hwm = rss_bytes("VmHWM")
    settle_rss()  # as on psguard's side
    built_rss = rss_bytes()
    reset_peak_rss()  # as on psguard's side: the growth of saving and restoring, the model's build apart
    manager = tf.train.CheckpointManager(ckpt, str(Path(workdir) / "tf-ckpt"), max_to_keep=2)
    t1 = time.time()
    manager.restore_or_initialize()
    step = int(model.step.numpy())
    rec.emit("restore", gen=gen, t0=t1, t1=time.time(), build_s=t1 - t0, step=step, source="tf",
             built_rss=built_rss, built_hwm=built_hwm)  # fmt: skip
    trainer.next_index = step
    if mode == "restart":
        for _ in range(p.after_steps):
            trainer.train(1)
            rec.emit("step", gen=gen, step=int(model.step.numpy()), cap=False)
        rec.emit("trainer-peak", gen=gen, hwm=rss_bytes("VmHWM"))
        rec.close()
        os._exit(0)
    if mode == "first":
        rec.emit("state", state_bytes=state_layout(ckpt)[0])
    saved = step
    try:
        while True:
            step = int(model.step.numpy())
            captured = False
            if step > 0 and step % p.durable_every == 0 and step != saved:
                c0 = time.perf_counter()
                manager.save(checkpoint_number=step)
                rec.emit("capture", gen=gen, step=step, stall=time.perf_counter() - c0)
                saved, captured = step, True
            if step == p.kill_at and p.fault == "chief":  # this process is the one killed: at once, as kill -9
                rec.emit("kill", step=step)
                rec.emit("trainer-peak", gen=gen, hwm=rss_bytes("VmHWM"))
                rec.close()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == p.kill_at:
                os.kill(int(os.environ["BENCH_PS0_PID"]), signal.SIGKILL)
                rec.emit("kill", step=step)
            trainer.train(1)
            rec.emit("step", gen=gen, step=step + 1, cap=captured)
    except Exception as e:  # the PS failure: a plain-TF chief dies with it; the script restarts the job
        rec.emit("failure", seen=step, error=str(e).splitlines()[0][:200])
        rec.emit("trainer-peak", gen=gen, hwm=rss_bytes("VmHWM"))
        rec.close()
        os._exit(1)


def main(argv: list[str]) -> None:
    """``python -m psguard.benchmarks.recovery_trainers FN ARGS...``: the form a ``psguard agent`` keeps a warm
    standby of (:func:`psguard.benchmarks.recovery_job.child` with ``warm``)."""
    trainers = {"agent_trainer": agent_trainer, "baseline_child": baseline_child}
    trainers[argv[0]](*argv[1:])


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
