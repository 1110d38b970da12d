"""The plain-TF side of ``psguard bench recovery``: ``tf.train.CheckpointManager`` every K steps; when PS 0 is
killed the chief exits, and a "script" (this process) stops the job and starts it again, servers and chief at
once, the new chief restoring the last save (:mod:`psguard.benchmarks.recovery` says what each figure means).

When the chief itself is killed (``fault="chief"``) the script starts a new chief only, at once, against the
servers still running, as a job whose chief pod alone restarts: TensorFlow lets a new coordinator connect to
them (each client gets its own context on a server), so nothing else needs to restart. What that leaves behind
(the dead chief's variables stay on each PS until its context's keep-alive runs out) is plain TF's own cost.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from psguard.benchmarks.common import RssWatch, progress
from psguard.benchmarks.recovery_job import (
    NUM_WORKERS,
    POLL,
    Params,
    Records,
    child,
    growth_after_build,
    measure,
    read_records,
)
from psguard.handoff.contract import PLAIN_TF_SERVERS, QUIET_TENSORFLOW
from psguard.testbed.cluster import LocalCluster

__all__ = ["Restart", "ServerStartError", "baseline_figures", "run_baseline"]


class ServerStartError(RuntimeError):
    """A server of the baseline's cluster died before the kill (its port taken by another job on the machine)."""


def run_baseline(p: Params, workdir: Path, attempts: int = 3) -> dict[str, Any]:
    """One plain-TF recovery; a run whose servers could not start is started again (at most ``attempts``)."""
    for attempt in range(1, attempts + 1):
        try:
            return _run_baseline(p, workdir)
        except ServerStartError as e:
            if attempt == attempts:
                raise
            progress(f"baseline: {str(e)[:300]}; starting the run again")
    raise AssertionError("unreachable")


def _run_baseline(p: Params, workdir: Path) -> dict[str, Any]:
    job = _Job(p, Path(tempfile.mkdtemp(prefix="tf-", dir=workdir)))
    try:
        restart = job.run()
    finally:
        job.stop()
    doc = baseline_figures(p, read_records(job.progress), restart)
    if not os.environ.get("PSGUARD_BENCH_KEEP"):  # set: keep the chiefs' logs and the progress records
        shutil.rmtree(job.work, ignore_errors=True)
    return doc


@dataclass(frozen=True)
class Restart:
    """When the restart script's steps ended (``time.time()``)."""

    exited_at: float  # the failed chief's exit (seen by the script)
    stopped_at: float  # every server of the job stopped (``fault="chief"``: none is; the exit)
    servers_at: float  # the new servers started, the new chief beside them (``fault="chief"``: the new chief)


def baseline_figures(p: Params, recs: Records, restart: Restart) -> dict[str, Any]:
    """The figures of :func:`measure`, the chief's memory and the phases of the restart."""
    kill_t = recs.first("kill")["t"]
    doc = measure(recs, kill_t, p, need_capture=False)
    restart_ready = next(d for d in recs.of("ready") if d["gen"] == 1)
    restore = recs.of("restore")[-1]
    # Each chief resets its peak mark after its model's build: the build's peak is in its restore record.
    with_build = [
        max(int(d["hwm"]), int(b["built_hwm"])) - int(r["rss"])
        for d, b, r in zip(recs.of("trainer-peak"), recs.of("restore"), recs.of("ready"), strict=True)
    ]
    if p.fault == "chief":  # nothing stopped: the exit seen, a new chief started (Python, TensorFlow), connected
        started = next(d for d in recs.of("started") if d["gen"] == 1)
        imported = next(d for d in recs.of("imported") if d["gen"] == 1)
        phases = {
            "detect_s": restart.exited_at - kill_t,
            "chief_start_s": restart_ready["t"] - restart.exited_at,
            "spawn_s": started["t"] - restart.exited_at,
            "import_s": imported["t"] - started["t"],
            "connect_s": restart_ready["t"] - imported["t"],
        }
    else:
        phases = {
            "detect_s": recs.first("failure")["t"] - kill_t,
            "chief_exit_s": restart.exited_at - recs.first("failure")["t"],
            "stop_job_s": restart.stopped_at - restart.exited_at,
            "servers_up_s": restart.servers_at - restart.stopped_at,
            "chief_start_s": restart_ready["t"] - restart.stopped_at,  # TF import, in parallel with the servers' start
        }
    doc.update(
        state_bytes=int(recs.first("state")["state_bytes"]),
        chief_rss_growth_bytes=growth_after_build(recs),
        chief_rss_growth_with_build_bytes=max(with_build),
        phases={
            **phases,
            "connect_build_s": float(restore["t0"]) - restart_ready["t"],
            "restore_s": float(restore["t1"]) - float(restore["t0"]),
            "first_step_s": doc["restore_end_to_first_step_s"],
        },
    )
    doc["chief_rss_growth_ratio"] = doc["chief_rss_growth_bytes"] / doc["state_bytes"]
    return doc


@dataclass
class _Job:
    """The plain-TF job of one run: its clusters (the first, then the restarted one) and chief processes."""

    p: Params
    work: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    clusters: list[LocalCluster] = field(default_factory=list)
    rss: RssWatch = field(default_factory=RssWatch)

    @property
    def progress(self) -> Path:
        return self.work / "progress.jsonl"

    def run(self) -> Restart:
        """Train until the chief fails, then the restart script: the whole job down, new servers and a new
        chief at once; until the new chief ends."""
        p = self.p
        cluster = LocalCluster(num_ps=p.num_ps, num_workers=NUM_WORKERS, env=PLAIN_TF_SERVERS).start()
        self.clusters.append(cluster)
        env = dict(
            os.environ, **QUIET_TENSORFLOW, TF_CONFIG=cluster.tf_config(), BENCH_PS0_PID=str(cluster.pids[("ps", 0)])
        )
        log1 = self.work / "chief-1.log"
        self.procs.append(self.start_chief("first", env, log1))
        self.wait(self.procs[-1], "baseline chief", log1, cluster)
        exited_at = time.time()
        if not read_records(self.progress).of("failure" if p.fault != "chief" else "kill"):
            raise RuntimeError(f"baseline chief exited {self.procs[-1].returncode}: {log1.read_text()[-3000:]}")
        if p.fault == "chief":  # only the chief restarts; the servers serve on
            env = dict(os.environ, **QUIET_TENSORFLOW, TF_CONFIG=cluster.tf_config())
            log2 = self.work / "chief-2.log"
            self.procs.append(self.start_chief("restart", env, log2))
            self.wait(self.procs[-1], "restarted baseline chief", log2, cluster)
            self.check_restarted(log2)
            return Restart(exited_at, exited_at, exited_at)
        cluster.stop()
        stopped_at = time.time()
        cluster = LocalCluster(num_ps=p.num_ps, num_workers=NUM_WORKERS, env=PLAIN_TF_SERVERS)
        self.clusters.append(cluster)
        env = dict(os.environ, **QUIET_TENSORFLOW, TF_CONFIG=cluster.tf_config())
        log2 = self.work / "chief-2.log"
        self.procs.append(self.start_chief("restart", env, log2))
        cluster.start()
        servers_at = time.time()
        self.wait(self.procs[-1], "restarted baseline chief", log2, cluster)
        self.check_restarted(log2)
        return Restart(exited_at, stopped_at, servers_at)

    def check_restarted(self, log: Path) -> None:
        if not [d for d in read_records(self.progress).of("step") if d["gen"] == 1]:
            code = self.procs[-1].returncode
            raise RuntimeError(f"restarted baseline chief exited {code}: {log.read_text()[-3000:]}")

    def start_chief(self, mode: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "w") as err:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(
                child("baseline_child", str(self.work), json.dumps(asdict(self.p)), mode, str(self.progress)),
                stdout=err,
                stderr=err,
                env=env,
            )

    def wait(self, proc: subprocess.Popen[bytes], what: str, log: Path, cluster: LocalCluster) -> None:
        deadline = time.monotonic() + self.p.timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: no end within {self.p.timeout}s; log {log}")
            prog = self.progress
            if not prog.exists() or "kill" not in prog.read_text():  # before the kill every server must live
                dead = [(j, i) for j, i in cluster.pids if not cluster.alive(j, i)]
                if dead:  # e.g. "Could not start gRPC server": another process took its free port meanwhile
                    raise ServerStartError(f"{what}: server {dead[0]} died: {cluster.log(*dead[0])[-600:]}")
            self.rss.sample()
            time.sleep(POLL)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for c in self.clusters:
            c.stop()
