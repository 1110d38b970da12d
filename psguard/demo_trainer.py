"""The trainer ``psguard demo`` runs under the chief's ``psguard agent`` (``python -m psguard.demo_trainer``).

It trains the recommendation-style :class:`~psguard.testbed.model.RecModel` on the cluster the agent describes
(``TF_CONFIG``), checkpoints with :class:`psguard.CheckpointManager` (memory tier every ``--memory-every`` steps
through the agent's spool, durable every ``--durable-every``) and recovers from a lost PS in process
(:func:`psguard.recovery.run_with_recovery` with :func:`psguard.agent.restart_ps_servers`).

It appends one JSON object per line to ``--progress`` (the demo's parent reads it): ``start``, ``step`` (after
every chunk of steps), ``save`` (tier, stall), ``kill`` (a checkpoint of each tier exists and the step reached
``--kill-at``: the parent may kill a PS now), ``failure`` (the failure surfaced, last step seen), ``restored``
(source tier, step), ``recovery`` (seconds), ``done`` (final step).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


@dataclass
class Job:
    model: Any
    trainer: Any
    manager: Any


class Progress:
    """Append-only JSON lines, one ``write`` + flush per event (a reader never sees half a line it trusts)."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def emit(self, event: str, **doc: Any) -> None:
        self._f.write(json.dumps({"event": event, "t": time.time(), **doc}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m psguard.demo_trainer")
    p.add_argument("--store", required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=100)
    p.add_argument("--memory-every", type=int, default=5)
    p.add_argument("--durable-every", type=int, default=25)
    p.add_argument("--chunk", type=int, default=5, help="steps scheduled per coordinator join")
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=128)
    args = p.parse_args(argv)

    import tensorflow as tf

    from psguard.agent import restart_ps_servers
    from psguard.manager import CheckpointManager
    from psguard.policy import EverySteps, Schedule
    from psguard.recovery import RecoveryEvent, run_with_recovery
    from psguard.testbed.model import ModelConfig, RecModel, Trainer, make_optimizer

    progress = Progress(args.progress)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    num_ps = len(resolver.cluster_spec().as_dict().get("ps", []))
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(max(1, num_ps))
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    schedule = Schedule(memory=EverySteps(args.memory_every), durable=EverySteps(args.durable_every))
    state: dict[str, Any] = {"seen": 0, "kill_sent": False, "memory": None, "durable": None}
    progress.emit("start", pid=os.getpid(), target=args.steps, memory_every=args.memory_every,
                  durable_every=args.durable_every, chunk=args.chunk)  # fmt: skip

    def build() -> Job:
        with strategy.scope():
            model = RecModel(ModelConfig(vocab_size=args.vocab, embedding_dim=args.dim, batch_size=args.batch))
            optimizer = make_optimizer("adagrad")
        trainer = Trainer(strategy, coordinator, model, optimizer)
        manager = CheckpointManager(
            tf.train.Checkpoint(model=model, optimizer=optimizer),
            args.store,
            coordinator=coordinator,
            step_counter=model.step,
            policy=schedule,
        )
        manager.restore_or_initialize()
        restored = manager.restored
        trainer.next_index = int(model.step.numpy())
        if restored is not None:
            progress.emit("restored", source=restored.source, step=restored.step, id=restored.id)
        return Job(model, trainer, manager)

    def train(job: Job) -> int:
        while (step := int(job.model.step.numpy())) < args.steps:
            state["seen"] = step
            progress.emit("step", step=step, memory=state["memory"], durable=state["durable"])
            handle = job.manager.maybe_save(step)
            if handle is not None:
                durable = job.manager.context.durable.step == step
                if durable:
                    handle.result(timeout=120)  # committed to the durable log (the demo reports real commits)
                    state["durable"] = step
                elif hasattr(handle, "restorable"):
                    handle.restorable(timeout=120)  # acknowledged: in the agent's memory tier
                state["memory"] = step
                tier = "durable" if durable else "memory"
                progress.emit("save", step=step, tier=tier, stall=handle.stall_seconds)
                if not state["kill_sent"] and step >= args.kill_at and state["durable"] is not None:
                    state["kill_sent"] = True
                    progress.emit("kill", step=step)
            job.trainer.train(args.chunk)
        job.manager.close()
        return int(job.model.step.numpy())

    def close(job: Job) -> None:
        progress.emit("failure", seen=state["seen"], memory=state["memory"], durable=state["durable"])
        job.manager.close(timeout=30)

    def restart_ps(failed_at: float) -> None:
        outcome = restart_ps_servers(failed_at=failed_at)
        progress.emit("ps-restarted", peers=outcome.get("peers"), seconds=outcome.get("seconds"))

    def on_recovery(event: RecoveryEvent) -> None:
        progress.emit("recovery", attempt=event.attempt, seconds=event.seconds, error=event.error)

    final, report = run_with_recovery(build, train, restart_ps=restart_ps, close=close, on_recovery=on_recovery)
    progress.emit("done", step=final, recoveries=len(report.recoveries))
    progress.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
