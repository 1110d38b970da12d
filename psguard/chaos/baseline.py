"""``psguard chaos run --baseline``: the same scenario on the plain-TF practice, reported beside psguard.

The baseline is what a PS job does without psguard: servers started by a script, a trainer that saves a
``tf.train.CheckpointManager`` checkpoint every ``durable_every`` steps (psguard's durable cadence, so the two
write to storage equally often), and a script that restarts the *whole job* (every server and a new trainer,
which restores the latest checkpoint) whenever a task dies or the trainer exits with an error. The nemesis
fires the same faults at the same steps. A node loss (``kill-agent`` / ``terminate-agent``: on psguard's side the
agent dies and its task with it) is, without an agent, the task's own death: kill -9 / SIGTERM of that process
(:class:`BaselineNemesis`), after which the script restarts the whole job as for any dead task. On a case with a
store server (S3, GCS, HDFS) TF's checkpoints live on a server of the same kind, behind the same proxies
(``baseline_trainer --mirror``): its saves pay the same network and its store faults (down, errors, slow) are the
same. Faults that need an agent alive (``pause-agent``: the task runs on) or a psguard store (chunk damage) have no
baseline equivalent and are recorded as not injected. A network fault on a PS (partition,
delay, drop) puts the baseline's PS behind the harness's proxies as psguard's are (:meth:`_Run.proxy_ps`), so both
sides pay the proxy and both are cut off at their fault's step. The same checkers judge the baseline's history;
the side-by-side report compares goodput, recovery seconds and lost steps per fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from psguard.agent.process.launcher import write_cluster
from psguard.chaos.nemesis import Nemesis
from psguard.chaos.runner import HARNESS, RunResult, _Run, run_scenario
from psguard.chaos.scenario import Fault, Scenario
from psguard.handoff.contract import PLAIN_TF_SERVERS, QUIET_TENSORFLOW

__all__ = ["BaselineNemesis", "run_side_by_side"]

#: The baseline's equivalent of each agent fault that takes the task down with the agent.
TASK_FAULT_FOR: dict[str, Literal["kill", "terminate"]] = {"kill-agent": "kill", "terminate-agent": "terminate"}


class _Task:
    """One plain process of the baseline job (a TF server or the trainer), in its own process group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        return {"pid": self.proc.pid if self.proc.poll() is None else None, "agent_pid": None}

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)  # a frozen process cannot handle SIGTERM
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self._log.closed:
            self._log.close()


class _Handle:
    """The nemesis's view of a task across job restarts: always the current process of that name."""

    def __init__(self, run: BaselineRun, name: str) -> None:
        self._run, self._name = run, name

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        return self._run.tasks[self._name].status(timeout)


class BaselineNemesis(Nemesis):
    """The nemesis of the plain-TF job: an agent fault that takes its task down becomes that task's own death.

    ``kill-agent`` of ``ps:N`` is a PS node lost; without psguard that is the PS process dying (kill -9), and
    ``terminate-agent`` its SIGTERM. The fault is recorded as what was done (``kill`` / ``terminate``, with
    ``baseline_for`` naming the scenario's fault), so ``faults-injected`` sees it fired and the lost steps are
    judged as for a killed task (the baseline's bound is its durable cadence anyway). The script restarts the
    whole job at once, as for any dead task, not after the fault's ``duration``: the restart a plain-TF job gets.
    """

    def _await_moment(self, moment: str, *, asked: bool = False) -> dict[str, Any]:
        """Plain TF has no agent whose persister writes a first base, persists, compacts or collects garbage: such
        a fault fires at its step (or time), as the scenario's step says. A fault "during a durable-commit" fires
        at TF's own save, synchronous in its trainer, once the trainer has invoked one at or after the fault's
        step (``asked``: in the tick that made it due); a job that ends first missed it."""
        if moment == "durable-commit":
            return self._await_durable_ask(asked)
        return {}

    def _fire_on_task(self, fault: Fault, target: str, base: dict[str, Any]) -> None:
        action = TASK_FAULT_FOR.get(fault.action)
        if action is None:
            super()._fire_on_task(fault, target, base)
            return
        super()._fire_on_task(replace(fault, action=action), target, {**base, "baseline_for": fault.action})


class BaselineRun(_Run):
    mode = "baseline"
    nemesis_class = BaselineNemesis

    def training_record(self) -> dict[str, Any]:
        t = super().training_record()
        t["memory_every"] = t["durable_every"]  # no memory tier: the durable cadence is its bound
        return t

    def start_storage(self) -> None:
        self.mirror_url: str | None = None
        if self.scenario.storage.kind != "local":  # the case's store server, proxies and fault points, as psguard's
            super().start_storage()
            self.mirror_url = self.store_url
        self.store_dir = None  # not a psguard store: no chunk damage
        self.ckpt_dir = self.dir / "tf-ckpt"
        self.store_url = str(self.ckpt_dir)

    def start_cluster(self) -> None:
        s = self.scenario
        self.cluster_path, self.spec = write_cluster(self.dir, ps=s.cluster.ps, workers=s.cluster.workers)
        self.ports += [int(a.rsplit(":", 1)[1]) for addrs in self.spec.values() for a in addrs]
        # The PS behind the harness's proxies as on psguard's side (the chief and the workers reach them there):
        # the same cost on both sides, and the partition (or delay, or drop) reaches plain TF too. The proxies
        # outlive the job's restarts, as a network does.
        self.others_spec = self.proxy_ps(self.spec) if s.needs_proxy else self.spec
        self.tasks: dict[str, _Task] = {}
        self.restarts = 0
        (self.dir / "logs").mkdir(exist_ok=True)
        self._start_job()

    def _start_job(self) -> None:
        # A plain-TF job's servers run `import tensorflow`; psguard's lean start is not the baseline's.
        env = dict(os.environ, **QUIET_TENSORFLOW, **PLAIN_TF_SERVERS)
        logs = self.dir / "logs"
        for role, count in (("ps", len(self.spec["ps"])), ("worker", len(self.spec["worker"]))):
            spec_json = json.dumps(self.spec if role == "ps" else self.others_spec, sort_keys=True)
            for i in range(count):
                argv = [sys.executable, "-m", "psguard.agent.process.tf_server", "--cluster-spec", spec_json,
                        "--job", role, "--index", str(i), "--parent-pid", str(os.getpid())]  # fmt: skip
                self.tasks[f"{role}{i}"] = _Task(f"{role}{i}", argv, env, logs / f"{role}{i}.log")
        t = self.scenario.training
        argv = [sys.executable, "-m", "psguard.chaos.baseline_trainer", "--store", self.store_url]
        argv += ["--progress", str(self.dir / "progress.jsonl"), "--steps", str(t.steps), "--chunk", str(t.chunk)]
        argv += ["--durable-every", str(t.durable_every), "--vocab", str(t.vocab), "--dim", str(t.dim)]
        argv += ["--batch", str(t.batch), "--seed", str(self.seed), "--durable-min-seconds", str(t.durable_min_seconds)]
        argv += ["--durable-cron", t.durable_cron] if t.durable_cron is not None else []
        argv += ["--mirror", self.mirror_url] if self.mirror_url is not None else []
        argv += ["--servers", ",".join(self.spec["ps"] + self.spec["worker"])]  # not the proxies: the servers
        tf_config = {"cluster": self.others_spec, "task": {"type": "chief", "index": 0}, "rpc_layer": "grpc"}
        chief_env = dict(env, **self.storage_env, TF_CONFIG=json.dumps(tf_config))
        self.tasks["chief"] = _Task("chief", argv, chief_env, logs / "chief.log")

    def targets(self) -> dict[str, Any]:
        return {name: _Handle(self, name) for name in self.tasks}

    def job_exit(self) -> int | None:
        code = self.tasks["chief"].proc.poll()
        return 0 if code == 0 else None

    def supervise(self) -> None:
        """The script: any task gone or the trainer failed -> stop everything, start the whole job again."""
        dead = [name for name, task in self.tasks.items() if task.proc.poll() not in (None, 0)]
        if not dead:
            return
        value = {"dead": dead, "restart": self.restarts + 1}
        self.history.append(HARNESS, "invoke", "restart-job", value)
        for task in self.tasks.values():
            task.stop(timeout=5)
        self.restarts += 1
        self._start_job()
        self.history.append(HARNESS, "ok", "restart-job", value)

    def stop_all(self) -> None:
        nemesis = getattr(self, "nemesis", None)
        if nemesis is not None:
            nemesis.heal_all()
        for task in getattr(self, "tasks", {}).values():
            task.stop()
        self.close_proxies()

    def list_store(self) -> dict[str, Any] | None:
        """TF's checkpoints where they are kept: the store (ids are their paths in the local folder, as the saver
        gave them), or the folder."""
        if self.mirror_url is not None:
            from psguard.storage import open_backend

            backend = open_backend(self.mirror_url, self.storage_options)
            try:
                names = [k for k in backend.keys("") if k.startswith("ckpt-")]
            finally:
                backend.close()
        else:
            names = [p.name for p in self.ckpt_dir.glob("ckpt-*")]
        checkpoints = []
        for index in sorted(n for n in names if n.endswith(".index")):
            prefix = index[: -len(".index")]
            data = [n for n in names if n.startswith(prefix + ".data-")]
            step = int(prefix.split("-", 1)[1])
            checkpoints.append({"id": str(self.ckpt_dir / prefix), "step": step, "kind": "tf", "parent": None,
                                "ok": bool(data), "problems": [] if data else ["no data file"]})  # fmt: skip
        return {"checkpoints": checkpoints, "journal": [], "damaged_chunks": {}}


def run_side_by_side(
    scenario: Scenario, directory: Path, *, seed: int = 0, say: Callable[[str], None] = print
) -> RunResult:
    """psguard and the baseline on the same scenario and seed; a combined report in ``directory``."""
    from psguard.chaos.report import write_side_by_side

    directory.mkdir(parents=True, exist_ok=True)
    ours = run_scenario(scenario, directory / "psguard", seed=seed, say=say)
    say(f"chaos {scenario.name}: the same scenario on the plain-TF baseline")
    base = run_scenario(scenario, directory / "baseline", seed=seed, say=say, run_class=BaselineRun)
    report = write_side_by_side(directory, ours.report, base.report)
    return RunResult(directory, ours.verdicts, ours.overall, report)
