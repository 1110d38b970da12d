"""A chief that trains through a PS kill, for test_recovery.py. Prints JSON lines the test reads.

It owns a 2-PS, 2-worker LocalCluster and a sidecar (spool server, memory tier, persister) in threads, and
trains with psguard.trainer.recovery.run_with_recovery: memory tier every 5 steps, durable every 20. Once a durable
save exists it prints {"kill": pid} once (the test kills that PS with SIGKILL) and goes on until the
failure surfaces; then it recovers in process and trains to the target step.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.persister import Persister, resume
from psguard.agent.tiers.spool_server import SpoolServer
from psguard.policy.engine import EverySteps, Schedule
from psguard.store import Store
from psguard.testbed.cluster import LocalCluster
from psguard.testbed.model import ModelConfig, RecModel, Trainer, make_optimizer
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.options import ManagerOptions
from psguard.trainer.recovery import run_with_recovery


def say(**doc: Any) -> None:
    print(json.dumps(doc), flush=True)


@dataclass
class Job:
    model: Any
    trainer: Trainer
    manager: CheckpointManager


def main() -> None:
    workdir = Path(sys.argv[1])
    target = int(sys.argv[2])
    url = str(workdir / "store")
    spool = workdir / "spool"
    store = Store.open(url)
    tier = MemoryTier()
    persister = Persister(store, tier, last=resume(store, tier)).start()
    server = SpoolServer(spool, tier, persister).start()
    schedule = Schedule(memory=EverySteps(5), durable=EverySteps(20))
    state: dict[str, Any] = {"killed_at": None, "last_seen": 0, "restored": [], "models": []}
    with LocalCluster(num_ps=2, num_workers=2, standby=True) as cluster:
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            cluster.cluster_resolver(),
            variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
        )
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        cfg = ModelConfig(vocab_size=20_000, embedding_dim=8, batch_size=64)

        def build() -> Job:
            with strategy.scope():
                model = RecModel(cfg)
                optimizer = make_optimizer("adagrad")
            state["models"].append(weakref.ref(model))
            trainer = Trainer(strategy, coordinator, model, optimizer)
            manager = CheckpointManager(
                tf.train.Checkpoint(model=model, optimizer=optimizer),
                url,
                options=ManagerOptions(coordinator=coordinator, spool=spool),
                step_counter=model.step,
                policy=schedule,
            )
            if manager.restore_or_initialize() is not None and manager.restored is not None:
                state["restored"].append({"source": manager.restored.source, "step": manager.restored.step})
            trainer.next_index = int(model.step.numpy())
            return Job(model, trainer, manager)

        def train(job: Job) -> int:
            # Until the target, and on past it until the fault was made: saves never overlap, so under load every
            # maybe_save from step 20 to the target can find the durable save of step 20 still running (a CI run
            # once ended at 60 with no fault). Bounded: the test fails on a missing "kill" line, not a hang.
            while (step := int(job.model.step.numpy())) < target or (state["killed_at"] is None and step < 20 * target):
                state["last_seen"] = step
                handle = job.manager.maybe_save(step)
                if handle is not None and state["killed_at"] is None and step >= 20:
                    handle.result(timeout=120)  # a durable checkpoint exists before the fault
                    state["killed_at"] = step
                    say(kill=cluster.pids[("ps", 0)], step=step)
                job.trainer.train(5)
            job.manager.close()
            return int(job.model.step.numpy())

        def restart_ps(failed_at: float) -> None:
            for i in range(cluster.num_ps):
                cluster.restart("ps", i)

        def close(job: Job) -> None:
            state["seen_at_failure"] = state["last_seen"]
            job.manager.close(timeout=30)

        final, report = run_with_recovery(build, train, restart_ps=restart_ps, close=close)
        gc.collect()  # what the recovery dropped is gone by now, unless something still holds it
        failed_generations_alive = sum(ref() is not None for ref in state["models"][:-1])
        rss = []
        for i in range(cluster.num_ps):
            status = Path(f"/proc/{cluster.pids[('ps', i)]}/status").read_text()
            rss.append(int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS"))) * 1024)
    server.stop()
    persister.stop(drain=True)
    store.close()
    say(
        final=final,
        killed_at=state["killed_at"],
        seen_at_failure=state.get("seen_at_failure"),
        restored=state["restored"],
        recoveries=[{"attempt": r.attempt, "seconds": r.seconds} for r in report.recoveries],
        ps_rss=rss,
        failed_generations_alive=failed_generations_alive,
        frozen=gc.get_freeze_count(),
    )


if __name__ == "__main__":
    main()
