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

Both trainers (child processes: :mod:`psguard.benchmarks.recovery_trainers`; this module is the parent, which
starts, kills and measures) write timestamped progress records (:class:`psguard.demo_trainer.Progress`): one per
step, per capture and per restore. **Recovery** is measured from the kill to the first step at normal speed: the
step that completes at least ``memory_every + 2`` steps after the restored step (so both sides train the same steps
after their restore, and psguard's first capture after the restore is inside the span; psguard's span also waits for
that capture if the policy put it later), whose own duration is at most 3x the median step of the same job before
the kill (no capture in it). ``first_step_s`` is the older measure: kill to the first step completed.

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
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from psguard.benchmarks.common import (
    NORMAL_FACTOR,
    RssWatch,
    alternate,
    median,
    print_results,
    progress,
)
from psguard.benchmarks.recovery_summary import compare_no_copies, summarize
from psguard.errors import ConfigError
from psguard.handoff.contract import PLAIN_TF_SERVERS, QUIET_TENSORFLOW
from psguard.ports import free_ports
from psguard.run_folder import drop_memory_folders, memory_folder
from psguard.testbed.cluster import LocalCluster

NUM_WORKERS = 1
_POLL = 0.05


@dataclass(frozen=True)
class Params:
    vocab_size: int = 200_000
    embedding_dim: int = 16
    batch_size: int = 64
    num_ps: int = 2
    memory_every: int = 5
    durable_every: int = 50  # K: psguard's durable cadence and the baseline's CheckpointManager.save cadence
    kill_step: int = 0  # 0: 2K - 1
    after_steps: int = 30  # steps trained after the restore (enough to find the first one at normal speed)
    timeout: float = 600.0
    # "process": PS 0's server is killed, its agent restarts it. "node": PS 0's agent is killed with it (its
    # memory tier gone) and a new agent starts with an empty part folder, as on a replacement node.
    fault: str = "process"
    copies: str = "none"  # psguard's peers.copies ("full": each PS agent holds a copy of another's shards)
    keep_survivors: bool = False  # psguard's peers.keep_survivors (an in-process rejoin keeps a surviving PS)
    parity_group: int = 2  # with copies "parity": PS per XOR block (peers.parity_group)
    store: str = "local"  # psguard's durable log: "local" (a folder) or "s3" (a SeaweedFS server this run starts)

    @property
    def kill_at(self) -> int:
        return self.kill_step or 2 * self.durable_every - 1

    @property
    def settle_steps(self) -> int:
        return self.memory_every + 2

    @property
    def approx_state_bytes(self) -> int:
        """The embedding and its Adagrad accumulator (float32); the dense layers are a few KB more."""
        return 2 * self.vocab_size * self.embedding_dim * 4


# ------------------------------------------------------------------------------------------- the records


@dataclass
class Records:
    """One side's progress records of one run, read back: what :func:`measure` needs."""

    docs: list[dict[str, Any]] = field(default_factory=list)

    def of(self, event: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d.get("event") == event]

    def first(self, event: str) -> dict[str, Any]:
        found = self.of(event)
        if not found:
            raise RuntimeError(f"no {event!r} record")
        return found[0]


def read_records(path: Path) -> Records:
    from psguard.agent.process.launcher import ProgressReader

    return Records(ProgressReader(path).read()) if path.exists() else Records()


def _pace(steps: list[dict[str, Any]], after: int = 5) -> float:
    """Steps per second over ``steps`` past step ``after`` (at least the first 5: tracing), captures and all."""
    run = [d for d in steps if d["step"] > max(5, after)]
    if len(run) < 2 or run[-1]["t"] <= run[0]["t"]:
        return float("nan")
    return float(run[-1]["step"] - run[0]["step"]) / float(run[-1]["t"] - run[0]["t"])


def _settle(recs: Records) -> dict[str, Any] | None:
    """The trainer's ``settle`` record (psguard's side: where the peer copies were made), if any."""
    found = recs.of("settle")
    return found[0] if found else None


def _settle_wait(settle: dict[str, Any] | None, before: list[dict[str, Any]]) -> float | None:
    """Seconds from the trainer's ``settle`` record to its next step's: the wait for the peer copies."""
    if settle is None:
        return None
    after = [d for d in before if d["step"] > int(settle["step"])]
    return float(after[0]["t"]) - float(settle["t"]) if after else None


def measure(recs: Records, kill_t: float, p: Params, *, need_capture: bool) -> dict[str, Any]:
    """Recovery, lost steps, restore seconds and capture stalls of one side, from its records.

    Normal speed: the median duration of the steps before the kill that had no capture in them (the first 5
    skipped: tracing); recovery ends at the first step after the restore, ``settle_steps`` or more past the
    restored step (and after a capture when ``need_capture``), that took at most ``NORMAL_FACTOR`` times that.
    """
    steps = recs.of("step")
    before = [d for d in steps if d["gen"] == 0]
    plain = [b["t"] - a["t"] for a, b in itertools.pairwise(before) if not b["cap"] and b["step"] > 5]
    normal = median(plain) if plain else float("nan")
    restore = recs.of("restore")[-1]
    restored = int(restore["step"])
    after = [d for d in steps if d["gen"] >= 1]
    captures_after = [d for d in recs.of("capture") if d["gen"] >= 1]
    end, prev, reached, captured = None, float(restore["t1"]), False, False
    for d in after:
        captured = captured or d["cap"]
        ok = d["step"] >= restored + p.settle_steps and (captured or not need_capture) and not d["cap"]
        if ok and d["t"] - prev <= NORMAL_FACTOR * normal:
            end, reached = d["t"], True
            break
        prev = d["t"]
    if end is None:
        end = after[-1]["t"] if after else float("nan")
    stalls = [float(d["stall"]) for d in recs.of("capture") if d["gen"] == 0]
    settle = _settle(recs)
    return {
        "recovery_s": end - kill_t,
        "first_step_s": (after[0]["t"] - kill_t) if after else float("nan"),
        "normal_speed_reached": reached,
        "normal_step_s": normal,
        # From the settle point on (psguard's side: the peer copies made, as in a job that has run for hours).
        "steps_per_s": _pace(before, int(settle["step"]) if settle is not None else 5),
        # How long the trainer waited there: the first whole copy of every shard (once per job and node loss).
        "settle_wait_s": _settle_wait(settle, before),
        "lost_steps": p.kill_at - restored,
        "restored_step": restored,
        "restored_from": restore.get("source"),
        "restore_s": float(restore["t1"]) - float(restore["t0"]),
        "build_s": float(restore["build_s"]),
        "restore_end_to_first_step_s": (after[0]["t"] - float(restore["t1"])) if after else float("nan"),
        # The first capture is a full one in every job; the steady state is the rest.
        "capture_stall_s": median(stalls[1:]) if len(stalls) > 1 else (stalls[0] if stalls else float("nan")),
        "first_capture_stall_s": stalls[0] if stalls else float("nan"),
        "capture_after_restore_stall_s": float(captures_after[0]["stall"]) if captures_after else None,
        "capture_after_restore_rows": captures_after[0].get("rows_spilled") if captures_after else None,
        "restore_parts_s": restore.get("parts") or {},
        "first_capture_restorable_s": recs.of("first-restorable")[0]["seconds"]
        if recs.of("first-restorable")
        else None,
        "capture_rows": median([float(d.get("rows_spilled", 0)) for d in recs.of("capture")[1:]] or [0.0]),
    }


def growth_after_build(recs: Records) -> int:
    """The trainer's largest RSS growth over a generation, counted from its model's build (each process resets
    its kernel peak mark there): the peaks its records carry after that, minus its RSS then."""
    out = 0
    restores = recs.of("restore")
    for k, r in enumerate(restores):
        later = restores[k + 1]["t"] if k + 1 < len(restores) else float("inf")
        peaks = [int(d["hwm"]) for d in recs.docs if "hwm" in d and r["t"] <= d["t"] < later]
        peaks += [int(r.get("hwm", 0))]
        out = max(out, max(peaks) - int(r["built_rss"]))
    return out


# ------------------------------------------------------------------------------------------- the parent


def _child(fn: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        f"import sys; from psguard.benchmarks.recovery_trainers import {fn}; {fn}(*sys.argv[1:])",
        *args,
    ]


def _wait_store_open(agent: Any, timeout: float = 60.0) -> None:
    """A PS agent holds its store's open back for a few seconds after its start (store/opening.py)."""
    deadline = time.monotonic() + timeout
    while (state := (agent.status().get("shards") or {}).get("store_state")) in ("held", "opening"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"agent {agent.name}: its store is still {state} after {timeout:.0f}s")
        time.sleep(0.1)  # polling the agent's /status: no event to wait on from this process
    if state == "failed":
        raise RuntimeError(f"agent {agent.name}: its store did not open; see {agent.log_path}")


def run_psguard(p: Params, workdir: Path, s3: Any = None) -> dict[str, Any]:
    """One recovery with every task under ``psguard agent``; the figures of :func:`measure` and the RSS.

    ``s3``: a started :class:`psguard.testbed.s3.SeaweedS3` holding the durable log (a prefix per run)."""
    from psguard.agent.process.launcher import AGENT_CONFIG, AgentProcess, with_peers, write_cluster

    work = Path(tempfile.mkdtemp(prefix="psg-", dir=workdir))
    shm = memory_folder(work, "parts", "psguard-bench-")  # the PS agents' part folders: where psguard keeps them
    prog = work / "progress.jsonl"
    store = s3.url(f"job-{work.name}") if s3 is not None else str(work / "store")
    env = dict(s3.env) if s3 is not None else None
    agents: dict[str, AgentProcess] = {}
    rss = RssWatch()
    steady: dict[str, int | None] = {}  # each PS agent's RSS growth just before the kill
    kill_t: float | None = None
    reader_recs: list[dict[str, Any]] = []
    try:
        cluster, _ = write_cluster(work, ps=p.num_ps, workers=NUM_WORKERS)
        root = work / "agents"
        # The agents' task records in a folder of this run: the default one is shared by every job named
        # "default" on the host, and another run's ps:0 there makes this run's PS agent refuse to start.
        config = AGENT_CONFIG + f"state_dir: {shm / 'agents'}\n"
        ps_args: dict[str, list[str]] = {}
        ps_ports = free_ports(p.num_ps)
        for i in range(p.num_ps):
            args = ["--role", "ps", "--index", str(i), "--cluster", str(cluster), "--http-port", str(ps_ports[i])]
            args += ["--spool", str(shm / f"ps{i}"), "--store", store]
            ps_args[f"ps{i}"] = args
            # Every PS on a node of its own, as in a real job (peer copies never go to the same node).
            agents[f"ps{i}"] = AgentProcess(root, f"ps{i}", args, config=config + f"node: node-ps{i}\n", env=env)
        for i in range(NUM_WORKERS):
            args = ["--role", "worker", "--index", str(i), "--cluster", str(cluster)]
            agents[f"worker{i}"] = AgentProcess(root, f"worker{i}", args, config=config)
        peers = [arg for a in agents.values() for arg in ("--peer", a.wait_url(180))]
        for name in ps_args:  # their RSS is followed from the trainer's start: as in a job, with their store open
            _wait_store_open(agents[name])
        trainer = _child("agent_trainer", str(prog), store, str(shm), json.dumps(asdict(p)))
        args = ["--role", "chief", "--index", "0", "--cluster", str(cluster), "--store", store]
        args += ["--spool", str(shm / "spool"), *peers]
        peers_settings: dict[str, object] = {}
        if p.copies != "none":
            peers_settings["copies"] = p.copies
        if p.copies == "parity":
            peers_settings["parity_group"] = p.parity_group
        if p.keep_survivors:
            peers_settings["keep_survivors"] = True
        chief_config = with_peers(config, **peers_settings)
        agents["chief"] = AgentProcess(root, "chief", args, trainer, config=chief_config, env=env)
        agents["chief"].wait_url(180)
        from psguard.agent.process.launcher import ProgressReader

        reader = ProgressReader(prog)
        deadline = time.monotonic() + p.timeout
        chief = agents["chief"]
        while chief.proc.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"psguard: no end within {p.timeout}s; logs in {root}")
            for d in reader.read():
                reader_recs.append(d)
                if d["event"] == "ready":
                    # Before the model exists: the start of every RSS growth measured.
                    rss.start("trainer", int(d["pid"]), int(d["rss"]))
                    rss.start("chief-agent", chief.proc.pid)
                    for i in range(p.num_ps):
                        rss.start(f"ps{i}", agents[f"ps{i}"].proc.pid)
                elif d["event"] == "settle":
                    _steady(agents, p, rss, durable=False)
                    (shm / "settled").touch()
                elif d["event"] == "kill":
                    kill_t, copy_lag, steady = _kill_ps0(agents, p, rss)
                    if p.fault == "node":
                        # A replacement node: a new agent, its part folder empty, on the same addresses. The lost
                        # node's folder is moved aside (freed at the end): on a cluster its memory is freed on that
                        # node, not on the recovery's critical path here (512 MB of tmpfs: 0.05 s of CPU).
                        if (shm / "ps0").exists():
                            (shm / "ps0").rename(shm / "ps0-lost")
                        agents["ps0-new"] = AgentProcess(
                            root, "ps0-new", ps_args["ps0"], config=config + "node: node-ps0-new\n", env=env
                        )
                    (shm / "killed").touch()
            rss.sample()
            time.sleep(_POLL)
        reader_recs += reader.read()
        if chief.proc.returncode != 0 or not any(d["event"] == "done" for d in reader_recs):
            raise RuntimeError(f"psguard: the chief's agent exited {chief.proc.returncode}:\n{chief.log_tail()}")
        ps_held = {}
        own_fps: dict[str, int] = {}  # the fingerprints an agent keeps beside its own tier (copies or not)
        copies_held: dict[str, int] = {}
        covers: dict[str, set[str]] = {}  # the owners whose shards a holder's copies (or parity blocks) restore
        for i in range(p.num_ps):
            name = "ps0-new" if i == 0 and "ps0-new" in agents else f"ps{i}"
            shards = agents[name].status().get("shards") or {}
            t = f"ps:{i}"
            ps_held[t] = int(shards.get("bytes") or 0)
            own_fps[t] = int(shards.get("fingerprint_bytes") or 0)
            full, blocks = _held(shards), _held(shards, "parity_held")
            copies_held[t] = sum(int(c.get("bytes") or 0) for c in full.values())
            copies_held[t] += sum(int(g.get("bytes") or 0) for g in blocks.values())
            covers[t] = set(full) | {m for g in blocks.values() for m in g.get("members") or {}}
        chief_log = chief.log_path.read_text(errors="replace")
    finally:
        for name in ["chief", *[n for n in agents if n != "chief"]]:
            if name in agents:
                agents[name].stop()
        drop_memory_folders([shm])
    recs = Records(reader_recs)
    assert kill_t is not None
    doc = measure(recs, kill_t, p, need_capture=True)
    state = recs.first("state")
    raw = recs.first("raw")
    trainer_peak = int(recs.first("trainer-peak")["hwm"])
    rss.peak["trainer"] = max(rss.peak.get("trainer", 0), trainer_peak)
    held = {t: b or int(state["ps_bytes"].get(t, 0)) for t, b in ps_held.items()}
    ps_ratios = {t: rss.growth(f"ps{t.split(':')[1]}") / b for t, b in held.items() if b and t != "ps:0"}
    if p.fault != "node":  # ps:0's agent was replaced: its growth was not followed
        ps_ratios.update({t: rss.growth("ps0") / b for t, b in held.items() if b and t == "ps:0"})

    # The bytes of the shards a holder's copies let be restored (issue 24's "shards it copies"): an owner's shards
    # for a full copy (its fingerprints, 1/16 more at 128-byte rows, are the copy's cost), the whole group's for a
    # parity block (so the bound is 1.1/K).
    covered = {t: sum(int(state["ps_bytes"].get(o, 0)) for o in owners) for t, owners in covers.items()}

    # The copy's own cost: a holder's growth beyond what it holds for itself (its shards and their fingerprints,
    # which every agent keeps, copies or not), over the shards it covers; at its peak (the durable writes' buffers
    # included: 2 x io_threads x chunk in flight, about 280 MB to S3 whatever the state) and just before the kill
    # (what it holds: the copy and its own shards). Agent overhead present with copies off counts here too; the
    # copies-off side of a node-loss benchmark takes it out (peer_rss_vs_no_copies_ratio).
    def per_copy(growth: Mapping[str, int | None]) -> dict[str, float]:
        return {
            t: (g - held[t] - own_fps.get(t, 0)) / c
            for t, c in covered.items()
            if c and t != "ps:0" and (g := growth.get(t)) is not None
        }

    peer_peak = per_copy({t: rss.growth(f"ps{t.split(':')[1]}") for t in copies_held})
    peer_ratios = per_copy(steady)
    from_peer = "event=peer_copy_used " in chief_log
    restore_rate = state["state_bytes"] / doc["restore_s"]
    raw_rate = raw["bytes"] / raw["seconds"]
    doc.update(
        state_bytes=int(state["state_bytes"]),
        ps_shard_bytes=held,
        ps_side_shards="event=ps_side_shards " in chief_log,
        chief_rss_growth_bytes=growth_after_build(recs) + rss.growth("chief-agent"),
        chief_rss_growth_with_build_bytes=rss.growth("trainer") + rss.growth("chief-agent"),
        trainer_rss_growth_bytes=growth_after_build(recs),
        trainer_rss_growth_with_build_bytes=rss.growth("trainer"),
        trainer_rss_after_build_bytes=int(recs.first("restore")["built_rss"]) - int(recs.first("ready")["rss"]),
        chief_agent_rss_growth_bytes=rss.growth("chief-agent"),
        ps_agent_rss_growth_bytes={t: rss.growth(f"ps{t.split(':')[1]}") for t in held},
        ps_agent_peak_rss_ratio=max(ps_ratios.values()) if ps_ratios else float("nan"),
        restore_mib_s=restore_rate / 2**20,
        raw_restore_mib_s=raw_rate / 2**20,
        raw_restore_s=raw["seconds"],
        restore_vs_raw_ratio=restore_rate / raw_rate,
        phases=_phases(recs, kill_t),
        fault=p.fault,
        copies=p.copies,
        peer_copy_lag_steps=copy_lag,
        peer_rss_ratio=max(peer_ratios.values()) if peer_ratios else None,
        peer_rss_peak_ratio=max(peer_peak.values()) if peer_peak else None,
        ps_agent_steady_growth_bytes=dict(steady),
        copies_held_bytes=copies_held,
        copies_cover_bytes=covered,
        own_fingerprint_bytes=own_fps,
        # The memory every copy costs the job, over its state: about 1 for full copies, 1/K for parity.
        copy_overhead_ratio=sum(copies_held.values()) / int(state["state_bytes"]) if p.copies != "none" else None,
    )
    if from_peer and doc["restored_from"] == "memory":
        doc["restored_from"] = "peer"
    elif "every tier loaded checkpoint" in chief_log and doc["restored_from"] == "memory":
        doc["restored_from"] = "durable (each agent its rows)"  # served through the tiers, read from the log
    doc["chief_peak_rss_growth_ratio"] = doc["chief_rss_growth_bytes"] / doc["state_bytes"]
    doc["chief_peak_rss_growth_ratio_with_build"] = doc["chief_rss_growth_with_build_bytes"] / doc["state_bytes"]
    if not os.environ.get("PSGUARD_BENCH_KEEP"):  # set: keep the agents' logs and the progress records
        shutil.rmtree(work, ignore_errors=True)
    return doc


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


def _steady(
    agents: dict[str, Any], p: Params, rss: RssWatch, *, durable: bool
) -> tuple[int | None, list[dict[str, Any]]]:
    """Wait for the state of a job that has run for hours: every PS standby warm, every peer copy made and
    current, and (``durable``) the last durable save due written. Returns how many steps ps:0's peer copy
    lagged when first seen, and the PS agents' statuses."""
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
        time.sleep(_POLL)


def _phases(recs: Records, kill_t: float) -> dict[str, float]:
    restore = recs.of("restore")[-1]
    after = [d for d in recs.of("step") if d["gen"] >= 1]
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
    work = Path(tempfile.mkdtemp(prefix="tf-", dir=workdir))
    procs: list[subprocess.Popen[bytes]] = []
    clusters: list[LocalCluster] = []
    rss = RssWatch()
    prog = work / "progress.jsonl"

    def start_chief(mode: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "w") as err:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(
                _child("baseline_child", str(work), json.dumps(asdict(p)), mode, str(prog)),
                stdout=err,
                stderr=err,
                env=env,
            )

    def wait(proc: subprocess.Popen[bytes], what: str, log: Path, cluster: LocalCluster) -> None:
        deadline = time.monotonic() + p.timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: no end within {p.timeout}s; log {log}")
            if not prog.exists() or "kill" not in prog.read_text():  # before the kill every server must live
                dead = [(j, i) for j, i in cluster.pids if not cluster.alive(j, i)]
                if dead:  # e.g. "Could not start gRPC server": another process took its free port meanwhile
                    raise ServerStartError(f"{what}: server {dead[0]} died: {cluster.log(*dead[0])[-600:]}")
            rss.sample()
            time.sleep(_POLL)

    try:
        cluster = LocalCluster(num_ps=p.num_ps, num_workers=NUM_WORKERS, env=PLAIN_TF_SERVERS).start()
        clusters.append(cluster)
        env = dict(
            os.environ, **QUIET_TENSORFLOW, TF_CONFIG=cluster.tf_config(), BENCH_PS0_PID=str(cluster.pids[("ps", 0)])
        )
        log1 = work / "chief-1.log"
        procs.append(start_chief("first", env, log1))
        wait(procs[-1], "baseline chief", log1, cluster)
        exited_at = time.time()
        first = read_records(prog)
        if not first.of("failure"):
            raise RuntimeError(f"baseline chief exited {procs[-1].returncode}: {log1.read_text()[-3000:]}")
        # The restart script: the whole job down, then new servers and a new chief at once.
        cluster.stop()
        stopped_at = time.time()
        cluster = LocalCluster(num_ps=p.num_ps, num_workers=NUM_WORKERS, env=PLAIN_TF_SERVERS)
        clusters.append(cluster)
        env = dict(os.environ, **QUIET_TENSORFLOW, TF_CONFIG=cluster.tf_config())
        log2 = work / "chief-2.log"
        procs.append(start_chief("restart", env, log2))
        cluster.start()
        servers_at = time.time()
        wait(procs[-1], "restarted baseline chief", log2, cluster)
        recs = read_records(prog)
        if not [d for d in recs.of("step") if d["gen"] == 1]:
            raise RuntimeError(f"restarted baseline chief exited {procs[-1].returncode}: {log2.read_text()[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for c in clusters:
            c.stop()
    kill_t = recs.first("kill")["t"]
    doc = measure(recs, kill_t, p, need_capture=False)
    restart_ready = next(d for d in recs.of("ready") if d["gen"] == 1)
    restore = recs.of("restore")[-1]
    # Each chief resets its peak mark after its model's build: the build's peak is in its restore record.
    with_build = [
        max(int(d["hwm"]), int(b["built_hwm"])) - int(r["rss"])
        for d, b, r in zip(recs.of("trainer-peak"), recs.of("restore"), recs.of("ready"), strict=True)
    ]
    doc.update(
        state_bytes=int(recs.first("state")["state_bytes"]),
        chief_rss_growth_bytes=growth_after_build(recs),
        chief_rss_growth_with_build_bytes=max(with_build),
        phases={
            "detect_s": recs.first("failure")["t"] - kill_t,
            "chief_exit_s": exited_at - recs.first("failure")["t"],
            "stop_job_s": stopped_at - exited_at,
            "servers_up_s": servers_at - stopped_at,
            "chief_start_s": restart_ready["t"] - stopped_at,  # TF import, in parallel with the servers' start
            "connect_build_s": float(restore["t0"]) - restart_ready["t"],
            "restore_s": float(restore["t1"]) - float(restore["t0"]),
            "first_step_s": doc["restore_end_to_first_step_s"],
        },
    )
    doc["chief_rss_growth_ratio"] = doc["chief_rss_growth_bytes"] / doc["state_bytes"]
    shutil.rmtree(work, ignore_errors=True)
    return doc


def run(p: Params, runs: int = 3) -> dict[str, Any]:
    """``runs`` recoveries per side, alternating; the results document (see the module docstring).

    With peer copies on and ``fault="node"``, psguard also runs the same fault with copies off, once per run and
    beside it: ``recovery_vs_no_copies_ratio`` is what the copies buy.
    """
    workdir = Path(tempfile.mkdtemp(prefix="psguard-bench-recovery-"))
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    no_copies: list[dict[str, Any]] = []
    s3 = None
    if p.store == "s3":
        from psguard.testbed.s3 import SeaweedS3

        s3 = SeaweedS3(workdir / "seaweed", bucket="psguard-bench")
        s3.start()

    off = replace(p, copies="none") if p.fault == "node" and p.copies != "none" else None

    def copies_off(i: int) -> None:
        assert off is not None
        doc = run_psguard(off, workdir, s3)
        no_copies.append(doc)
        progress(f"run {i} psguard, copies off: {doc['recovery_s']:.2f}s, lost {doc['lost_steps']}")

    def a(i: int) -> float:
        # With copies off as well: right beside the run with them, in turns before and after it, so that what
        # drifts over the benchmark (the store's size, the machine's other load) does not land on one side of
        # their ratios (goodput with copies on over off moved 0.67-1.36 with the off runs all at the end).
        if off is not None and i % 2:
            copies_off(i)
        doc = run_psguard(p, workdir, s3)
        ours.append(doc)
        progress(
            f"run {i} psguard: {doc['recovery_s']:.2f}s (first step {doc['first_step_s']:.2f}s), lost "
            f"{doc['lost_steps']} (from {doc['restored_from']}), restore {doc['restore_s']:.2f}s "
            f"({doc['restore_mib_s']:.0f} MiB/s, raw {doc['raw_restore_mib_s']:.0f} MiB/s)"
        )
        if off is not None and not i % 2:
            copies_off(i)
        return float(doc["recovery_s"])

    def b(i: int) -> float:
        doc = run_baseline(p, workdir)
        theirs.append(doc)
        progress(
            f"run {i} baseline: {doc['recovery_s']:.2f}s (first step {doc['first_step_s']:.2f}s), "
            f"lost {doc['lost_steps']}, restore {doc['restore_s']:.2f}s"
        )
        return float(doc["recovery_s"])

    what = "PS 0 with its agent (node lost)" if p.fault == "node" else "PS 0"
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
    if no_copies:
        result.update(compare_no_copies(ours, no_copies, xs))
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
    results = run(params_from_args(args), runs=args.runs)
    print_results(results, as_json=args.json)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("recovery", help="kill -9 a PS of a job under agents vs restarting the whole TF job")
    p.add_argument("--runs", type=int, default=3, help="recoveries per side (default 3)")
    p.add_argument("--vocab-size", type=int, default=200_000, help="rows of the embedding table (default 200000)")
    p.add_argument(
        "--fault",
        choices=("process", "node"),
        default="process",
        help="process: kill -9 PS 0's server; node: with its agent, a new agent on an empty folder (default process)",
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
