"""``psguard demo``: the whole story on a local cluster, every task under ``psguard agent``.

On the embedded default (a local folder store, no server needed) it starts 2 PS servers, 2 workers and the
chief, each under its own ``psguard agent`` (free loopback ports, ``cluster.json`` in the demo folder). The
chief's agent runs :mod:`psguard.demo_trainer`: the recommendation-style RecModel trained with
:class:`psguard.CheckpointManager` (memory tier every few steps through the agent, durable log less often) and
in-process recovery. Live progress is read from the trainer's JSON-lines progress file. Partway (``--kill-at``)
one PS is killed with SIGKILL; its agent restarts it, the trainer sees the failure, has every PS restarted
(``POST /new-generation``), restores from the memory tier and trains to the end. Then a summary, ``report.json``
and ``timeline.png`` (steps over time, fault and recovery marked) are written to the demo folder. Exit 0 only
when training reached the target and the restore after the fault came from a checkpoint.

``--quick``: the earlier demo, no cluster and no TensorFlow: the durable log alone (incremental checkpoints of a
numpy model written, listed, verified and restored bit for bit).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from psguard.agent.process.launcher import AgentProcess, LaunchError, ProgressReader, write_cluster
from psguard.benchmarks.common import back_to_normal, seconds_per_step
from psguard.run_folder import claim_folder
from psguard.store import CheckpointInfo, Store
from psguard.tensors import Full, Rows, TensorUpdate


def say(msg: str) -> None:
    print(msg, flush=True)


class SampleModel:
    """Two embedding tables updated on the rows a batch touches, and dense weights updated every step."""

    def __init__(self, users: int, items: int, dim: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {
            "model/user_embedding": self.rng.standard_normal((users, dim), dtype=np.float32) * 0.05,
            "model/item_embedding": self.rng.standard_normal((items, dim), dtype=np.float32) * 0.05,
            "model/dense/kernel": self.rng.standard_normal((2 * dim, 1), dtype=np.float32),
            "optimizer/iterations": np.array(0, np.int64),
        }
        self.touched: dict[str, set[int]] = {"model/user_embedding": set(), "model/item_embedding": set()}

    def train_step(self, batch: int) -> None:
        for name in self.touched:
            table = self.tensors[name]
            ids = np.unique(self.rng.zipf(1.3, size=batch) % table.shape[0])
            table[ids] -= 0.01 * self.rng.standard_normal((len(ids), table.shape[1]), dtype=np.float32)
            self.touched[name].update(ids.tolist())
        self.tensors["model/dense/kernel"] *= np.float32(0.999)
        self.tensors["optimizer/iterations"] = self.tensors["optimizer/iterations"] + 1

    def capture(self, full: bool) -> dict[str, TensorUpdate]:
        out: dict[str, TensorUpdate] = {}
        for name, value in self.tensors.items():
            if name in self.touched and not full:
                ids = np.array(sorted(self.touched[name]), dtype=np.int64)
                out[name] = Rows(ids, value[ids].copy(), value.shape)
            else:
                out[name] = Full(value.copy())
        for touched in self.touched.values():
            touched.clear()
        return out


def run_quick(directory: Path, steps: int, every: int, new_base_every: int, users: int) -> dict[str, object]:
    directory = claim_folder(directory, "psguard demo")
    store_dir = directory / "store"
    say(f"psguard demo: training a sample recommendation model, checkpointing to {store_dir}")
    model = SampleModel(users=users, items=users // 4, dim=32, seed=0)
    infos: list[CheckpointInfo] = []
    stalls: list[float] = []
    with Store.open(str(store_dir)) as store:
        parent: str | None = None
        for step in range(1, steps + 1):
            model.train_step(batch=2048)
            if step % every:
                continue
            full = parent is None or len(infos) % new_base_every == 0
            t0 = time.perf_counter()
            updates = model.capture(full)
            stalls.append(time.perf_counter() - t0)
            info = store.save(step, updates, parent=None if full else parent)
            parent = info.id
            infos.append(info)
            say(
                f"  step {step:5d}: {info.kind:5} checkpoint {info.id}  "
                f"{info.stored_bytes / 2**20:7.2f} MiB written of {info.logical_bytes / 2**20:.1f} MiB"
            )
        say("\n$ psguard ls " + str(store_dir))
        listing = store.checkpoints()
        for i in listing:
            say(f"  step {i.step:5d}  {i.kind:5}  {i.id}  parent={i.parent or '-'}")
        say("\nverifying every checkpoint (size, CRC32C and SHA-256 of every chunk)...")
        reports = [store.verify(i.id) for i in listing]
        for r in reports:
            say(f"  {r.checkpoint}: {'ok' if r.ok else 'CORRUPT'} ({r.chunks_checked} chunks)")
        restored = store.load_latest()
        identical = all(
            restored.tensors[k].tobytes() == np.asarray(v).tobytes() and restored.tensors[k].dtype == v.dtype
            for k, v in model.tensors.items()
        )
        say(f"\nrestored step {restored.info.step}: bit-identical to the live model: {identical}")
    full_bytes = sum(i.stored_bytes for i in infos if i.kind == "full")
    delta_bytes = sum(i.stored_bytes for i in infos if i.kind == "delta")
    deltas = sum(1 for i in infos if i.kind == "delta")
    summary: dict[str, object] = {
        "checkpoints": len(infos),
        "full": len(infos) - deltas,
        "deltas": deltas,
        "bytes_full": full_bytes,
        "bytes_deltas": delta_bytes,
        "mean_delta_fraction": (delta_bytes / deltas) / (full_bytes / (len(infos) - deltas)) if deltas else None,
        "verified": all(r.ok for r in reports),
        "restored_identical": identical,
        "mean_capture_seconds": float(np.mean(stalls)),
    }
    (directory / "report.json").write_text(json.dumps(summary, indent=2))
    say(f"\nsummary: {json.dumps(summary)}\nreport written to {directory / 'report.json'}")
    return summary


# ------------------------------------------------------------------------------------------------ full demo
DemoError = LaunchError  # the demo could not go on (an agent died, a deadline passed)


@dataclass
class DemoRun:
    """What the parent saw: every progress event, plus its own kill."""

    events: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = 0.0
    killed_at: float | None = None
    killed_step: int | None = None
    killed_pid: int | None = None
    names: dict[str, str] = field(default_factory=dict)  # agent URL -> task name

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


def _rate(events: list[dict[str, Any]], window: float = 5.0) -> float:
    steps = [e for e in events if e["event"] == "step"]
    if len(steps) < 2:
        return 0.0
    last = steps[-1]
    if time.time() - last["t"] > 2.0:  # no step for a while: training is stalled (a fault, a recovery)
        return 0.0
    first = next((e for e in steps if e["t"] >= last["t"] - window), steps[0])
    if first is last:
        first = steps[-2]
    dt = last["t"] - first["t"]
    return max(0, last["step"] - first["step"]) / dt if dt > 0 else 0.0


def _show(event: dict[str, Any], run: DemoRun) -> None:
    kind, at = event["event"], event["t"] - run.started_at
    if kind == "start":
        say(f"[{at:6.1f}s] trainer started (pid {event['pid']}): target {event['target']} steps, memory tier every "
            f"{event['memory_every']} steps, durable every {event['durable_every']}")  # fmt: skip
    elif kind == "failure":
        say(f"[{at:6.1f}s] trainer saw the failure at step {event['seen']} (last memory checkpoint "
            f"{event['memory']}, durable {event['durable']})")  # fmt: skip
    elif kind == "ps-restarted":
        peers = event.get("peers") or {}
        outcome = ", ".join(f"{run.names.get(url, url)} {what}" for url, what in peers.items() if "worker" not in what)
        say(f"[{at:6.1f}s] new generation: {outcome} ({event['seconds'] or 0:.1f}s)")
    elif kind == "restored" and run.killed_at is not None:
        say(f"[{at:6.1f}s] restored step {event['step']} from the {event['source']} tier")
    elif kind == "recovery":
        say(f"[{at:6.1f}s] recovered in process in {event['seconds']:.1f}s; training goes on")
    elif kind == "done":
        say(f"[{at:6.1f}s] training finished at step {event['step']}")


def _progress_line(run: DemoRun, target: int) -> str:
    steps = run.of("step")
    last: dict[str, Any] = steps[-1] if steps else {"step": 0, "memory": None, "durable": None, "t": time.time()}
    mem = "-" if last["memory"] is None else str(last["memory"])
    dur = "-" if last["durable"] is None else str(last["durable"])
    recovering = run.killed_at is not None and not run.of("recovery")
    note = "  (training stalled: recovering)" if recovering and _rate(run.events) == 0 else ""
    return (
        f"[{time.time() - run.started_at:6.1f}s] step {last['step']:5d}/{target}  {_rate(run.events):5.1f} steps/s  "
        f"last checkpoint: memory @{mem}, durable @{dur}{note}"
    )


def _summarise(run: DemoRun, target: int, store: str, workers: int, wall: float) -> dict[str, Any]:
    saves = run.of("save")
    restored = [e for e in run.of("restored") if run.killed_at is not None and e["t"] >= run.killed_at]
    failure = run.of("failure")
    recovery = run.of("recovery")
    done = run.of("done")
    resumed = None
    if restored:
        resumed = next(
            (e for e in run.of("step") if e["t"] > restored[0]["t"] and e["step"] > restored[0]["step"]), None
        )
    stalls = {tier: [e["stall"] for e in saves if e["tier"] == tier] for tier in ("memory", "durable")}
    seen = failure[0]["seen"] if failure else None
    rec: dict[str, Any] | None = None
    if run.killed_at is not None:
        rec = {
            "killed": "ps:0",
            "killed_pid": run.killed_pid,
            "killed_at_step": run.killed_step,
            "failure_seen_at_step": seen,
            "source": restored[0]["source"] if restored else None,
            "restored_step": restored[0]["step"] if restored else None,
            "lost_steps": seen - restored[0]["step"] if restored and seen is not None else None,
            "recovery_seconds": recovery[0]["seconds"] if recovery else None,
            "kill_to_restored_seconds": restored[0]["t"] - run.killed_at if restored else None,
            "kill_to_training_seconds": resumed["t"] - run.killed_at if resumed else None,
            "kill_to_normal_speed_seconds": _since_kill(run, _normal_speed_at(run, restored[0]) if restored else None),
        }
    start = run.of("start")
    return {
        "cluster": {"ps": 2, "workers": workers, "chief": 1, "every_task_under_psguard_agent": True},
        "store": store,
        "target_steps": target,
        "final_step": done[0]["step"] if done else None,
        "reached_target": bool(done) and done[0]["step"] >= target,
        "wall_seconds": wall,
        "policy": {k: start[0][k] for k in ("memory_every", "durable_every", "chunk")} if start else None,
        "checkpoints": {tier: len(v) for tier, v in stalls.items()},
        "stall_seconds_per_save": {
            tier: {"mean": float(np.mean(v)), "max": float(np.max(v))} if v else None for tier, v in stalls.items()
        },
        # The durable lag bound's price (psguard.policy.lag): what the durable saves waited for their commits.
        "durable_hold_seconds": _holds([e.get("hold", 0.0) for e in saves if e["tier"] == "durable"]),
        "recovery": rec,
    }


def _holds(holds: list[float]) -> dict[str, float] | None:
    return {"total": float(np.sum(holds)), "max": float(np.max(holds))} if holds else None


def _since_kill(run: DemoRun, t: float | None) -> float | None:
    return None if t is None or run.killed_at is None else t - run.killed_at


def _normal_speed_at(run: DemoRun, restored: dict[str, Any]) -> float | None:
    """When training was back at normal speed after the restore (None: never), the first capture after the
    restore included: that is where a recovery used to hide seconds of tracing."""
    assert run.killed_at is not None
    steps = run.of("step")
    before = [e for e in steps if e["t"] < run.killed_at and e["step"] > 5]  # the first steps trace
    normal = seconds_per_step((a["t"], b["t"], b["step"] - a["step"]) for a, b in itertools.pairwise(before))
    after = [restored, *(e for e in steps if e["t"] > restored["t"])]
    captured = [e["t"] for e in run.of("op") if e["type"] == "ok" and e["f"] == "capture" and e["t"] > restored["t"]]
    return back_to_normal(
        ((a["t"], b["t"], b["step"] - a["step"]) for a, b in itertools.pairwise(after)),
        normal,
        not_before=captured[0] if captured else restored["t"],
    )


def _timeline(run: DemoRun, report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = run.started_at
    steps = run.of("step")
    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    # Steps restart from the restored step after the fault: draw each generation as its own line.
    xs: list[float] = []
    ys: list[int] = []
    first_line = True
    for e in steps:
        if ys and e["step"] < ys[-1]:
            ax.plot(xs, ys, color="tab:blue", lw=1.8, label="training step" if first_line else None)
            first_line = False
            xs, ys = [], []
        xs.append(e["t"] - t0)
        ys.append(e["step"])
    if xs:
        ax.plot(xs, ys, color="tab:blue", lw=1.8, label="training step" if first_line else None)
    for tier, marker, color in (("memory", "|", "tab:green"), ("durable", "D", "tab:purple")):
        saves = [e for e in run.of("save") if e["tier"] == tier]
        if saves:
            ax.scatter(
                [e["t"] - t0 for e in saves],
                [e["step"] for e in saves],
                marker=marker,
                color=color,
                s=60 if tier == "memory" else 30,
                zorder=3,
                label=f"{tier} checkpoint ({len(saves)})",
            )
    rec = report.get("recovery") or {}
    if run.killed_at is not None:
        ax.axvline(run.killed_at - t0, color="tab:red", ls="--", lw=1.5, label=f"kill -9 ps:0 (step {run.killed_step})")
        restored = [e for e in run.of("restored") if e["t"] >= run.killed_at]
        if restored:
            r = restored[0]
            normal = rec.get("kill_to_normal_speed_seconds")
            if normal is not None:
                ax.axvspan(run.killed_at - t0, run.killed_at - t0 + normal, color="tab:red", alpha=0.12,
                           label=f"recovery: kill to normal speed ({normal:.1f}s)")  # fmt: skip
            ax.scatter([r["t"] - t0], [r["step"]], marker="*", s=180, color="tab:orange", zorder=4,
                       label=f"restored step {r['step']} from {r['source']} tier "
                       f"(lost {rec.get('lost_steps')} steps)")  # fmt: skip
    ax.set_xlabel("seconds since the trainer started")
    ax.set_ylabel("training step")
    ax.set_title(f"psguard demo: 2 PS, {report['cluster']['workers']} worker(s), chief, all under psguard agent")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@dataclass(frozen=True)
class _Cluster:
    """The demo's agents: the PS's (the first one is killed), then the workers', then the chief's."""

    ps: list[AgentProcess]
    chief: AgentProcess


def _start_agents(
    directory: Path, store_url: str, cluster: Path, workers: int, trainer: list[str], agents: list[AgentProcess]
) -> _Cluster:
    """Start every task's agent, the chief's last (it runs ``trainer`` and names the others as its peers); each is
    added to ``agents`` as soon as it runs, for the caller to stop whatever happens."""
    base = ["--cluster", str(cluster)]
    ps = [
        AgentProcess(
            directory / "agents",
            f"ps{i}",
            [
                "--role",
                "ps",
                "--index",
                str(i),
                *base,
                *("--spool", str(directory / f"ps{i}-shards")),
                *("--store", store_url),
            ],
        )
        for i in range(2)
    ]
    agents += ps
    agents += [
        AgentProcess(directory / "agents", f"worker{i}", ["--role", "worker", "--index", str(i), *base])
        for i in range(workers)
    ]
    peers = [arg for a in agents for arg in ("--peer", a.wait_url(120))]
    chief_args = ["--role", "chief", "--index", "0", *base, "--store", store_url]
    chief_args += ["--spool", str(directory / "spool"), *peers]
    chief = AgentProcess(directory / "agents", "chief", chief_args, trainer)
    agents.append(chief)
    return _Cluster(ps, chief)


def _watch(run: DemoRun, progress: Path, cluster: _Cluster, steps: int, timeout: float) -> None:
    """Follow the trainer's progress until its agent exits: show its events, a progress line every 2 s, and kill
    the first PS when the trainer says it may (its ``kill`` event)."""
    reader = ProgressReader(progress)
    run.started_at = time.time()
    last_line = 0.0
    deadline = time.monotonic() + timeout
    while True:
        for e in reader.read():
            if e["event"] == "start":
                run.started_at = e["t"]
            run.events.append(e)
            _show(e, run)
            if e["event"] == "kill" and run.killed_at is None:
                _kill_ps(run, cluster.ps[0], e)
        if run.of("step") and not run.of("done") and time.time() - last_line >= 2.0:
            say(_progress_line(run, steps))
            last_line = time.time()
        code = cluster.chief.proc.poll()
        if code is not None:
            run.events += reader.read()
            if code != 0:
                raise DemoError(f"the chief's agent exited {code}:\n{cluster.chief.log_tail()}")
            return
        if time.monotonic() > deadline:
            raise DemoError(f"training did not finish within {timeout:.0f}s")
        time.sleep(0.1)


def _kill_ps(run: DemoRun, ps: AgentProcess, event: dict[str, Any]) -> None:
    pid = int(ps.status()["pid"])
    os.kill(pid, signal.SIGKILL)
    # The trainer may have gone on since it asked: the step it last reported is the one killed at.
    step = max([event["step"], *(s["step"] for s in run.of("step"))])
    run.killed_at, run.killed_step, run.killed_pid = time.time(), step, pid
    say(f"[{run.killed_at - run.started_at:6.1f}s] >>> kill -9 ps:0 (pid {pid}) at step {step}")


def run_cluster(
    directory: Path,
    *,
    store: str | None,
    steps: int,
    kill_at: int,
    workers: int,
    memory_every: int,
    durable_every: int,
    timeout: float,
) -> tuple[dict[str, Any], bool]:
    """Run the full demo in ``directory`` (recreated if a psguard run made it, see :func:`claim_folder`); return
    the report and whether it succeeded."""
    directory = claim_folder(directory, "psguard demo")
    store_url = store or str(directory / "store")
    progress = directory / "progress.jsonl"
    cluster_file, _ = write_cluster(directory, ps=2, workers=workers)
    say(
        f"psguard demo: cluster {directory / 'cluster.json'}: 2 PS, {workers} worker(s), chief; "
        "each under psguard agent"
    )
    say(f"  store: {store_url}   agents' logs: {directory / 'agents'}/*/agent.log")
    agents: list[AgentProcess] = []
    run = DemoRun()
    t_wall = time.monotonic()
    try:
        trainer = [sys.executable, "-m", "psguard.demo_trainer", "--store", store_url, "--progress", str(progress)]
        trainer += ["--steps", str(steps), "--kill-at", str(kill_at)]
        trainer += ["--memory-every", str(memory_every), "--durable-every", str(durable_every)]
        cluster = _start_agents(directory, store_url, cluster_file, workers, trainer, agents)
        run.names = {a.wait_url(120): a.name for a in agents}
        say("  agents: " + ", ".join(f"{a.name} {a.wait_url(120)}" for a in agents))
        say("  waiting for the PS and worker servers and the trainer (TensorFlow starts in each)...")
        _watch(run, progress, cluster, steps, timeout)
    finally:
        for agent in reversed(agents):  # the chief first (drains its persister), then workers, then PS
            agent.stop()
    wall = time.monotonic() - t_wall
    report = _summarise(run, steps, store_url, workers, wall)
    rec = report["recovery"]
    ok = bool(report["reached_target"]) and rec is not None and rec["source"] in ("memory", "durable")
    report["ok"] = ok
    (directory / "report.json").write_text(json.dumps(report, indent=2))
    _timeline(run, report, directory / "timeline.png")
    _say_summary(report, steps, wall, directory)
    return report, ok


def _say_summary(report: dict[str, Any], steps: int, wall: float, directory: Path) -> None:
    """The report for people: steps, checkpoints, stalls, the fault and its recovery, where the files are."""
    rec = report["recovery"]
    say("\nsummary")
    say(
        f"  steps:        {report['final_step']} of {steps} "
        f"({'reached' if report['reached_target'] else 'NOT reached'})"
    )
    counts = report["checkpoints"]
    say(f"  checkpoints:  memory tier only {counts['memory']}, durable {counts['durable']} (also in the memory tier)")
    for tier, s in report["stall_seconds_per_save"].items():
        if s:
            say(f"  stall/save:   {tier:7} mean {s['mean'] * 1000:6.1f} ms, max {s['max'] * 1000:6.1f} ms")
    if (hold := report["durable_hold_seconds"]) is not None:
        say(
            f"  durable lag:  the durable saves waited {hold['total']:.2f}s in all for their commits "
            f"(max {hold['max'] * 1000:.0f} ms; the policy's durable_lag)"
        )
    if rec is None:
        say("  recovery:     no fault was injected (training ended before --kill-at)")
    else:
        say(
            f"  fault:        kill -9 ps:0 at step {rec['killed_at_step']}; "
            f"failure seen at step {rec['failure_seen_at_step']}"
        )
        say(
            f"  restore:      step {rec['restored_step']} from the {rec['source']} tier; lost steps {rec['lost_steps']}"
        )
        if rec["recovery_seconds"] is not None:
            resumed = rec["kill_to_training_seconds"]
            normal = rec["kill_to_normal_speed_seconds"]
            say(
                f"  recovery:     {rec['recovery_seconds']:.1f}s from the failure seen to restored (in process); "
                f"{float('nan') if resumed is None else resumed:.1f}s from the kill to the next training step; "
                f"{float('nan') if normal is None else normal:.1f}s to normal speed (first capture included)"
            )
    say(f"  wall time:    {wall:.0f}s")
    say(f"  report:       {directory / 'report.json'}\n  timeline:     {directory / 'timeline.png'}")
    say("psguard demo: OK" if report["ok"] else "psguard demo: FAILED")


def cmd(args: argparse.Namespace) -> int:
    if args.quick:
        summary = run_quick(Path(args.dir), args.steps or 200, args.every, args.new_base_every, args.users)
        return 0 if summary["verified"] and summary["restored_identical"] else 1
    steps = args.steps or 1000
    kill_at = args.kill_at if args.kill_at is not None else steps // 3
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop everything on SIGTERM too
    try:
        _, ok = run_cluster(
            Path(args.dir),
            store=args.store,
            steps=steps,
            kill_at=kill_at,
            workers=args.workers,
            memory_every=args.memory_every,
            durable_every=args.durable_every,
            timeout=args.timeout,
        )
    except DemoError as e:
        print(f"psguard demo: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("psguard demo: interrupted; every process it started was stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if ok else 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="a local PS cluster under psguard agents: train, kill a PS, recover automatically, report",
        description=(
            "Start 2 PS, the workers and the chief, each under psguard agent; train a recommendation model with "
            "memory-tier and durable checkpoints; kill -9 a PS at --kill-at; recover; write report.json and "
            "timeline.png into --dir. --quick: the durable log alone (no cluster, no TensorFlow)."
        ),
    )
    p.add_argument(
        "--dir",
        default="psguard-demo",
        help="working folder (default ./psguard-demo): new, empty, or made by an earlier psguard run (then emptied)",
    )
    p.add_argument("--store", metavar="URL", help="durable log: a path, file://, s3://, hdfs:// (default DIR/store)")
    p.add_argument("--steps", type=int, help="target step (default 1000; --quick: 200)")
    p.add_argument("--kill-at", type=int, help="kill -9 ps:0 at the first save from this step on (default steps/3)")
    p.add_argument("--workers", type=int, default=2, choices=(1, 2), help="worker tasks (default 2)")
    p.add_argument("--memory-every", type=int, default=10, help="memory-tier checkpoint every N steps")
    p.add_argument("--durable-every", type=int, default=100, help="durable checkpoint every N steps")
    p.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
    p.add_argument("--quick", action="store_true", help="the durable log alone: no cluster, no TensorFlow")
    p.add_argument("--every", type=int, default=20, help="--quick: checkpoint every N steps")
    p.add_argument("--new-base-every", type=int, default=5, help="--quick: a full checkpoint every N checkpoints")
    p.add_argument("--users", type=int, default=200_000, help="--quick: rows of the user table")
    p.set_defaults(func=cmd)
