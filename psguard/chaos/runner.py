"""``psguard chaos run``: storage, a cluster under agents, a training job and the nemesis; then the verdicts.

The order of a run, and why:

1. ``history.jsonl`` is created first and the run's parameters are its first operation: every later record
   can be judged against them, and a run that cannot write its history does not start.
2. The storage, then the PS and worker agents, then the chief's agent with the trainer (as in ``psguard demo``).
3. The loop: the trainer's ``op`` lines are copied into the history (with their own monotonic times), the
   nemesis fires the faults whose step or time has come and heals them after their duration. The loop ends when
   the chief's agent exits (the trainer reached its target) or the scenario's time limit is spent.
4. Every open fault is healed, every agent stopped (the chief's first: it drains its persister), then the
   store is read back whole (``final-store``: every checkpoint verified) and stopped, and the clean-up audited
   (``cleanup``: processes, ports, temporary files): both are operations of the history, so the checkers need
   nothing else. This runs in ``finally``: a failed or interrupted run still stops every process it started.
5. The checkers, ``report.json``, ``report.md`` and ``timeline.png``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from psguard.agent.process.launcher import (
    AGENT_CONFIG,
    AgentProcess,
    LaunchError,
    ProgressReader,
    with_peers,
    write_cluster,
)
from psguard.chaos.checkers import Verdict, check_all, overall
from psguard.chaos.history import HistoryError, HistoryWriter, Record, read_history
from psguard.chaos.nemesis import NEMESIS, Nemesis
from psguard.chaos.scenario import Scenario
from psguard.run_folder import claim_folder, drop_memory_folders, memory_folder
from psguard.testbed.procs import alive as pid_alive
from psguard.testbed.procs import descendants

__all__ = ["DEFAULT_JOB", "RunResult", "chief_config", "run_scenario"]

HARNESS = "harness"
DEFAULT_JOB = "psguard.demo_trainer:main"
_CLEANUP_WAIT = 15.0
#: The variable that points a store's clients (agents, trainer) at its endpoint, for the servers chaos runs start.
_ENDPOINT_ENV = {"s3": "AWS_ENDPOINT_URL", "gcs": "STORAGE_EMULATOR_HOST"}


@dataclass
class RunResult:
    directory: Path
    verdicts: dict[str, Verdict]
    overall: str
    report: dict[str, Any]


def _port_busy(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def chief_config(scenario: Scenario) -> str:
    """The chief's agent config: the launcher's, plus ``peers: {copies: full}`` (or ``parity``) when the scenario
    runs with peer copies and ``peers: {keep_survivors: true}`` when it keeps the PS that survive a failure."""
    peers: dict[str, object] = {}
    if scenario.peer_copies:
        peers["copies"] = "parity" if scenario.peer_copies == "parity" else "full"
    if scenario.keep_survivors:
        peers["keep_survivors"] = True
    return with_peers(AGENT_CONFIG, **peers)


def _job_command(job: str) -> list[str]:
    """``MODULE:FUNC`` called with the trainer's argv (the contract of :func:`psguard.demo_trainer.main`)."""
    module, _, func = job.partition(":")
    if not module or not func:
        raise LaunchError(f"--job: expected MODULE:FUNC (e.g. {DEFAULT_JOB}), got {job!r}")
    code = f"import sys, {module} as m; sys.exit(m.{func}(sys.argv[1:]))"
    return [sys.executable, "-c", code]


class _Run:
    """One run's mutable state; :func:`run_scenario` drives it."""

    def __init__(
        self,
        scenario: Scenario,
        directory: Path,
        *,
        seed: int,
        job: str,
        faults: bool,
        say: Callable[[str], None],
    ) -> None:
        self.scenario = scenario
        self.dir = directory
        self.seed = seed
        self.job = job
        self.say = say
        self.schedule = scenario.schedule(seed) if faults else []
        # The runner looks back only at the nemesis's records (the agents it killed, the chunks it damaged).
        self.history = HistoryWriter(directory / "history.jsonl", keep=frozenset({NEMESIS}))
        self.agents: dict[str, AgentProcess] = {}
        self.proxies: dict[str, Any] = {}
        self.store_errors: Any = None  # the HTTP proxy that answers the store's errors (a store-errors fault)
        self._dead_noted: set[tuple[str, int]] = set()
        self.pids_seen: set[int] = set()
        # Processes this one already ran (a test session's servers and clusters): not the run's, never killed.
        self._pids_before = descendants(os.getpid())
        self.ports: list[int] = []
        self.storage: Any = None
        self.store_url = ""
        self.storage_options: dict[str, Any] = {}
        self.storage_env: dict[str, str] = {}
        self.store_dir: Path | None = None
        # Each PS agent's part folder, on tmpfs as in a deployment (an emptyDir in memory): its tier files are on
        # only there, and a restore maps them. Removed at the end (run_scenario), whatever happened.
        self.part_dirs: dict[int, Path] = {}
        self.started_at: float | None = None
        self.step: int | None = None
        self.threads_before = {t.ident for t in threading.enumerate()}

    # ------------------------------------------------------------------------------------------ phases
    def record_run(self) -> None:
        s = self.scenario
        value = {
            "scenario": s.name,
            "proves": s.proves,
            "seed": self.seed,
            "job": self.job,
            "mode": self.mode,
            "target_step": s.training.steps,
            "training": self.training_record(),
            "peer_copies": s.peer_copies,  # how the checkers judge a PS node loss
            "keep_survivors": s.keep_survivors,
            "cluster": asdict(s.cluster),
            "storage": s.storage.kind,
            "liveness_seconds": s.checks.liveness,
            "loss_tolerance": s.checks.loss_tolerance,
            "time_limit": s.time_limit,
            "faults_scheduled": len(self.schedule),
            "schedule": [f.describe() for f in self.schedule],
            **self.run_extra(),
        }
        self.history.append(HARNESS, "invoke", "run", value)
        self.history.append(HARNESS, "ok", "run", value)

    def training_record(self) -> dict[str, Any]:
        return asdict(self.scenario.training)

    def run_extra(self) -> dict[str, Any]:
        """More of the run's parameters for its first record (a soak's duration and bounds)."""
        return {}

    def trainer_extra(self) -> list[str]:
        """More arguments for the trainer (a soak's finish file)."""
        return []

    def target_line(self) -> str:
        """Where the run's training ends, said once the cluster is up."""
        return f"training to step {self.scenario.training.steps}"

    def progress_line(self, fired: str, elapsed: float | None) -> str:
        """The line said every few seconds while the job trains."""
        return f"  step {self.step}/{self.scenario.training.steps}  faults fired {fired}"

    def on_tick(self, now: float, elapsed: float | None) -> None:
        """Called on every turn of the loop, after the nemesis (a soak samples resources and ends the run)."""

    def start_storage(self) -> None:
        kind = self.scenario.storage.kind
        if kind in ("s3", "gcs"):
            if kind == "s3":
                from psguard.testbed.s3 import SeaweedS3

                self.storage = SeaweedS3(self.dir / "s3", bucket="psguard-chaos")
            else:
                from psguard.testbed.gcs import FakeGcs

                self.storage = FakeGcs(self.dir / "gcs", bucket="psguard-chaos")
            self.storage.start()
            self.store_url = self.storage.url("job")
            self.storage_options = self.storage.storage_options  # the harness itself talks to the store directly
            self.ports.append(self.storage.port)
            self.storage_env = dict(self.storage.env)
            if self.scenario.needs_store_proxy:
                # The agents and the trainer reach the store through a proxy, where the nemesis adds latency or cuts.
                from psguard.chaos.proxy import TcpProxy
                from psguard.ports import free_ports

                proxy = TcpProxy(free_ports(1)[0], self.storage.port, name="store")
                self.proxies["store"] = proxy
                self.ports.append(proxy.listen_port)
                self.storage_env[_ENDPOINT_ENV[kind]] = f"http://127.0.0.1:{proxy.listen_port}"
            if self.scenario.needs_store_errors:
                # ... and (in front of that proxy, if any) through one that answers with the store's HTTP errors.
                from psguard.chaos.http_faults import HttpErrorProxy

                upstream = self.storage_env.get(_ENDPOINT_ENV[kind]) or f"http://127.0.0.1:{self.storage.port}"
                self.store_errors = HttpErrorProxy(upstream, dialect="gcs" if kind == "gcs" else "s3")
                self.ports.append(int(self.store_errors.endpoint_url.rsplit(":", 1)[1]))
                self.storage_env[_ENDPOINT_ENV[kind]] = self.store_errors.endpoint_url
        elif self.scenario.storage.kind == "hdfs":
            from psguard.testbed.hdfs import HdfsCluster

            self.storage = HdfsCluster(self.dir / "hdfs")
            self.storage.start()
            self.store_url = self.storage.url("/job")  # hdfs-native over the NameNode's RPC port
            self.ports += [self.storage.rpc_port, self.storage.http_port]
            self.storage_env = {"HADOOP_USER_NAME": self.storage.user}
        else:
            self.store_dir = self.dir / "store"
            self.store_url = str(self.store_dir)

    def start_cluster(self) -> None:
        s = self.scenario
        cluster, spec = write_cluster(self.dir, ps=s.cluster.ps, workers=s.cluster.workers)
        self.ports += [int(a.rsplit(":", 1)[1]) for addrs in spec.values() for a in addrs]
        env = dict(self.storage_env)
        base = ["--cluster", str(cluster)]
        others = base  # what the chief and the workers see
        if s.needs_proxy:
            path = self.dir / "cluster-proxied.json"
            path.write_text(json.dumps(self.proxy_ps(spec), indent=2))
            others = ["--cluster", str(path)]
        root = self.dir / "agents"
        for role, count in (("ps", s.cluster.ps), ("worker", s.cluster.workers)):
            for i in range(count):
                self.agents[f"{role}{i}"] = AgentProcess(
                    root,
                    f"{role}{i}",
                    [
                        "--role",
                        role,
                        "--index",
                        str(i),
                        *(base if role == "ps" else others),
                        *(["--spool", str(self.part_dir(i)), "--store", self.store_url] if role == "ps" else []),
                    ],
                    # Each task on a node of its own, as in a real job: peer copies never go to the same node.
                    env={**env, "PSGUARD_NODE": f"node-{role}{i}"} if s.peer_copies else env,
                )
        peers = [arg for a in self.agents.values() for arg in ("--peer", a.wait_url(180))]
        t = s.training
        trainer = _job_command(self.job)
        trainer += ["--store", self.store_url, "--progress", str(self.dir / "progress.jsonl"), "--fsync", "--digest"]
        trainer += ["--steps", str(t.steps), "--kill-at", str(t.steps), "--chunk", str(t.chunk)]
        trainer += ["--memory-every", str(t.memory_every), "--durable-every", str(t.durable_every)]
        trainer += ["--vocab", str(t.vocab), "--dim", str(t.dim), "--batch", str(t.batch), "--seed", str(self.seed)]
        if t.durable_min_seconds:
            trainer += ["--durable-min-seconds", str(t.durable_min_seconds)]
        if t.durable_cron is not None:
            trainer += ["--durable-cron", t.durable_cron]
        if t.new_base_after is not None:
            trainer += ["--new-base-after", str(t.new_base_after)]
        if t.hang_after is not None:
            trainer += ["--hang-after", str(t.hang_after)]
        if t.max_to_keep is not None:
            trainer += ["--max-to-keep", str(t.max_to_keep)]
        trainer += self.trainer_extra()
        chief_args = ["--role", "chief", "--index", "0", *others, "--store", self.store_url]
        chief_args += ["--spool", str(self.dir / "spool"), *peers]
        self.agents["chief"] = AgentProcess(root, "chief", chief_args, trainer, env=env, config=chief_config(s))
        for a in self.agents.values():
            url = a.wait_url(180)
            self.ports.append(int(url.rsplit(":", 1)[1]))

    def proxy_ps(self, spec: dict[str, list[str]]) -> dict[str, list[str]]:
        """The cluster as the chief and the workers see it when a network fault needs the PS behind proxies: each
        PS at a proxy of its own, where the nemesis cuts the network. The PS servers listen on their real ports
        (the spec they are given names them); only the others' spec names the proxies. Both sides of a case
        (psguard's and the baseline's) place them alike, so both pay their cost and both can be cut off."""
        from psguard.chaos.proxy import TcpProxy
        from psguard.ports import free_ports

        proxied = dict(spec)
        proxied["ps"] = [f"127.0.0.1:{p}" for p in free_ports(len(spec["ps"]))]
        for i, (real, fake) in enumerate(zip(spec["ps"], proxied["ps"], strict=True)):
            port, target = int(fake.rsplit(":", 1)[1]), int(real.rsplit(":", 1)[1])
            self.proxies[f"ps:{i}"] = TcpProxy(port, target, name=f"ps{i}")
            self.ports.append(port)
        return proxied

    def close_proxies(self) -> None:
        """Close every proxy the run placed (the PS's, the store's, the store's error proxy)."""
        for proxy in [*self.proxies.values(), *([self.store_errors] if self.store_errors is not None else [])]:
            proxy.close()

    mode = "psguard"

    def targets(self) -> dict[str, Any]:
        """What the nemesis aims at, by task name (``ps0``, ``worker0``, ``chief``)."""
        return dict(self.agents)

    def job_exit(self) -> int | None:
        """The job's exit code once it has ended for good, else None (psguard: the chief's agent exits when
        the trainer reached its target; it is restarted by the nemesis after a kill-agent)."""
        return self.agents["chief"].proc.poll()

    def supervise(self) -> None:
        """The psguard side needs nothing here: the agents supervise. The baseline's script restarts its job."""

    #: What injects the faults (the baseline maps the agent faults onto its plain processes).
    nemesis_class: type[Nemesis] = Nemesis

    def loop(self, deadline: float) -> None:
        nemesis = self.nemesis_class(
            self.scenario,
            list(self.schedule),
            self.history,
            self.targets(),
            store_dir=self.store_dir,
            storage=self.storage,
            seed=self.seed,
            proxies=self.proxies,
            store_errors=self.store_errors,
        )
        self.nemesis = nemesis
        reader = ProgressReader(self.dir / "progress.jsonl")
        last_pids = 0.0
        last_line = 0.0
        durable_in_flight: int | None = None
        durable_seen: int | None = None
        restores_open: set[str] = set()  # trainer processes with a restore invoked and not completed
        while True:
            for e in reader.read():
                if e["event"] == "op":
                    self.history.append(e["process"], e["type"], e["f"], e.get("value") or {}, at=float(e["mono"]))
                    if e["f"] == "durable-commit":
                        durable_in_flight = e["value"].get("step") if e["type"] == "invoke" else None
                        if e["type"] == "invoke":
                            durable_seen = durable_in_flight
                    if e["f"] == "restore":
                        (restores_open.add if e["type"] == "invoke" else restores_open.discard)(e["process"])
                    if e["f"] == "train" and e["type"] == "ok":
                        self.step = int(e["value"]["step"])
                    if self.started_at is None:
                        self.started_at = float(e["mono"])
                elif e["event"] == "step":
                    self.step = max(self.step or 0, int(e["step"])) if e["step"] else self.step
                elif e["event"] == "done":  # the trainer reached its target: no persister's moment comes now
                    nemesis.job_ended()
            now = time.monotonic()
            if now - last_pids > 0.5:
                self.note_pids()
                last_pids = now
            elapsed = None if self.started_at is None else now - self.started_at
            if self.step is not None and now - last_line > 5:
                self.say(self.progress_line(f"{len(nemesis.fired)}/{len(self.schedule)}", elapsed))
                last_line = now
            # A durable commit invoked since the last tick counts even if its ack arrived in the same read; the
            # fault's record says whether it was still in flight.
            nemesis.tick(self.step, elapsed, durable_seen, restoring=bool(restores_open))
            durable_seen = durable_in_flight
            self.on_tick(now, elapsed)
            self.supervise()
            self._note_dead_agents()
            code = self.job_exit()
            if code is not None and not nemesis.healing:
                for e in reader.read():
                    if e["event"] == "op":
                        self.history.append(e["process"], e["type"], e["f"], e.get("value") or {}, at=float(e["mono"]))
                self.history.append(HARNESS, "invoke", "job", {})
                self.history.append(HARNESS, "ok" if code == 0 else "fail", "job", {"exit": code})
                return
            if now > deadline:
                self.history.append(HARNESS, "invoke", "job", {})
                self.history.append(HARNESS, "info", "job", {"error": "time limit reached", "step": self.step})
                self.say(f"  time limit reached at step {self.step}: stopping the run")
                return
            time.sleep(0.1)

    def _note_dead_agents(self) -> None:
        """An agent that exits on its own (a crash loop it gave up on) is evidence: record it once per start."""
        for agent in self.agents.values():
            code = agent.proc.poll()
            key = (agent.name, agent.proc.pid)
            if code is None or agent.name == "chief" or key in self._dead_noted:
                continue
            stopped = ("kill-agent", "terminate-agent")
            if any(r.f in stopped and r.value.get("agent_pid") == agent.proc.pid for r in self.history.records):
                continue  # the nemesis killed it
            self._dead_noted.add(key)
            tail = [line for line in agent.log_tail(2000).splitlines() if "error" in line.lower()][-1:]
            value = {
                "agent": agent.name,
                "pid": agent.proc.pid,
                "exit": code,
                "last_error": tail[0][:500] if tail else None,
            }
            self.history.append(HARNESS, "invoke", "agent-exited", value)
            self.history.append(HARNESS, "ok", "agent-exited", value)
            self.say(f"  agent {agent.name} exited {code} on its own: {value['last_error']}")

    def part_dir(self, i: int) -> Path:
        """PS ``i``'s part folder (made at the first call): see ``part_dirs``."""
        if i not in self.part_dirs:
            self.part_dirs[i] = memory_folder(self.dir, f"ps{i}-shards", f"psguard-chaos-{os.getpid()}-")
        return self.part_dirs[i]

    def stop_all(self) -> None:
        nemesis = getattr(self, "nemesis", None)
        if nemesis is not None:
            with contextlib.suppress(HistoryError):
                nemesis.heal_all()
        for agent in sorted(self.agents.values(), key=lambda a: a.name != "chief"):  # chief first: drains
            self.note_pids()
            try:
                agent.stop()
            except Exception as e:  # keep stopping the others
                self.say(f"  stopping agent {agent.name}: {e}")
        self.close_proxies()

    def close_nemesis(self) -> None:
        nemesis = getattr(self, "nemesis", None)
        if nemesis is not None:
            with contextlib.suppress(HistoryError):
                nemesis.close()

    def final_store(self) -> None:
        from psguard.store import Store

        self.history.append(HARNESS, "invoke", "final-store", {"url": self.store_url})
        try:
            listing = self.list_store()
            if listing is not None:
                self.history.append(HARNESS, "ok", "final-store", listing)
                return
            with Store.open(self.store_url, self.storage_options) as store:
                checkpoints = []
                for info in store.checkpoints():
                    report = store.verify(info.id)
                    checkpoints.append(
                        {"id": info.id, "step": info.step, "kind": info.kind, "parent": info.parent, "ok": report.ok,
                         "problems": [p.message[:300] for p in report.problems]}
                    )  # fmt: skip
                journal = [j.get("id") for j in store.journal()]
        except Exception as e:
            self.history.append(HARNESS, "fail", "final-store", {"error": str(e)[:500]})
            return
        value = {
            "checkpoints": checkpoints,
            "journal": journal,
            "damaged_chunks": self._damaged_chunks(),
            "temp_files": self._store_temp_files(),
        }
        self.history.append(HARNESS, "ok", "final-store", value)
        self.store_gc(len(checkpoints))

    def _store_temp_files(self) -> list[str]:
        if self.store_dir is None or not self.store_dir.exists():
            return []
        return sorted(str(p.relative_to(self.store_dir)) for p in self.store_dir.rglob("*.tmp.*"))

    def store_gc(self, keep: int) -> None:
        """The store's own clean-up, keeping every checkpoint: what a killed writer left (temporary files,
        chunks no manifest references) is removed by gc by design (docs/storage-format.md), so the leak audit
        runs after it; what was there before is recorded in ``final-store``. Every writer is stopped by now, so
        no grace period: gc otherwise leaves what a writer killed less than a lease before the run's end wrote
        (a PS agent killed mid-write near the end), which the audit then counted as a leak."""
        from psguard.store import Store

        self.history.append(HARNESS, "invoke", "gc", {"keep_last": max(1, keep)})
        try:
            with Store.open(self.store_url, self.storage_options, chunk_grace=0.0) as store:
                report = store.gc(keep_last=max(1, keep))
        except Exception as e:
            self.history.append(HARNESS, "fail", "gc", {"error": str(e)[:500]})
            return
        self.history.append(HARNESS, "ok", "gc", report.to_json())

    def list_store(self) -> dict[str, Any] | None:
        """The final store as the checkers see it, when it is not a psguard store (the baseline's)."""
        return None

    def _damaged_chunks(self) -> dict[str, bool]:
        """Per chunk the nemesis damaged: whether its bytes hash to its name again (a later checkpoint with the
        same content wrote it anew), checked here independently of the store's own verification."""
        import hashlib

        out: dict[str, bool] = {}
        if self.store_dir is None:
            return out
        for r in self.history.records:
            chunk = r.value.get("chunk") if r.process == "nemesis" and r.type == "ok" else None
            if isinstance(chunk, str):
                path = self.store_dir / "chunks" / chunk[:2] / chunk
                out[chunk] = path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == chunk
        return out

    def stop_storage(self) -> None:
        if self.storage is not None:
            self.note_pids()
            self.storage.close()

    def note_pids(self) -> None:
        """Record the processes the run started (every descendant but those alive before it)."""
        self.pids_seen |= descendants(os.getpid()) - self._pids_before

    def cleanup_audit(self) -> None:
        self.history.append(HARNESS, "invoke", "cleanup", {})
        deadline = time.monotonic() + _CLEANUP_WAIT
        while True:
            alive = sorted(p for p in self.pids_seen if pid_alive(p))
            busy = sorted(p for p in set(self.ports) if _port_busy(p))
            if (not alive and not busy) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        temp: list[str] = []
        crash_leftovers: list[str] = []
        spool = self.dir / "spool"
        for sub in ("incoming", "requests", "restore", "writers"):
            if (spool / sub).is_dir():
                for p in (spool / sub).iterdir():
                    # A killed trainer's writer lock stays until the agent next checks that generation (the
                    # spool's crash protocol); it is reported, not counted as a leak.
                    (crash_leftovers if sub == "writers" and p.name.endswith(".lock") else temp).append(str(p))
        if self.store_dir is not None and self.store_dir.exists():
            temp += [str(p) for p in self.store_dir.rglob("*.tmp.*")]
        threads = [
            t.name
            for t in threading.enumerate()
            if t.ident not in self.threads_before and t.is_alive() and not t.name.startswith(("fsspecIO", "asyncio_"))
        ]
        value = {"alive_pids": alive, "busy_ports": busy, "temp_files": temp, "threads": threads,
                 "pids_seen": sorted(self.pids_seen), "ports": sorted(set(self.ports)),
                 "crash_leftovers": crash_leftovers}  # fmt: skip
        self.history.append(HARNESS, "ok", "cleanup", value)

    def kill_leftovers(self) -> None:
        """Last resort after the audit: SIGKILL anything of ours still alive (the audit has recorded it)."""
        for pid in sorted(self.pids_seen):
            if pid_alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, 9)


def run_scenario(
    scenario: Scenario,
    directory: Path,
    *,
    seed: int = 0,
    job: str = DEFAULT_JOB,
    faults: bool = True,
    reference: Sequence[Record] | None = None,
    say: Callable[[str], None] = print,
    run_class: Callable[..., _Run] | None = None,
) -> RunResult:
    """Run ``scenario`` in ``directory`` (recreated) and judge it; see the module docstring for the phases."""
    from psguard.chaos.report import write_report

    directory = claim_folder(directory, "psguard chaos run")
    t0 = time.monotonic()
    deadline = t0 + scenario.time_limit
    run = (run_class or _Run)(scenario, directory, seed=seed, job=job, faults=faults, say=say)
    interrupted: BaseException | None = None
    try:
        run.record_run()
        say(
            f"chaos {scenario.name} (seed {seed}): {len(run.schedule)} fault(s): "
            + "; ".join(f.describe() for f in run.schedule)
        )
        run.start_storage()
        run.start_cluster()
        say(f"  cluster up in {time.monotonic() - t0:.0f}s; {run.target_line()}")
        run.loop(deadline)
    except (KeyboardInterrupt, LaunchError, HistoryError) as e:
        interrupted = e
        with contextlib.suppress(HistoryError):
            run.history.append(HARNESS, "invoke", "job", {})
            run.history.append(HARNESS, "info", "job", {"error": f"{type(e).__name__}: {e}"[:500]})
    finally:
        run.stop_all()
        try:
            if not isinstance(interrupted, HistoryError):
                run.final_store()
        finally:
            run.stop_storage()
            run.close_nemesis()  # after the storage: a server it restarted dies with the nemesis's thread
            if not isinstance(interrupted, HistoryError):
                run.cleanup_audit()
            run.kill_leftovers()
            drop_memory_folders(run.part_dirs.values())
            run.history.close()
    records = read_history(directory / "history.jsonl")
    verdicts = check_all(records, reference)
    report = write_report(directory, records, verdicts, wall_seconds=time.monotonic() - t0, scenario=scenario)
    if isinstance(interrupted, KeyboardInterrupt):
        raise interrupted
    return RunResult(directory, verdicts, overall(verdicts), report)


def reference_key(scenario: Scenario, seed: int, job: str) -> str:
    """What a fault-free run depends on: the job, its training settings, the cluster, the storage and the seed."""
    import hashlib

    # "labels": the built-in model's label function (psguard.testbed.model.labels_for); a reference trained with
    # another label is not comparable, so bump it when the label changes.
    doc = {"training": asdict(scenario.training), "cluster": asdict(scenario.cluster),
           "storage": scenario.storage.kind, "seed": seed, "job": job, "labels": 2}  # fmt: skip
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]


def run_with_reference(
    scenario: Scenario,
    directory: Path,
    *,
    seed: int = 0,
    job: str = DEFAULT_JOB,
    references: Path | None = None,
    say: Callable[[str], None] = print,
) -> RunResult:
    """The scenario's run, with a fault-free one (same seed) for the loss checker when ``checks.reference``.

    A fault-free run depends only on the job, the training settings, the cluster, the storage and the seed, so
    it is kept under ``references`` (default: beside ``directory``) and shared by every scenario that matches.
    """
    reference = None
    if scenario.checks.reference:
        key = reference_key(scenario, seed, job)
        ref_dir = (references or directory.parent) / f"reference-{key}"
        history = ref_dir / "history.jsonl"
        done = ref_dir / "report.json"
        if done.exists() and json.loads(done.read_text()).get("goodput", {}).get("final_step") is not None:
            say(f"chaos {scenario.name}: fault-free reference run {ref_dir} (reused)")
        else:
            say(f"chaos {scenario.name}: fault-free reference run first ({ref_dir})")
            run_scenario(replace(scenario, name=f"reference-{key}"), ref_dir, seed=seed, job=job, faults=False, say=say)
        reference = read_history(history)
    return run_scenario(scenario, directory, seed=seed, job=job, reference=reference, say=say)


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())
