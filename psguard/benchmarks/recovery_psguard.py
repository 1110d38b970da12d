"""psguard's side of ``psguard bench recovery``: every task under ``psguard agent``, PS 0 killed (with its agent
on ``fault="node"``), the trainer rejoining in process, or (``fault="chief"``) the trainer process killed and its
agent starting a new one (from its warm standby, as for a user's ``python train.py``); the figures of
:func:`~psguard.benchmarks.recovery_job.measure`, each process's memory and what the peer copies cost
(:mod:`psguard.benchmarks.recovery` says what each means).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psguard.benchmarks.common import RssWatch
from psguard.benchmarks.recovery_job import NUM_WORKERS, POLL, Params, Records, child, growth_after_build, measure
from psguard.ports import free_ports
from psguard.run_folder import drop_memory_folders, memory_folder

if TYPE_CHECKING:
    from psguard.agent.process.launcher import AgentProcess

__all__ = ["memory_figures", "recovery_phases", "run_psguard"]


def run_psguard(p: Params, workdir: Path, s3: Any = None) -> dict[str, Any]:
    """One recovery with every task under ``psguard agent``; the figures of :func:`measure` and the RSS.

    ``s3``: a started :class:`psguard.testbed.s3.SeaweedS3` holding the durable log (a prefix per run)."""
    work = Path(tempfile.mkdtemp(prefix="psg-", dir=workdir))
    shm = memory_folder(work, "parts", "psguard-bench-")  # the PS agents' part folders: where psguard keeps them
    store = s3.url(f"job-{work.name}") if s3 is not None else str(work / "store")
    run = _Run(p, work, shm, store, dict(s3.env) if s3 is not None else None)
    try:
        run.start_agents()
        run.follow()
        held = run.held()
        chief_log = run.agents["chief"].log_path.read_text(errors="replace")
    finally:
        for name in ["chief", *[n for n in run.agents if n != "chief"]]:
            if name in run.agents:
                run.agents[name].stop()
        drop_memory_folders([shm])
    recs = Records(run.records)
    assert run.kill_t is not None
    doc = measure(recs, run.kill_t, p, need_capture=True)
    doc.update(memory_figures(p, recs, run.rss, run.steady, held))
    doc.update(_restore_figures(recs, doc, run.kill_t, chief_log, p.fault), fault=p.fault, copies=p.copies)
    doc["peer_copy_lag_steps"] = run.copy_lag
    if doc["restored_from"] == "memory" and "event=peer_copy_used " in chief_log:
        doc["restored_from"] = "peer"
    elif "every tier loaded checkpoint" in chief_log and doc["restored_from"] == "memory":
        doc["restored_from"] = "durable (each agent its rows)"  # served through the tiers, read from the log
    doc["chief_peak_rss_growth_ratio"] = doc["chief_rss_growth_bytes"] / doc["state_bytes"]
    doc["chief_peak_rss_growth_ratio_with_build"] = doc["chief_rss_growth_with_build_bytes"] / doc["state_bytes"]
    if not os.environ.get("PSGUARD_BENCH_KEEP"):  # set: keep the agents' logs and the progress records
        shutil.rmtree(work, ignore_errors=True)
    return doc


@dataclass(frozen=True)
class Held:
    """What each PS agent held at the end of the run, by task (``ps:0``...), from its ``/status``."""

    shards: dict[str, int]  # the bytes of its PS's shards
    own_fps: dict[str, int]  # the fingerprints it keeps beside its own tier (copies or not)
    copies: dict[str, int]  # the bytes of the copies and parity blocks it holds of others' shards
    covers: dict[str, set[str]]  # the owners whose shards its copies (or parity blocks) restore


@dataclass
class _Run:
    """One psguard run's processes, and what was seen of them while the job trained."""

    p: Params
    work: Path
    shm: Path
    store: str
    env: dict[str, str] | None
    agents: dict[str, AgentProcess] = field(default_factory=dict)
    ps_args: dict[str, list[str]] = field(default_factory=dict)
    rss: RssWatch = field(default_factory=RssWatch)
    steady: dict[str, int | None] = field(default_factory=dict)  # each PS agent's RSS growth just before the kill
    kill_t: float | None = None
    copy_lag: int | None = None
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.work / "agents"

    @property
    def config(self) -> str:
        """The agents' configuration. Their task records in a folder of this run: the default one is shared by
        every job named "default" on the host, and another run's ps:0 there makes this run's PS agent refuse."""
        from psguard.agent.process.launcher import AGENT_CONFIG

        return AGENT_CONFIG + f"state_dir: {self.shm / 'agents'}\n"

    def start_agents(self) -> None:
        """Every PS's and worker's agent, then the chief's with the trainer, once the PS agents' stores are open
        (their RSS is followed from the trainer's start: as in a job, with their store open)."""
        from psguard.agent.process.launcher import AgentProcess, with_peers, write_cluster

        p, config = self.p, self.config
        cluster, _ = write_cluster(self.work, ps=p.num_ps, workers=NUM_WORKERS)
        ps_ports = free_ports(p.num_ps)
        for i in range(p.num_ps):
            args = ["--role", "ps", "--index", str(i), "--cluster", str(cluster), "--http-port", str(ps_ports[i])]
            args += ["--spool", str(self.shm / f"ps{i}"), "--store", self.store]
            self.ps_args[f"ps{i}"] = args
            # Every PS on a node of its own, as in a real job (peer copies never go to the same node).
            node = config + f"node: node-ps{i}\n"
            self.agents[f"ps{i}"] = AgentProcess(self.root, f"ps{i}", args, config=node, env=self.env)
        for i in range(NUM_WORKERS):
            args = ["--role", "worker", "--index", str(i), "--cluster", str(cluster)]
            self.agents[f"worker{i}"] = AgentProcess(self.root, f"worker{i}", args, config=config)
        peers = [arg for a in self.agents.values() for arg in ("--peer", a.wait_url(180))]
        for name in self.ps_args:
            _wait_store_open(self.agents[name])
        trainer = child(
            "agent_trainer",
            str(self.work / "progress.jsonl"),
            self.store,
            str(self.shm),
            json.dumps(asdict(p)),
            warm=p.fault == "chief",
        )
        args = ["--role", "chief", "--index", "0", "--cluster", str(cluster), "--store", self.store]
        args += ["--spool", str(self.shm / "spool"), *peers]
        peers_settings: dict[str, object] = {}
        if p.copies != "none":
            peers_settings["copies"] = p.copies
        if p.copies == "parity":
            peers_settings["parity_group"] = p.parity_group
        if p.keep_survivors:
            peers_settings["keep_survivors"] = True
        chief_config = with_peers(config, **peers_settings)
        self.agents["chief"] = AgentProcess(self.root, "chief", args, trainer, config=chief_config, env=self.env)
        self.agents["chief"].wait_url(180)

    def follow(self) -> None:
        """Read the trainer's records until the chief's agent exits, acting on them: watch the RSS from the
        trainer's start, let the job settle, kill PS 0 at the kill step."""
        from psguard.agent.process.launcher import ProgressReader

        reader = ProgressReader(self.work / "progress.jsonl")
        deadline = time.monotonic() + self.p.timeout
        chief = self.agents["chief"]
        while chief.proc.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"psguard: no end within {self.p.timeout}s; logs in {self.root}")
            for d in reader.read():
                self.records.append(d)
                self.on_record(d)
            self.rss.sample()
            time.sleep(POLL)
        self.records += reader.read()
        if chief.proc.returncode != 0 or not any(d["event"] == "done" for d in self.records):
            raise RuntimeError(f"psguard: the chief's agent exited {chief.proc.returncode}:\n{chief.log_tail()}")

    def on_record(self, d: dict[str, Any]) -> None:
        if d["event"] == "ready" and d.get("gen", 0) == 0:
            # Before the model exists: the start of every RSS growth measured.
            self.rss.start("trainer", int(d["pid"]), int(d["rss"]))
            self.rss.start("chief-agent", self.agents["chief"].proc.pid)
            for i in range(self.p.num_ps):
                self.rss.start(f"ps{i}", self.agents[f"ps{i}"].proc.pid)
        elif d["event"] == "settle":
            _steady(self.agents, self.p, self.rss, durable=False)
            (self.shm / "settled").touch()
        elif d["event"] == "kill" and self.p.fault == "chief":
            self.kill_t, self.steady = _kill_trainer(self.agents, self.p, self.rss, self.trainer_pid())
        elif d["event"] == "kill":
            self.kill_t, self.copy_lag, self.steady = _kill_ps0(self.agents, self.p, self.rss)
            if self.p.fault == "node":
                self.replace_node()
            (self.shm / "killed").touch()

    def trainer_pid(self) -> int:
        return int(next(d for d in self.records if d["event"] == "ready")["pid"])

    def replace_node(self) -> None:
        """A replacement node: a new agent, its part folder empty, on the same addresses. The lost node's folder
        is moved aside (freed at the end): on a cluster its memory is freed on that node, not on the recovery's
        critical path here (512 MB of tmpfs: 0.05 s of CPU)."""
        from psguard.agent.process.launcher import AgentProcess

        if (self.shm / "ps0").exists():
            (self.shm / "ps0").rename(self.shm / "ps0-lost")
        node = self.config + "node: node-ps0-new\n"
        self.agents["ps0-new"] = AgentProcess(self.root, "ps0-new", self.ps_args["ps0"], config=node, env=self.env)

    def held(self) -> Held:
        held = Held({}, {}, {}, {})
        for i in range(self.p.num_ps):
            name = "ps0-new" if i == 0 and "ps0-new" in self.agents else f"ps{i}"
            shards = self.agents[name].status().get("shards") or {}
            t = f"ps:{i}"
            held.shards[t] = int(shards.get("bytes") or 0)
            held.own_fps[t] = int(shards.get("fingerprint_bytes") or 0)
            full, blocks = _held(shards), _held(shards, "parity_held")
            held.copies[t] = sum(int(c.get("bytes") or 0) for c in full.values())
            held.copies[t] += sum(int(g.get("bytes") or 0) for g in blocks.values())
            held.covers[t] = set(full) | {m for g in blocks.values() for m in g.get("members") or {}}
        return held


def memory_figures(
    p: Params, recs: Records, rss: RssWatch, steady: Mapping[str, int | None], held: Held
) -> dict[str, Any]:
    """The chief's and the PS agents' memory over the state they hold, and what the peer copies cost."""
    state = recs.first("state")
    trainer_peak = int(recs.first("trainer-peak")["hwm"])
    rss.peak["trainer"] = max(rss.peak.get("trainer", 0), trainer_peak)
    shards = {t: b or int(state["ps_bytes"].get(t, 0)) for t, b in held.shards.items()}
    ps_ratios = {t: rss.growth(f"ps{t.split(':')[1]}") / b for t, b in shards.items() if b and t != "ps:0"}
    if p.fault != "node":  # ps:0's agent was replaced: its growth was not followed
        ps_ratios.update({t: rss.growth("ps0") / b for t, b in shards.items() if b and t == "ps:0"})

    # The bytes of the shards a holder's copies let be restored (issue 24's "shards it copies"): an owner's shards
    # for a full copy (its fingerprints, 1/16 more at 128-byte rows, are the copy's cost), the whole group's for a
    # parity block (so the bound is 1.1/K).
    covered = {t: sum(int(state["ps_bytes"].get(o, 0)) for o in owners) for t, owners in held.covers.items()}

    # The copy's own cost: a holder's growth beyond what it holds for itself (its shards and their fingerprints,
    # which every agent keeps, copies or not), over the shards it covers; at its peak (the durable writes' buffers
    # included: 2 x io_threads x chunk in flight, about 280 MB to S3 whatever the state) and just before the kill
    # (what it holds: the copy and its own shards). Agent overhead present with copies off counts here too; the
    # copies-off side of a node-loss benchmark takes it out (peer_rss_vs_no_copies_ratio).
    def per_copy(growth: Mapping[str, int | None]) -> dict[str, float]:
        return {
            t: (g - shards[t] - held.own_fps.get(t, 0)) / c
            for t, c in covered.items()
            if c and t != "ps:0" and (g := growth.get(t)) is not None
        }

    peer_peak = per_copy({t: rss.growth(f"ps{t.split(':')[1]}") for t in held.copies})
    peer_ratios = per_copy(steady)
    return {
        "state_bytes": int(state["state_bytes"]),
        "ps_shard_bytes": shards,
        "chief_rss_growth_bytes": growth_after_build(recs) + rss.growth("chief-agent"),
        "chief_rss_growth_with_build_bytes": rss.growth("trainer") + rss.growth("chief-agent"),
        "trainer_rss_growth_bytes": growth_after_build(recs),
        "trainer_rss_growth_with_build_bytes": rss.growth("trainer"),
        "trainer_rss_after_build_bytes": int(recs.first("restore")["built_rss"]) - int(recs.first("ready")["rss"]),
        "chief_agent_rss_growth_bytes": rss.growth("chief-agent"),
        "ps_agent_rss_growth_bytes": {t: rss.growth(f"ps{t.split(':')[1]}") for t in shards},
        "ps_agent_peak_rss_ratio": max(ps_ratios.values()) if ps_ratios else float("nan"),
        "peer_rss_ratio": max(peer_ratios.values()) if peer_ratios else None,
        "peer_rss_peak_ratio": max(peer_peak.values()) if peer_peak else None,
        "ps_agent_steady_growth_bytes": dict(steady),
        "copies_held_bytes": held.copies,
        "copies_cover_bytes": covered,
        "own_fingerprint_bytes": held.own_fps,
        # The memory every copy costs the job, over its state: about 1 for full copies, 1/K for parity.
        "copy_overhead_ratio": sum(held.copies.values()) / int(state["state_bytes"]) if p.copies != "none" else None,
    }


def _restore_figures(
    recs: Records, doc: Mapping[str, Any], kill_t: float, chief_log: str, fault: str
) -> dict[str, Any]:
    """The restore's throughput against a raw PS-side restore of the same variables, and the recovery's phases."""
    state, raw = recs.first("state"), recs.first("raw")
    restore_rate = state["state_bytes"] / doc["restore_s"]
    raw_rate = raw["bytes"] / raw["seconds"]
    return {
        "ps_side_shards": "event=ps_side_shards " in chief_log,
        "restore_mib_s": restore_rate / 2**20,
        "raw_restore_mib_s": raw_rate / 2**20,
        "raw_restore_s": raw["seconds"],
        "restore_vs_raw_ratio": restore_rate / raw_rate,
        "phases": recovery_phases(recs, kill_t, fault),
    }


def _wait_store_open(agent: Any, timeout: float = 60.0) -> None:
    """A PS agent holds its store's open back for a few seconds after its start (store/opening.py)."""
    deadline = time.monotonic() + timeout
    while (state := (agent.status().get("shards") or {}).get("store_state")) in ("held", "opening"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"agent {agent.name}: its store is still {state} after {timeout:.0f}s")
        time.sleep(0.1)  # polling the agent's /status: no event to wait on from this process
    if state == "failed":
        raise RuntimeError(f"agent {agent.name}: its store did not open; see {agent.log_path}")


def _held(shards: dict[str, Any], kind: str = "copies_held") -> dict[str, dict[str, Any]]:
    """The copies (``parity_held``: the parity blocks) a PS agent holds (its ``/status``), without the counters
    beside them."""
    held = shards.get(kind) or {}
    return {k: v for k, v in held.items() if isinstance(v, dict)}


def _kill_ps0(agents: dict[str, Any], p: Params, rss: RssWatch) -> tuple[float, int | None, dict[str, int | None]]:
    """Wait until every PS agent's standby is warm (as after minutes of training), then SIGKILL PS 0's server
    (with ``fault="node"`` its agent first). Returns the time, how many steps ps:0's peer copy lagged then, and
    each PS agent's RSS growth just before the kill (nothing being written or copied then)."""
    lag, statuses = _steady(agents, p, rss, durable=p.fault == "node")
    steady = {f"ps:{i}": rss.growth_now(f"ps{i}") for i in range(p.num_ps)}
    if p.fault == "node":
        agents["ps0"].proc.kill()
    os.kill(int(statuses[0]["pid"]), signal.SIGKILL)
    t = time.time()
    if p.fault == "node":
        agents["ps0"].proc.wait()
    return t, lag, steady


def _kill_trainer(agents: dict[str, Any], p: Params, rss: RssWatch, pid: int) -> tuple[float, dict[str, int | None]]:
    """Wait for the steady state (the chief's warm standby trainer too, as after minutes of training), then
    SIGKILL the trainer process ``pid`` (its agent lives on). Returns the time and each PS agent's RSS growth
    just before the kill."""
    _steady(agents, p, rss, durable=False)
    steady = {f"ps:{i}": rss.growth_now(f"ps{i}") for i in range(p.num_ps)}
    os.kill(pid, signal.SIGKILL)
    return time.time(), steady


def _steady(
    agents: dict[str, Any], p: Params, rss: RssWatch, *, durable: bool
) -> tuple[int | None, list[dict[str, Any]]]:
    """Wait for the state of a job that has run for hours: every PS standby warm (with ``fault="chief"`` the
    trainer's as well), every peer copy made and current, and (``durable``) the last durable save due written.
    Returns how many steps ps:0's peer copy lagged when first seen, and the PS agents' statuses."""
    deadline = time.monotonic() + 300
    first_lag: int | None = None
    while True:
        statuses = [agents[f"ps{i}"].status() for i in range(p.num_ps)]
        copies = [(s.get("shards") or {}).get("copy_out") or {} for s in statuses]
        if first_lag is None and copies[0]:
            first_lag = copies[0].get("lag_steps")
        # As after minutes of training: every standby warm, and with peer copies every copy made and current
        # (the first whole copy of a GB shard takes seconds; the trainer waits at the kill step meanwhile).
        warm = all(s["supervisor"].get("standby_ready") for s in statuses)
        if p.fault == "chief":
            warm = warm and bool(agents["chief"].status()["supervisor"].get("standby_ready"))
        copied = p.copies == "none" or all(c.get("lag_steps") == 0 and not c.get("sending_whole") for c in copies)
        # A node loss loses the node's memory tier: without a copy the log serves, and a first 1 GB base to S3
        # can still be on its way at the kill step. Wait for the last durable save due, as in a job running
        # for hours, so that both sides lose what their cadence says (the baseline's saves are synchronous).
        due = (p.kill_at // p.durable_every) * p.durable_every
        written = not durable or (agents["chief"].status().get("durable_step") or -1) >= due
        if warm and copied and written:
            return first_lag, statuses
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"within 300 s: standbys warm {warm}, peer copies current {copied} ({copies}), durable step {due} "
                f"written {written}"
            )
        rss.sample()
        time.sleep(POLL)


_STARTUP = ("started", "imported", "ready")  # a trainer process's records of its start, in order


def recovery_phases(recs: Records, kill_t: float, fault: str) -> dict[str, float]:
    """Where a recovery's time went, from the trainer's records. A new trainer process (``fault="chief"``):
    ``start_s`` from the kill to its start (the agent sees the exit, starts a new generation of PS, and lets the
    standby go), ``import_s`` (TensorFlow's, about 0 from a warm standby), ``connect_s`` to its cluster
    connected; an in-process rejoin: the PS restart and the close."""
    restore = recs.of("restore")[-1]
    after = [d for d in recs.of("step") if d["gen"] >= 1]
    if fault == "chief":
        started, imported, ready = (next(d for d in recs.of(e) if d.get("gen") == 1) for e in _STARTUP)
        return {
            "start_s": started["t"] - kill_t,
            "import_s": imported["t"] - started["t"],
            "connect_s": ready["t"] - imported["t"],
            "rebuild_s": float(restore["build_s"]),
            "restore_s": float(restore["t1"]) - float(restore["t0"]),
            "first_step_s": after[0]["t"] - float(restore["t1"]),
        }
    return {
        # The trainer asks for the PS restart as soon as it sees the failure, then closes the failed generation
        # while the PS restart: close_s overlaps restart_ps_s.
        "detect_s": recs.first("restart-ps")["t"] - kill_t,
        "restart_ps_s": recs.first("ps-restarted")["t"] - recs.first("restart-ps")["t"],
        "close_s": recs.first("closed")["t"] - recs.first("restart-ps")["t"],
        "rebuild_s": float(restore["build_s"]),
        "restore_s": float(restore["t1"]) - float(restore["t0"]),
        "first_step_s": after[0]["t"] - float(restore["t1"]),
    }
