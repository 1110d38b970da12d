"""``psguard bench recovery``: kill -9 a PS of a job under ``psguard agent``, against restarting the plain-TF job.

Both sides train the same job (:class:`~psguard.testbed.model.RecModel`, by default a 200,000 x 16 table over
``--ps`` PS, tf_keras Adagrad, 1 worker) on loopback, and both lose PS 0 to ``SIGKILL`` after the same step,
``kill_step`` (default ``2K - 1``: K - 1 steps after the baseline's last save, so the baseline really loses
steps). The sides alternate, one recovery each per run.

- **psguard**, the product path: every task under its own ``psguard agent`` process, started as ``psguard wrap``
  and the chaos runner start them (:class:`psguard.agent.process.launcher.AgentProcess`): each PS's agent with
  ``--spool`` (its part folder, on tmpfs) and ``--store``, so it keeps its PS's shards and writes them to the
  log (issue 12; the chief's agent must log ``event=ps_side_shards``, ``ps_side_shards`` in the results says
  whether it did); the worker's agent; the chief's agent with ``--store``, ``--spool`` and every other agent
  as ``--peer``, running the trainer (:func:`~psguard.benchmarks.recovery_trainers.agent_trainer`). The trainer
  uses :class:`psguard.CheckpointManager` with the memory tier every 5 steps and the durable log every K, and
  rejoins in process (:func:`~psguard.trainer.recovery.run_with_recovery` with
  :func:`~psguard.handoff.client.restart_ps_servers`: the chief's agent restarts every PS, the agents swap in
  their warm standbys). At the kill step the trainer stops and waits; this process waits until every PS
  agent's standby is warm (as it is after minutes of training), kills PS 0's server and lets the trainer go on.
- **baseline** (plain TF): ``tf.train.CheckpointManager.save`` every K steps to a local folder. When the chief
  fails it exits (at once, with ``os._exit``: generous, a normal exit tears TF down for seconds); the
  "script" (this process) then stops every PS and worker server, starts a new set and a new chief process at
  the same time (the chief waits for the servers' ports), and the new chief restores with
  ``tf.train.CheckpointManager.restore_or_initialize``. No agents, no standby: a plain-TF job has none.
- ``--fault chief``: the trainer process is killed instead, at the same step. psguard: the chief's agent sees its
  task die and starts a new trainer (its warm standby: the trainer runs as ``python -m``, as a user's ``python
  train.py`` does, so the agent keeps one), after a new generation of PS as for any trainer restart; the new
  process restores (the memory tier first) and trains on. Plain TF: the script starts a new chief at once against
  the servers still running (a new coordinator may connect to them: only the chief's pod restarts). With
  ``--vs-ps-kill`` psguard also runs a PS kill beside each run: ``recovery_vs_ps_kill_ratio``.

Both trainers (child processes: :mod:`psguard.benchmarks.recovery_trainers`; the parent, which starts, kills and
measures, is this module and a module per side, :mod:`~psguard.benchmarks.recovery_psguard` and
:mod:`~psguard.benchmarks.recovery_baseline`, over :mod:`~psguard.benchmarks.recovery_job`'s job and measure) write
timestamped progress records (:class:`psguard.demo_trainer.Progress`): one per step, per capture and per restore.
**Recovery** is measured from the kill to the first step at normal speed: the step that completes at least
``memory_every + 2`` steps after the restored step (so both sides train the same steps after their restore, and
psguard's first capture after the restore is inside the span; psguard's span also waits for that capture if the policy
put it later), whose own duration is at most 3x the median step of the same job before the kill (no capture in it).
``first_step_s`` is the older measure: kill to the first step completed.

Keys: ``recovery_ratio`` (psguard's recovery seconds over the baseline's; medians), ``lost_steps_ratio`` (steps lost,
psguard over baseline, with the same durable cadence K: psguard restores the memory tier, at most 5 steps old),
``agents`` (true: the product path), ``state_bytes`` (every variable of model and optimizer),
``chief_peak_rss_growth_ratio`` (the chief's trainer plus the chief's agent, over ``state_bytes``: the agent's peak
RSS, the kernel's ``VmHWM`` sampled from ``/proc/<pid>/status`` every 50 ms, minus its RSS when the trainer starts;
the trainer's peak counted from just after it built model and optimizer, where it resets its peak mark, to the end of
that generation (its start read after :func:`~psguard.benchmarks.common.settle_rss` handed the build's freed memory
back to the kernel, on both sides), because building the testbed model alone peaks at ~0.8x the table on the chief in
TensorFlow, psguard or not; ``chief_peak_rss_growth_ratio_with_build`` counts the trainer from before the model
exists, as ``/proc`` sampling sees it), ``ps_agent_peak_rss_ratio`` (the largest PS agent's peak RSS growth over the
same start, over the bytes of the shards it holds: the table's and the optimizer slot's rows of its PS),
``restore_vs_raw_ratio`` (psguard's restore throughput, ``state_bytes`` over the trainer's own timing of
``restore_or_initialize`` in the recovery, over a raw PS-side restore of the same variables in the same run: one
``tf.function`` with, per shard on its own PS device, ``parse_tensor(read_file)`` + ``assign`` of a tmpfs file of that
shard, the best of two timed calls), plus both sides' raw figures per run and the phases of each recovery (psguard's
restore split into the agents writing the files, the PS loading them and the rebase).

``PSGUARD_BENCH_KEEP=1`` keeps each run's folder (agents' logs, the trainer's progress records) for a look at
where the time went.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from psguard.benchmarks.common import alternate, print_results, progress
from psguard.benchmarks.recovery_baseline import run_baseline
from psguard.benchmarks.recovery_job import Params
from psguard.benchmarks.recovery_psguard import run_psguard
from psguard.benchmarks.recovery_summary import compare_no_copies, compare_ps_kill, summarize
from psguard.errors import ConfigError


def run(p: Params, runs: int = 3, *, vs_ps_kill: bool = False) -> dict[str, Any]:
    """``runs`` recoveries per side, alternating; the results document (see the module docstring).

    With peer copies on and ``fault="node"``, psguard also runs the same fault with copies off, once per run and
    beside it: ``recovery_vs_no_copies_ratio`` is what the copies buy. With ``fault="chief"`` and
    ``vs_ps_kill``, psguard also runs a PS kill of the same job beside each run: ``recovery_vs_ps_kill_ratio``.
    """
    workdir = Path(tempfile.mkdtemp(prefix="psguard-bench-recovery-"))
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    beside: list[dict[str, Any]] = []  # the runs of `other`
    s3 = None
    if p.store == "s3":
        from psguard.testbed.s3 import SeaweedS3

        s3 = SeaweedS3(workdir / "seaweed", bucket="psguard-bench")
        s3.start()

    other, what_other = None, ""
    if p.fault == "node" and p.copies != "none":
        other, what_other = replace(p, copies="none"), "copies off"
    elif p.fault == "chief" and vs_ps_kill:
        other, what_other = replace(p, fault="process"), "PS 0 killed"

    def run_other(i: int) -> None:
        assert other is not None
        doc = run_psguard(other, workdir, s3)
        beside.append(doc)
        progress(f"run {i} psguard, {what_other}: {doc['recovery_s']:.2f}s, lost {doc['lost_steps']}")

    def a(i: int) -> float:
        # With copies off (or a PS kill) as well: right beside the run, in turns before and after it, so that what
        # drifts over the benchmark (the store's size, the machine's other load) does not land on one side of
        # their ratios (goodput with copies on over off moved 0.67-1.36 with the off runs all at the end).
        if other is not None and i % 2:
            run_other(i)
        doc = run_psguard(p, workdir, s3)
        ours.append(doc)
        progress(
            f"run {i} psguard: {doc['recovery_s']:.2f}s (first step {doc['first_step_s']:.2f}s), lost "
            f"{doc['lost_steps']} (from {doc['restored_from']}), restore {doc['restore_s']:.2f}s "
            f"({doc['restore_mib_s']:.0f} MiB/s, raw {doc['raw_restore_mib_s']:.0f} MiB/s)"
        )
        if other is not None and not i % 2:
            run_other(i)
        return float(doc["recovery_s"])

    def b(i: int) -> float:
        doc = run_baseline(p, workdir)
        theirs.append(doc)
        progress(
            f"run {i} baseline: {doc['recovery_s']:.2f}s (first step {doc['first_step_s']:.2f}s), "
            f"lost {doc['lost_steps']}, restore {doc['restore_s']:.2f}s"
        )
        return float(doc["recovery_s"])

    what = {"node": "PS 0 with its agent (node lost)", "chief": "the chief's trainer"}.get(p.fault, "PS 0")
    progress(
        f"{runs} runs per side: table {p.vocab_size} x {p.embedding_dim} over {p.num_ps} PS, memory every "
        f"{p.memory_every}, durable every {p.durable_every}, kill -9 {what} at step {p.kill_at}, peer copies "
        f"{p.copies}, psguard's log on {'SeaweedFS (S3)' if p.store == 's3' else 'a local folder'}"
        + (", surviving PS kept (peers.keep_survivors)" if p.keep_survivors else "")
    )
    finished = False
    try:
        xs, ys = alternate(runs, a, b)
        finished = True
    finally:
        if s3 is not None:
            s3.stop()
        if finished and not os.environ.get("PSGUARD_BENCH_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)
        elif not finished:  # what failed is in the agents' logs and the progress records
            progress(f"the run failed: its agents' logs and progress records are kept in {workdir}")
    result = summarize(p, ours, theirs, xs, ys)
    if beside and p.fault == "node":
        result.update(compare_no_copies(ours, beside, xs))
    elif beside:
        result.update(compare_ps_kill(beside, xs))
    return result


def params_from_args(args: argparse.Namespace, **overrides: Any) -> Params:
    """The :class:`Params` of the options :func:`add_job_options` adds (``bench scale`` varies some)."""
    values = {
        "vocab_size": getattr(args, "vocab_size", Params.vocab_size),
        "embedding_dim": args.embedding_dim,
        "num_ps": args.ps,
        "durable_every": args.durable_every,
        "memory_every": args.memory_every,
        "kill_step": args.kill_step,
        "timeout": args.timeout,
        "fault": getattr(args, "fault", "process"),
        "copies": getattr(args, "copies", "none"),
        "parity_group": getattr(args, "parity_group", Params.parity_group),
        "keep_survivors": getattr(args, "keep_survivors", Params.keep_survivors),
        "store": getattr(args, "store", "local"),
    }
    values.update(overrides)
    return Params(**values)


def add_job_options(p: argparse.ArgumentParser, *, embedding_dim: int = 16) -> None:
    """The job's options both ``bench recovery`` and ``bench scale`` take (see :func:`params_from_args`)."""
    p.add_argument("--embedding-dim", type=int, default=embedding_dim, help=f"default {embedding_dim}")
    p.add_argument("--ps", type=int, default=2, help="PS tasks (default 2)")
    p.add_argument("--memory-every", type=int, default=5, help="psguard memory-tier cadence in steps (default 5)")
    p.add_argument("--durable-every", type=int, default=50, help="K: durable / TF save cadence (default 50)")
    p.add_argument("--kill-step", type=int, default=0, help="step at which PS 0 is killed (default 2K - 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one side's run may take (default 600)")
    p.add_argument("--json", action="store_true")


def cmd(args: argparse.Namespace) -> int:
    if args.copies is None:
        args.copies = "full" if args.fault == "node" else "none"
    if args.copies == "parity" and not 2 <= args.parity_group < args.ps:
        # The parity of a group is held outside it: with every PS in one group there is no holder.
        raise ConfigError(f"--copies parity needs 2 <= --parity-group < --ps (got {args.parity_group}, {args.ps} PS)")
    if args.vs_ps_kill and args.fault != "chief":
        raise ConfigError("--vs-ps-kill compares a chief kill with a PS kill: it needs --fault chief")
    results = run(params_from_args(args), runs=args.runs, vs_ps_kill=args.vs_ps_kill)
    print_results(results, as_json=args.json)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("recovery", help="kill -9 a PS of a job under agents vs restarting the whole TF job")
    p.add_argument("--runs", type=int, default=3, help="recoveries per side (default 3)")
    p.add_argument("--vocab-size", type=int, default=200_000, help="rows of the embedding table (default 200000)")
    p.add_argument(
        "--fault",
        choices=("process", "node", "chief"),
        default="process",
        help="process: kill -9 PS 0's server; node: with its agent, a new agent on an empty folder; chief: the "
        "trainer process (plain TF's chief restarted against the running servers) (default process)",
    )
    p.add_argument(
        "--vs-ps-kill",
        action="store_true",
        help="with --fault chief: psguard also runs a PS kill of the same job beside each run, for "
        "recovery_vs_ps_kill_ratio",
    )
    p.add_argument(
        "--copies",
        choices=("none", "full", "parity"),
        default=None,
        help="psguard's peer copies (default: full with --fault node, else none; parity: one XOR block per "
        "--parity-group PS, needs --ps above it); with --fault node and copies on, psguard also runs with them off "
        "for recovery_vs_no_copies_ratio",
    )
    p.add_argument("--parity-group", type=int, default=Params.parity_group, help="PS per parity block (default 2)")
    p.add_argument(
        "--keep-survivors",
        action="store_true",
        help="psguard's peers.keep_survivors: the in-process rejoin leaves the PS that survived running",
    )
    p.add_argument(
        "--store",
        choices=("local", "s3"),
        default="local",
        help="psguard's durable log: a local folder, or SeaweedFS started for the run (the baseline saves locally)",
    )
    add_job_options(p)
    p.set_defaults(func=cmd)
