"""``psguard bench recovery``: kill -9 a PS, psguard's in-process rejoin vs restarting the whole plain-TF job.

Both sides train the same job (:class:`~psguard.testbed.model.RecModel`, a 200,000 x 16 table over 2 PS,
tf_keras Adagrad, 1 worker) on their own :class:`~psguard.testbed.cluster.LocalCluster`, and both lose PS 0 to
``SIGKILL`` at the same step, ``kill_step`` (default ``2K - 1``: K - 1 steps after the baseline's last save,
so the baseline really loses steps).

- **psguard** (what is measured: a chief process owning the LocalCluster, the sidecar's memory tier, spool
  server and persister in threads, as ``tests/recovery_chief.py`` does; not every task under ``psguard
  agent``): :class:`psguard.CheckpointManager` with the memory tier every 5 steps and the durable log every K
  steps; :func:`psguard.trainer.recovery.run_with_recovery` rejoins in the same process: both PS servers restarted in
  parallel (what the chief's agent does for a new generation) by swapping in their warm standby processes
  (:mod:`psguard.agent.standby`, on by default in the agent's built-in server mode), ``update_server_def``, model
  rebuilt, restored from the memory tier.
- **baseline** (plain TF): ``tf.train.CheckpointManager.save`` every K steps to a local folder. When the chief
  fails it exits (at once, with ``os._exit``: generous, a normal exit tears TF down for seconds); the
  "script" (this process) then stops every PS and worker server, starts a new set and a new chief process at
  the same time (the chief waits for the servers' ports), and the new chief restores with
  ``tf.train.CheckpointManager.restore_or_initialize``.

Keys: ``recovery_ratio`` (psguard's seconds from the kill to the first new training step completed, over the
baseline's; medians; target <= 0.5), ``lost_steps_ratio`` (steps lost, psguard over baseline, with the same
durable cadence K; target <= 0.1), plus both sides' raw figures per run and the phases of each recovery.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from psguard.benchmarks.common import alternate, median, print_results, progress
from psguard.ports import port_open
from psguard.testbed.cluster import LocalCluster

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}
NUM_PS = 2
NUM_WORKERS = 1


@dataclass(frozen=True)
class Params:
    vocab_size: int = 200_000
    embedding_dim: int = 16
    batch_size: int = 64
    memory_every: int = 5
    durable_every: int = 50  # K: psguard's durable cadence and the baseline's CheckpointManager.save cadence
    kill_step: int = 0  # 0: 2K - 1
    timeout: float = 300.0

    @property
    def kill_at(self) -> int:
        return self.kill_step or 2 * self.durable_every - 1


def _say(**doc: Any) -> None:
    print(json.dumps(doc), flush=True)


def _model(tf: Any, p: Params) -> tuple[Any, Any]:
    from psguard.testbed.model import ModelConfig, RecModel, make_optimizer

    cfg = ModelConfig(vocab_size=p.vocab_size, embedding_dim=p.embedding_dim, batch_size=p.batch_size)
    return RecModel(cfg), make_optimizer("adagrad")


def _strategy(tf: Any, resolver: Any) -> tuple[Any, Any]:
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(NUM_PS)
    )
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)


# ------------------------------------------------------------------------------------------- child: psguard


def psguard_child(workdir: str, params_json: str) -> None:
    """The psguard chief: LocalCluster + sidecar threads + run_with_recovery. Prints one JSON line at the end."""
    os.environ.update(QUIET)
    p = Params(**json.loads(params_json))
    import tensorflow as tf

    from psguard.agent.memory_tier import MemoryTier
    from psguard.agent.persister import Persister, resume
    from psguard.agent.spool_server import SpoolServer
    from psguard.policy.engine import EverySteps, Schedule
    from psguard.store.log import Store
    from psguard.testbed.model import Trainer
    from psguard.trainer.manager import CheckpointManager
    from psguard.trainer.recovery import run_with_recovery

    work = Path(workdir)
    url, spool = str(work / "store"), work / "spool"
    store = Store.open(url)
    tier = MemoryTier()
    persister = Persister(store, tier, last=resume(store, tier)).start()
    server = SpoolServer(spool, tier, persister).start()
    schedule = Schedule(memory=EverySteps(p.memory_every), durable=EverySteps(p.durable_every))
    t: dict[str, Any] = {"restored": []}
    with LocalCluster(num_ps=NUM_PS, num_workers=NUM_WORKERS, log_dir=work / "logs", standby=True) as cluster:
        strategy, coordinator = _strategy(tf, cluster.cluster_resolver())

        def build() -> tuple[Any, Trainer, CheckpointManager]:
            with strategy.scope():
                model, optimizer = _model(tf, p)
            trainer = Trainer(strategy, coordinator, model, optimizer)
            manager = CheckpointManager(
                tf.train.Checkpoint(model=model, optimizer=optimizer),
                url,
                coordinator=coordinator,
                step_counter=model.step,
                policy=schedule,
                spool=spool,
            )
            manager.restore_or_initialize()
            step = int(model.step.numpy())
            trainer.next_index = step
            source = manager.restored.source if manager.restored is not None else None
            t["restored"].append({"step": step, "source": source, "at": time.time()})
            return model, trainer, manager

        def train(job: tuple[Any, Trainer, CheckpointManager]) -> int:
            model, trainer, manager = job
            while (step := int(model.step.numpy())) < p.kill_at + 1 or "first_step_at" not in t:
                manager.maybe_save(step)
                if step == p.kill_at and "kill_at" not in t:
                    # As the agents' standby_delay would have it after minutes of training: warm standbys.
                    cluster.wait_standby()
                    pid = cluster.pids[("ps", 0)]
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
                    t["kill_at"], t["trained_before_failure"] = time.time(), step
                trainer.train(1)
                if len(t["restored"]) > 1 and "first_step_at" not in t:
                    t["first_step_at"] = time.time()
            manager.close(timeout=60)
            return int(model.step.numpy())

        def close(job: tuple[Any, Trainer, CheckpointManager]) -> None:
            t["seen_at"] = time.time()
            job[2].close(timeout=30)

        def restart_ps(failed_at: float) -> None:
            t["restart_from"] = time.time()
            cluster.restart_many([("ps", i) for i in range(cluster.num_ps)])
            t["ps_ready_at"] = time.time()

        _, report = run_with_recovery(build, train, restart_ps=restart_ps, close=close)
    server.stop()
    persister.stop(drain=True)
    store.close()
    kill_at, restored = t["kill_at"], t["restored"][-1]
    _say(
        recovery_s=t["first_step_at"] - kill_at,
        lost_steps=t["trained_before_failure"] - restored["step"],
        restored_step=restored["step"],
        restored_from=restored["source"],
        error=report.recoveries[0].error[:200],
        trained_before_failure=t["trained_before_failure"],
        phases={
            "detect_s": t["seen_at"] - kill_at,
            "close_s": t["restart_from"] - t["seen_at"],
            "restart_ps_s": t["ps_ready_at"] - t["restart_from"],
            "rebuild_restore_s": restored["at"] - t["ps_ready_at"],
            "first_step_s": t["first_step_at"] - restored["at"],
        },
    )


# ------------------------------------------------------------------------------------------- child: baseline


def baseline_child(workdir: str, params_json: str, mode: str) -> None:
    """A plain-TF chief (``TF_CONFIG`` from the env). ``first``: train, kill PS 0 at the kill step, exit 1 on
    the failure. ``restart``: wait for the servers, restore_or_initialize, train one step, exit 0."""
    os.environ.update(QUIET)
    p = Params(**json.loads(params_json))
    started = time.time()
    import tensorflow as tf

    from psguard.testbed.model import Trainer

    spec = json.loads(os.environ["TF_CONFIG"])["cluster"]
    for addr in spec["ps"] + spec["worker"]:  # the script's readiness check: every server port open
        host, port = addr.rsplit(":", 1)
        while not port_open(host, int(port)):
            time.sleep(0.02)
    imported = time.time()
    strategy, coordinator = _strategy(tf, tf.distribute.cluster_resolver.TFConfigClusterResolver())
    with strategy.scope():
        model, optimizer = _model(tf, p)
    trainer = Trainer(strategy, coordinator, model, optimizer)
    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(ckpt, str(Path(workdir) / "tf-ckpt"), max_to_keep=2)
    manager.restore_or_initialize()
    step = int(model.step.numpy())
    trainer.next_index = step
    if mode == "restart":
        restored_at = time.time()
        trainer.train(1)
        _say(started=started, ready=imported, restored_at=restored_at, restored_step=step, first_step_at=time.time())
        sys.stdout.flush()
        os._exit(0)
    saved = step
    try:
        while True:
            step = int(model.step.numpy())
            if step > 0 and step % p.durable_every == 0 and step != saved:
                manager.save(checkpoint_number=step)
                saved = step
            if step == p.kill_at:
                os.kill(int(os.environ["BENCH_PS0_PID"]), signal.SIGKILL)
                _say(kill_at=time.time(), trained_before_failure=step)
            trainer.train(1)
    except Exception as e:  # the PS failure: a plain-TF chief dies with it; the script restarts the job
        _say(seen_at=time.time(), error=str(e).splitlines()[0][:200])
        sys.stdout.flush()
        os._exit(1)


# ------------------------------------------------------------------------------------------- the parent


def _child(fn: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        f"import sys; from psguard.benchmarks.recovery import {fn}; {fn}(*sys.argv[1:])",
        *args,
    ]


def _lines(out: str) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            doc.update(json.loads(line))
    return doc


def _communicate(proc: subprocess.Popen[str], timeout: float, what: str, log: Path) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"{what}: no end within {timeout}s; log {log}") from None
    return out


def run_psguard(p: Params, workdir: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="psg-", dir=workdir))
    log = work / "chief.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            _child("psguard_child", str(work), json.dumps(asdict(p))),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=dict(os.environ, **QUIET),
        )
        out = _communicate(proc, p.timeout, "psguard chief", log)
    doc = _lines(out)
    if proc.returncode != 0 or "recovery_s" not in doc:
        raise RuntimeError(f"psguard chief exited {proc.returncode}: {log.read_text()[-3000:]}")
    shutil.rmtree(work, ignore_errors=True)
    return doc


def run_baseline(p: Params, workdir: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tf-", dir=workdir))
    procs: list[subprocess.Popen[str]] = []
    clusters: list[LocalCluster] = []

    def start_chief(mode: str, env: dict[str, str], log: Path) -> subprocess.Popen[str]:
        with open(log, "w") as err:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(
                _child("baseline_child", str(work), json.dumps(asdict(p)), mode),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )

    try:
        cluster = LocalCluster(num_ps=NUM_PS, num_workers=NUM_WORKERS).start()
        clusters.append(cluster)
        env = dict(os.environ, **QUIET, TF_CONFIG=cluster.tf_config(), BENCH_PS0_PID=str(cluster.pids[("ps", 0)]))
        log1 = work / "chief-1.log"
        procs.append(start_chief("first", env, log1))
        first = _lines(_communicate(procs[-1], p.timeout, "baseline chief", log1))
        exited_at = time.time()
        if "seen_at" not in first:
            raise RuntimeError(f"baseline chief exited {procs[-1].returncode}: {log1.read_text()[-3000:]}")
        # The restart script: the whole job down, then new servers and a new chief at once.
        cluster.stop()
        stopped_at = time.time()
        cluster = LocalCluster(num_ps=NUM_PS, num_workers=NUM_WORKERS)
        clusters.append(cluster)
        env = dict(os.environ, **QUIET, TF_CONFIG=cluster.tf_config())
        log2 = work / "chief-2.log"
        procs.append(start_chief("restart", env, log2))
        cluster.start()
        servers_at = time.time()
        second = _lines(_communicate(procs[-1], p.timeout, "restarted baseline chief", log2))
        if "first_step_at" not in second:
            raise RuntimeError(f"restarted baseline chief exited {procs[-1].returncode}: {log2.read_text()[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for c in clusters:
            c.stop()
    shutil.rmtree(work, ignore_errors=True)
    kill_at = first["kill_at"]
    return {
        "recovery_s": second["first_step_at"] - kill_at,
        "lost_steps": first["trained_before_failure"] - second["restored_step"],
        "restored_step": second["restored_step"],
        "trained_before_failure": first["trained_before_failure"],
        "phases": {
            "detect_s": first["seen_at"] - kill_at,
            "chief_exit_s": exited_at - first["seen_at"],
            "stop_job_s": stopped_at - exited_at,
            "servers_up_s": servers_at - stopped_at,
            "chief_start_s": second["ready"] - stopped_at,  # TF import, in parallel with the servers' start
            "connect_restore_s": second["restored_at"] - second["ready"],
            "first_step_s": second["first_step_at"] - second["restored_at"],
        },
    }


def run(p: Params, runs: int = 3) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="psguard-bench-recovery-"))
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []

    def a(i: int) -> float:
        doc = run_psguard(p, workdir)
        ours.append(doc)
        progress(f"run {i} psguard: {doc['recovery_s']:.2f}s, lost {doc['lost_steps']} (from {doc['restored_from']})")
        return float(doc["recovery_s"])

    def b(i: int) -> float:
        doc = run_baseline(p, workdir)
        theirs.append(doc)
        progress(f"run {i} baseline: {doc['recovery_s']:.2f}s, lost {doc['lost_steps']}")
        return float(doc["recovery_s"])

    progress(
        f"{runs} runs per side: table {p.vocab_size} x {p.embedding_dim}, memory every {p.memory_every}, "
        f"durable every {p.durable_every}, kill -9 PS 0 at step {p.kill_at}"
    )
    try:
        xs, ys = alternate(runs, a, b)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    lost_ours = median([float(d["lost_steps"]) for d in ours])
    lost_theirs = median([float(d["lost_steps"]) for d in theirs])

    def phases(docs: list[dict[str, Any]]) -> dict[str, float]:
        return {k: round(median([d["phases"][k] for d in docs]), 3) for k in docs[0]["phases"]}

    return {
        "recovery_ratio": median(xs) / median(ys),
        "lost_steps_ratio": lost_ours / lost_theirs if lost_theirs else float("nan"),
        "psguard_recovery_s": median(xs),
        "baseline_recovery_s": median(ys),
        "psguard_lost_steps": lost_ours,
        "baseline_lost_steps": lost_theirs,
        "recovery_ratio_per_run": [x / y for x, y in zip(xs, ys, strict=True)],
        "psguard_recovery_s_runs": xs,
        "baseline_recovery_s_runs": ys,
        "psguard_lost_steps_runs": [d["lost_steps"] for d in ours],
        "baseline_lost_steps_runs": [d["lost_steps"] for d in theirs],
        "psguard_restored_from": [d["restored_from"] for d in ours],
        "psguard_phases_s": phases(ours),
        "baseline_phases_s": phases(theirs),
        "kill_step": p.kill_at,
        "memory_every": p.memory_every,
        "durable_every": p.durable_every,
        "table": f"{p.vocab_size}x{p.embedding_dim}",
        "runs": runs,
    }


def cmd(args: argparse.Namespace) -> int:
    p = Params(
        vocab_size=args.vocab_size,
        embedding_dim=args.embedding_dim,
        durable_every=args.durable_every,
        memory_every=args.memory_every,
        kill_step=args.kill_step,
    )
    results = run(p, runs=args.runs)
    print_results(results, as_json=args.json)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("recovery", help="kill -9 a PS: psguard's in-process rejoin vs restarting the whole TF job")
    p.add_argument("--runs", type=int, default=3, help="recoveries per side (default 3)")
    p.add_argument("--vocab-size", type=int, default=200_000, help="rows of the embedding table (default 200000)")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--memory-every", type=int, default=5, help="psguard memory-tier cadence in steps (default 5)")
    p.add_argument("--durable-every", type=int, default=50, help="K: durable / TF save cadence (default 50)")
    p.add_argument("--kill-step", type=int, default=0, help="step at which PS 0 is killed (default 2K - 1)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd)
