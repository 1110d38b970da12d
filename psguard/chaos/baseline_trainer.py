"""The plain-TF practice the chaos harness compares psguard with (``psguard chaos run --baseline``).

The same model, data, chunking and seed as :mod:`psguard.demo_trainer`, but checkpointed the usual way:
``tf.train.CheckpointManager.save`` every ``--durable-every`` steps, and no recovery in the trainer: on a cluster
failure it exits 1 and the "script" (the harness) restarts the whole job, every server and a new trainer, which
restores the latest checkpoint. It writes the same ``op`` lines as the psguard trainer (a save is a ``capture``
plus a ``durable-commit``), so the same checkers judge both.

With ``--mirror URL`` (a case on S3, GCS or HDFS) the checkpoints live on the case's store, as with TF's own
filesystem for it (this TF has none built in): a save writes the local folder, then uploads its files and last
the ``checkpoint`` state file before it counts as done; a start downloads the folder first. psguard's store and
TF's then cost the same network and face the same store faults.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    from psguard.demo_trainer import Progress, error_line

    progress = Progress(args.progress, fsync=True)
    progress.emit("start", pid=os.getpid(), target=args.steps)
    import json

    spec = json.loads(os.environ["TF_CONFIG"])["cluster"]
    if not _servers_up(args.servers.split(",") if args.servers else spec["ps"] + spec["worker"]):
        return 1
    job = _Job(args, progress, len(spec["ps"]))
    try:
        job.run()
    except Exception as e:  # a plain-TF chief dies with its cluster; the script restarts the whole job
        progress.emit("failure", seen=job.step, error=error_line(e, type(e).__name__))
        progress.close()
        os._exit(1)  # the open operation stays without completion: its outcome is unknown (info)
    progress.emit("done", step=job.step)
    progress.close()
    os._exit(0)  # a normal exit tears TF down for seconds; the job is done


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m psguard.chaos.baseline_trainer")
    p.add_argument("--store", required=True, help="the tf.train.CheckpointManager folder")
    p.add_argument("--mirror", help="the store URL that holds the checkpoints (the folder is its local copy)")
    p.add_argument("--progress", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--durable-every", type=int, default=25)
    p.add_argument("--durable-min-seconds", type=float, default=0.0, help="and at least this long since the last")
    p.add_argument("--durable-cron", help="or whenever a time this cron expression matches came since the last")
    p.add_argument("--chunk", type=int, default=5)
    p.add_argument("--vocab", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--servers",
        help="the servers' own addresses to wait for, comma-separated (default: the cluster spec's; a proxy in the "
        "path listens before its server does)",
    )
    return p


def _servers_up(addresses: list[str]) -> bool:
    """The script's readiness check: every server's port open (within 2 minutes each)."""
    from psguard.ports import port_open

    for addr in addresses:
        host, port = addr.rsplit(":", 1)
        deadline = time.monotonic() + 120
        while not port_open(host, int(port)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    return True


class _Job:
    """The plain-TF job's chief: restore the latest checkpoint, train with saves on the cadence, evaluate."""

    def __init__(self, args: argparse.Namespace, progress: Any, num_ps: int) -> None:
        import tensorflow as tf

        from psguard.testbed.model import ModelConfig

        self.args = args
        self.progress = progress
        self.step = 0  # the step reached: a failure's record says it
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        self.strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps)
        )
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        self.config = ModelConfig(vocab_size=args.vocab, embedding_dim=args.dim, batch_size=args.batch, seed=args.seed)

    def run(self) -> None:
        import tensorflow as tf

        from psguard.demo_trainer import timed_digest
        from psguard.testbed.model import RecModel, Trainer, make_optimizer

        args, progress, config = self.args, self.progress, self.config
        with self.strategy.scope():
            model = RecModel(config)
            optimizer = make_optimizer("adagrad")
        trainer = Trainer(self.strategy, self.coordinator, model, optimizer)
        mirror = _Mirror(args.mirror, Path(args.store)) if args.mirror else None
        progress.op("invoke", "restore")
        if mirror is not None:
            mirror.fetch()  # a store that is down fails the start: TF cannot read its checkpoints either
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), args.store, None)
        path = manager.restore_or_initialize()
        self.step = int(model.step.numpy())
        trainer.next_index = self.step
        digest, seconds = timed_digest(model, optimizer)
        progress.op("ok", "restore", step=self.step, source="durable" if path else None, id=path,
                    digest=digest, harness_seconds=round(seconds, 4))  # fmt: skip
        self.train(model, optimizer, trainer, manager, mirror, saved=self.step if path else None)
        self.evaluate(model, config)

    def train(
        self, model: Any, optimizer: Any, trainer: Any, manager: Any, mirror: _Mirror | None, saved: int | None
    ) -> None:
        """Train to ``--steps``, saving on psguard's trainer's cadence: steps, and a time floor if set, or a cron's
        time since the last save began (or the start)."""
        from psguard.demo_trainer import cron_came, durable_cadence_due, timed_digest

        args, progress = self.args, self.progress
        saved_at: float | None = None
        saved_wall = time.time()
        while self.step < args.steps:
            step, now = self.step, time.monotonic()
            if durable_cadence_due(
                saved, saved_at, step, args.durable_every, args.durable_min_seconds, now
            ) or cron_came(args.durable_cron, since=saved_wall, now=time.time()):
                digest, seconds = timed_digest(model, optimizer)  # with the invoke, as the psguard trainer's
                progress.op("invoke", "capture", step=step, tiers=["durable"], digest=digest,
                            harness_seconds=round(seconds, 4))  # fmt: skip
                progress.op("ok", "capture", step=step)
                progress.op("invoke", "durable-commit", step=step)
                began, began_wall = time.monotonic(), time.time()  # the cadence's floor counts from here
                saved_path = manager.save(checkpoint_number=step)
                if mirror is not None:
                    mirror.push(saved_path)
                progress.op("ok", "durable-commit", step=step, id=saved_path)
                saved, saved_at, saved_wall = step, began, began_wall
            progress.op("invoke", "train", step=step, steps=args.chunk)
            trainer.train(args.chunk)
            self.step = int(model.step.numpy())
            progress.op("ok", "train", step=self.step)

    def evaluate(self, model: Any, config: Any) -> None:
        """The final loss on a fixed batch (as the psguard trainer's)."""
        import tensorflow as tf

        from psguard.testbed.model import labels_for

        self.progress.op("invoke", "eval", step=self.step)
        ids = tf.random.stateless_uniform(
            [2048, config.features], seed=[self.args.seed, 7919], maxval=config.vocab_size, dtype=tf.int64
        )
        labels = labels_for(ids)
        loss = float(tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=model(ids))))
        self.progress.op("ok", "eval", step=self.step, loss=loss)


class _Mirror:
    """The checkpoint folder kept on a store, file by file, with psguard's storage backends and their retries
    (TF's filesystems retry too)."""

    def __init__(self, url: str, folder: Path, storage_options: dict[str, Any] | None = None) -> None:
        from psguard.storage import open_backend

        # Credentials and endpoint from the environment (the trainer's), as TF's would be.
        self.backend = open_backend(url, storage_options)
        self.folder = folder

    def fetch(self) -> None:
        """The folder as the store holds it, nothing else: a new trainer starts from the store."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        for key in self.backend.keys(""):  # keys take folder-like prefixes: TF's names are filtered here
            if key == "checkpoint" or key.startswith("ckpt-"):
                (self.folder / key).write_bytes(self.backend.get(key))

    def push(self, path: str) -> None:
        """The files of the checkpoint ``path``, then the state file naming it: a save cut short leaves the
        store's state file on the one before, as TF's saver leaves it."""
        for file in sorted(self.folder.glob(Path(path).name + ".*")):
            self.backend.put(file.name, file.read_bytes())
        self.backend.put("checkpoint", (self.folder / "checkpoint").read_bytes())


if __name__ == "__main__":
    raise SystemExit(main())
