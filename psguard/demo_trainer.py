"""The trainer ``psguard demo`` and ``psguard chaos run`` start under the chief's ``psguard agent``.

Run as ``python -m psguard.demo_trainer``. It trains the recommendation-style
:class:`~psguard.testbed.model.RecModel` on the cluster the agent describes (``TF_CONFIG``), checkpoints with
:class:`psguard.CheckpointManager` (memory tier every ``--memory-every`` steps through the agent's spool,
durable every ``--durable-every``) and recovers from a lost PS in process
(:func:`psguard.trainer.recovery.run_with_recovery` with :func:`psguard.handoff.client.restart_ps_servers`).

It appends one JSON object per line to ``--progress`` (the parent reads it while it grows; with ``--fsync``
every line is on disk before the trainer goes on). Two kinds of line:

- demo events, for the live view: ``start``, ``step`` (after every chunk of steps), ``save`` (tier, stall),
  ``kill`` (a checkpoint of each tier exists and the step reached ``--kill-at``: the parent may inject its
  fault now), ``failure``, ``ps-restarted``, ``restored``, ``recovery``, ``done``;
- ``op`` lines, the trainer's half of the chaos history (:mod:`psguard.chaos.history`): an ``invoke`` before
  each operation and ``ok`` / ``fail`` / ``info`` after it, stamped with ``time.monotonic()`` (system-wide on
  Linux, so they merge with the harness's records). Operations: ``train`` (a chunk of steps), ``capture``,
  ``memory-commit``, ``durable-commit``, ``restore``, ``eval`` (the final loss). A capture and a restore carry
  a digest of every model and optimizer variable as read back from the PS servers: a restore is proven right
  when its digest equals the one taken when that step was captured.

The saves are decided here (every N steps per tier) rather than by a policy object so that each one is an
explicit operation of the history with the tiers it asked for.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

if TYPE_CHECKING:
    from psguard.trainer.recovery import RecoveryEvent


@dataclass
class Job:
    model: Any
    optimizer: Any
    trainer: Any
    manager: Any


class Progress:
    """Append-only JSON lines, one ``write`` + flush (and fsync with ``fsync``) per line."""

    def __init__(self, path: str, *, fsync: bool = False) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._fsync = fsync
        self._lock = threading.Lock()  # the step loop and the durable acks' threads write lines
        self.process = f"trainer-{os.getpid()}"

    def _write(self, doc: dict[str, Any]) -> None:
        line = json.dumps(doc, default=str) + "\n"
        with self._lock:
            if self._f.closed:  # a durable answer that came after the trainer finished: past the history
                return
            self._f.write(line)
            self._f.flush()
            if self._fsync:
                os.fsync(self._f.fileno())

    def emit(self, event: str, **doc: Any) -> None:
        self._write({"event": event, "t": time.time(), **doc})

    def op(self, type: str, f: str, *, process: str | None = None, **value: Any) -> None:
        """One history record of this trainer (see :mod:`psguard.chaos.history`); ``process``: one of its
        logical processes (each has at most one operation of a kind open), this trainer's by default."""
        self._write(
            {"event": "op", "t": time.time(), "mono": time.monotonic(), "process": process or self.process,
             "type": type, "f": f, "value": value}
        )  # fmt: skip

    def close(self) -> None:
        with self._lock:
            self._f.close()


class SaveAcks:
    """Waits for the answers of the saves off the step loop, one thread per save and tier, each recording its
    ``memory-commit`` or ``durable-commit`` outcome when it comes (a user's job does not wait on its saves either:
    the sync wait made the harness's own time under a slow store look like slow recoveries, a failed durable write
    exit the trainer, and the memory tier's acknowledgement cost every capture a round trip that plain TF's run
    does not pay). The store's write rate does not follow the step rate for that: the agent writes one durable
    save at a time and folds the requests that arrive meanwhile into the next write. A new generation (after a
    recovery) does not wait for the old one's: their threads still record what the agent answers, or ``info``
    (unknown) at the timeout. Several are open at once, so each is an operation of a logical process of its own
    (``trainer-PID/durable-N``, ``trainer-PID/memory-N``; the history pairs one invoke with one completion per
    process); each durable completion names the step asked (``asked``) beside the step the agent committed (a
    request folded into a later write commits that write's step)."""

    def __init__(self, progress: Progress, timeout: float) -> None:
        self._progress = progress
        self._timeout = timeout
        self._lock = threading.Lock()
        self._generation = 0
        self._threads: list[threading.Thread] = []
        self._count = 0
        self.acked: int | None = None  # the newest step this generation saw durable

    def begin(self, step: int, tier: str = "durable") -> str:
        """Record the ``durable-commit`` (``tier="memory"``: ``memory-commit``) invoke of the save of ``step``,
        before the save is handed off: the commit is in flight from then on. The memory tier may apply (and
        answer) a capture while :meth:`CheckpointManager.save` still waits (the policy's ``durable_lag``), so an
        invoke recorded after ``save`` returned put a commit made before a node loss after it (explore seed 25
        case 7: a PS node lost 0.08 s before the trainer saw the answer its agents had given before)."""
        f = f"{tier}-commit"
        with self._lock:
            self._count += 1
            process = f"{self._progress.process}/{tier}-{self._count}"
            self._progress.op("invoke", f, process=process, step=step)  # before any completion
            return process

    def unknown(self, process: str, step: int, error: str, tier: str = "durable") -> None:
        """The save failed after its hand-off may have begun: its commit's outcome is unknown."""
        extra = {"asked": step} if tier == "durable" else {}
        self._progress.op("info", f"{tier}-commit", process=process, step=step, error=error, **extra)

    def add(self, step: int, handle: Any, process: str) -> None:
        """Await the answer of the save of ``step`` (its invoke recorded by :meth:`begin`) off this thread."""
        self._thread(self._await, (self._generation, process, step, handle), f"durable-ack-{step}")

    def memory(self, step: int, handle: Any, process: str) -> None:
        """Await the memory tier's answer of the save of ``step`` (its invoke recorded by :meth:`begin`) off this
        thread. A refused or late one is recorded and training goes on, as a user's job does (it does not ask):
        the PS or node behind it fails the next step, and that is the recovery the history should show."""
        self._thread(self._await_memory, (process, step, handle), f"memory-ack-{step}")

    def _thread(self, target: Any, args: tuple[Any, ...], name: str) -> None:
        with self._lock:
            thread = threading.Thread(target=target, args=args, name=name, daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _await_memory(self, process: str, step: int, handle: Any) -> None:
        record = self._progress.op
        try:
            if hasattr(handle, "restorable"):
                handle.restorable(timeout=self._timeout)  # acknowledged: in the agent's memory tier
        except TimeoutError as e:
            record("info", "memory-commit", process=process, step=step, error=str(e)[:300])
        except Exception as e:
            record("fail", "memory-commit", process=process, step=step, error=error_line(e))
        else:
            record("ok", "memory-commit", process=process, step=step)

    def new_generation(self, restored: int | None) -> None:
        with self._lock:
            self._generation += 1
            self.acked = restored

    def join(self, timeout: float) -> None:
        """Until every open durable save (of any generation) has its outcome recorded, or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _await(self, generation: int, process: str, step: int, handle: Any) -> None:
        record = self._progress.op
        try:
            info = handle.result(timeout=self._timeout)  # committed to the durable log
        except TimeoutError as e:
            record("info", "durable-commit", process=process, step=step, asked=step, error=str(e)[:300])
        except Exception as e:  # a node lost mid-write, a store down: recorded; the job goes on, as a user's would
            error = error_line(e, type(e).__name__)
            record("fail", "durable-commit", process=process, step=step, asked=step, error=error)
        else:
            record("ok", "durable-commit", process=process, step=info.step, asked=step, id=info.id)
            with self._lock:
                if generation == self._generation:
                    self.acked = max(step, self.acked or step)


def variables_digest(model: Any, optimizer: Any) -> dict[str, str]:
    """A digest per model and optimizer variable (by name), computed on the PS that holds it, and ``"*"`` over all.

    Taken after a capture (the coordinator is drained, so it is the captured state) and after a restore; equal
    digests mean the restore brought back exactly that state, every shard of it from the same step. Each shard
    is hashed where it lives: on its PS device, farmhash64 of every row's bytes, then of those row hashes, so 8
    bytes per shard reach the trainer rather than the shard (at 1 GB of state, reading every variable back to
    the trainer at each capture stalled it about 5 s: the harness measured itself, not psguard). A change goes
    unseen only if two 64-bit hashes collide.

    All shards are hashed by one compiled function: one call, every PS hashing its shards at once. Op by op
    from Python it was 5 remote round trips per shard, one after another: 0.5 s per capture on a 2-shard
    smoke job, most of its training time.
    """
    total = hashlib.sha256()
    out: dict[str, str] = {}
    variables = list(model.variables) + list(getattr(optimizer, "variables", []))
    named = sorted(((str(v.name), v) for v in variables), key=lambda item: item[0])
    shards = [list(getattr(v, "variables", None) or [v]) for _, v in named]
    hashes = iter(_shard_fingerprints(tuple(s for group in shards for s in group)))
    for (name, v), group in zip(named, shards, strict=True):
        one = hashlib.sha256(str(v.dtype.name).encode() + str(tuple(v.shape)).encode())
        for _ in group:
            one.update(next(hashes))
        key = name if name not in out else f"{name}#{len(out)}"
        out[key] = one.hexdigest()[:16]
        total.update(key.encode() + b"\0" + one.hexdigest().encode())
    out["*"] = total.hexdigest()
    return out


def error_line(e: BaseException, empty: str = "") -> str:
    """The first line of ``e``'s message, at most 300 characters (``empty`` when it has none), for a record."""
    text = str(e)
    return text.splitlines()[0][:300] if text else empty


def timed_digest(model: Any, optimizer: Any) -> tuple[dict[str, str], float]:
    """:func:`variables_digest` and the seconds it took: the harness's own time, which the chaos report keeps out
    of psguard's figures (goodput), since a user's job does not digest its variables."""
    t0 = time.perf_counter()
    taken = variables_digest(model, optimizer)
    return taken, time.perf_counter() - t0


#: The compiled fingerprint function per set of shards (a restored job has new variables; slots appear late).
_FINGERPRINTS: dict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = {}


def _shard_fingerprints(shards: tuple[Any, ...]) -> list[bytes]:
    """farmhash64 of every shard's row hashes, computed on each shard's device, as 8 bytes per shard."""
    import tensorflow as tf  # lazy: the demo's CLI parses arguments before TensorFlow loads

    key = tuple(id(s) for s in shards)
    cached = _FINGERPRINTS.get(key)
    if cached is None:

        @tf.function  # type: ignore[untyped-decorator]
        def fingerprints() -> list[Any]:
            hashed = []
            for shard in shards:
                with tf.device(shard.device):
                    value = shard.read_value()
                    rows = (
                        tf.reshape(value, [1, -1])
                        if value.shape.rank == 0
                        else tf.reshape(value, [tf.shape(value)[0], -1])
                    )
                    hashed.append(tf.fingerprint(tf.reshape(tf.fingerprint(rows), [1, -1])))
            return hashed

        _FINGERPRINTS.clear()  # the previous job's variables are gone: keep one function, not one per restore
        cached = _FINGERPRINTS[key] = (shards, fingerprints)  # the shards held: their ids stay theirs
    return [t.numpy().tobytes() for t in cached[1]()]


#: The signal the chaos harness sends to make this trainer's step loop block forever (a ``hang`` fault).
HANG_SIGNAL = signal.SIGUSR2


def hang_forever() -> None:
    """An input pipeline that never returns: the process lives and answers signals, no step is made."""
    threading.Event().wait()


def durable_cadence_due(
    last_step: int | None, last_at: float | None, step: int, every: int, min_seconds: float, now: float
) -> bool:
    """The demo's durable cadence: ``every`` steps since the last durable save, and at least ``min_seconds`` since
    it began (a time floor, as week-long jobs set). The plain-TF baseline saves on the same rule, so that the two
    runs of a chaos case have the same cadence. The floor counts from the save's start, as TF's own
    ``CheckpointSaverHook`` timer counts from its trigger: counted from its end, a saver that takes 4 s saved
    every ~70 steps where one that takes 2.3 s saved every ~27 under the same "every 10 steps, 2 s apart", and the
    faster one was judged the slower (explore seed 26 case 10)."""
    if last_step is not None and step - last_step < every:
        return False
    return last_at is None or now - last_at >= min_seconds


def cron_came(expr: str | None, *, since: float, now: float) -> bool:
    """Whether a time the cron expression ``expr`` matches came after ``since`` and by ``now`` (seconds since the
    epoch): the demo's durable cadence also saves then, wherever the step is (a policy file's ``durable: {cron:
    ...}``, decided by psguard's own :class:`~psguard.policy.engine.Cron`). The plain-TF baseline too."""
    if expr is None:
        return False
    from psguard.policy.engine import Cron, SaveContext, TierState

    return bool(Cron(expr).should_save(0, now, last=TierState(at=since), context=SaveContext()))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m psguard.demo_trainer")
    p.add_argument("--store", required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--fsync", action="store_true", help="fsync every progress line (chaos runs)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--max-to-keep", type=int, help="retention: keep the newest N checkpoints (default: all)")
    p.add_argument(
        "--finish-file",
        help='a soak\'s end: once this file holds {"step": N}, train to step N (not --steps) and finish',
    )
    p.add_argument("--kill-at", type=int, default=100)
    p.add_argument("--memory-every", type=int, default=5)
    p.add_argument("--durable-every", type=int, default=25)
    p.add_argument(
        "--durable-min-seconds", type=float, default=0.0,
        help="and at least this long after the last durable save (a soak's store writes at a bounded rate)",
    )  # fmt: skip
    p.add_argument(
        "--durable-cron",
        help="and whenever a time this cron expression matches came since the last durable save (UTC; a sixth field "
        "counts seconds)",
    )  # fmt: skip
    p.add_argument("--new-base-after", type=int, help="the CheckpointManager's new_base_after (a new base after N)")
    p.add_argument("--chunk", type=int, default=5, help="steps scheduled per coordinator join")
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digest", action="store_true", help="digest the variables at every capture and restore")
    p.add_argument("--save-timeout", type=float, default=120.0)
    p.add_argument("--hang-after", type=float, help="seconds without a step before the agent declares a hang")
    return p


@dataclass
class Cadence:
    """Where the saves stand, across generations: what the next save's tiers are decided from."""

    seen: int = 0  # the last step the step loop reached
    kill_sent: bool = False
    memory: int | None = None  # the last step saved to the memory tier (its answer: SaveAcks)
    durable: int | None = None  # the last step asked durable (the acknowledged one is SaveAcks.acked)
    durable_at: float | None = None  # when (monotonic)
    durable_wall: float = field(default_factory=time.time)  # wall time of the last durable save, for --durable-cron

    @staticmethod
    def due(last: int | None, every: int, step: int) -> bool:
        return last is None or step - last >= every


class DemoTrainer:
    """One trainer process's run: its cluster and model, the saves it decides, and its half of the history. The
    ``build`` / ``train`` / ``close`` that :func:`psguard.trainer.recovery.run_with_recovery` calls per
    generation are its methods."""

    def __init__(self, args: argparse.Namespace) -> None:
        import tensorflow as tf

        from psguard.testbed.model import ModelConfig

        self.args = args
        self.progress = Progress(args.progress, fsync=args.fsync)
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        num_ps = len(resolver.cluster_spec().as_dict().get("ps", []))
        partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(max(1, num_ps))
        self.strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        self.config = ModelConfig(vocab_size=args.vocab, embedding_dim=args.dim, batch_size=args.batch, seed=args.seed)
        self.state = Cadence()
        self.acks = SaveAcks(self.progress, args.save_timeout)
        self.stuck = threading.Event()  # the chaos harness's hang fault: SIGUSR2 makes the step loop block for good
        signal.signal(HANG_SIGNAL, lambda *_: self.stuck.set())
        self.progress.emit("start", pid=os.getpid(), target=args.steps, memory_every=args.memory_every,
                           durable_every=args.durable_every, chunk=args.chunk)  # fmt: skip

    def digest(self, model: Any, optimizer: Any) -> dict[str, Any]:
        """The digest fields of a capture or restore record (none without --digest)."""
        if not self.args.digest:
            return {"digest": None}
        taken, seconds = timed_digest(model, optimizer)
        return {"digest": taken, "harness_seconds": round(seconds, 4)}

    # ------------------------------------------------------------------------------------- a generation
    def build(self) -> Job:
        import tensorflow as tf

        from psguard.policy.files import HangSpec
        from psguard.testbed.model import RecModel, Trainer, make_optimizer
        from psguard.trainer.manager import CheckpointManager
        from psguard.trainer.options import ManagerOptions

        args = self.args
        with self.strategy.scope():
            model = RecModel(self.config)
            optimizer = make_optimizer("adagrad")
        trainer = Trainer(self.strategy, self.coordinator, model, optimizer)
        options = ManagerOptions(
            coordinator=self.coordinator,
            hang=HangSpec(after=args.hang_after) if args.hang_after else None,
            new_base_after=args.new_base_after,
        )
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
        manager = CheckpointManager(
            checkpoint, args.store, max_to_keep=args.max_to_keep, step_counter=model.step, options=options
        )
        job = Job(model, optimizer, trainer, manager)
        self.restore(job)
        return job

    def restore(self, job: Job) -> None:
        """Restore the new generation's state, recorded as a ``restore`` operation, and count its saves from it."""
        progress, state = self.progress, self.state
        progress.op("invoke", "restore")
        try:
            job.manager.restore_or_initialize()
        except Exception as e:
            progress.op("fail", "restore", error=str(e)[:500])
            raise
        restored = job.manager.restored
        job.trainer.next_index = int(job.model.step.numpy())
        # The saves of a new generation count from what it restored; the durable cadence from the last durable
        # save when the state came from the memory tier (not durable: a node lost next must not fall back further).
        state.memory = restored.step if restored is not None else None
        if restored is None or restored.source == "durable":
            state.durable = state.memory
        state.durable_at = None
        self.acks.new_generation(state.durable)
        if restored is not None:
            progress.op("ok", "restore", step=restored.step, source=restored.source, id=restored.id,
                        **self.digest(job.model, job.optimizer))  # fmt: skip
            progress.emit("restored", source=restored.source, step=restored.step, id=restored.id)
        else:
            progress.op("ok", "restore", step=0, source=None, id=None, **self.digest(job.model, job.optimizer))

    def close(self, job: Job) -> None:
        self.progress.emit("failure", seen=self.state.seen, memory=self.state.memory, durable=self.acks.acked)
        job.manager.close(timeout=30)

    def restart_ps(self, failed_at: float) -> None:
        from psguard.handoff.client import restart_ps_servers

        outcome = restart_ps_servers(failed_at=failed_at)
        self.progress.emit("ps-restarted", peers=outcome.get("peers"), seconds=outcome.get("seconds"))

    def on_recovery(self, event: RecoveryEvent) -> None:
        self.progress.emit("recovery", attempt=event.attempt, seconds=event.seconds, error=event.error)

    # -------------------------------------------------------------------------------------------- saves
    def durable_due(self, step: int) -> bool:
        args, state = self.args, self.state
        return durable_cadence_due(
            state.durable, state.durable_at, step, args.durable_every, args.durable_min_seconds, time.monotonic()
        ) or cron_came(args.durable_cron, since=state.durable_wall, now=time.time())

    def save(self, job: Job, step: int) -> None:
        """One save of ``step``, recorded as a ``capture``, its ``memory-commit`` and, when durable, its
        ``durable-commit`` (awaited off the step loop by :class:`SaveAcks`)."""
        from psguard.handoff.contract import Tier

        progress, state = self.progress, self.state
        durable = self.durable_due(step)
        tiers = frozenset({Tier.MEMORY, Tier.DURABLE} if durable else {Tier.MEMORY})
        named = sorted(str(t) for t in tiers)
        try:
            taken = self.digest(job.model, job.optimizer)  # the cluster is drained: this is the state captured next
        except Exception as e:  # nothing was handed to the agent: the capture did not happen
            progress.op("invoke", "capture", step=step, tiers=named)
            progress.op("fail", "capture", step=step, error=error_line(e))
            raise
        # The digest goes with the invoke: a trainer killed inside the save leaves a capture its agent may hold
        # (and restore), and the history must still say what that capture was.
        progress.op("invoke", "capture", step=step, tiers=named, **taken)
        memory = self.acks.begin(step, "memory")
        commit = self.acks.begin(step) if durable else None
        began, began_wall = time.monotonic(), time.time()  # the cadence's floor counts from here
        try:
            handle = job.manager.save(step, tiers=tiers)
        except Exception as e:  # it may have reached the agent's memory tier before the failure: unknown
            progress.op("info", "capture", step=step, error=error_line(e))
            self.acks.unknown(memory, step, error_line(e), "memory")
            if commit is not None:
                self.acks.unknown(commit, step, error_line(e))
            raise
        # hold: how long the save waited for the durable log (the policy's durable_lag), on top of the stall.
        progress.op(
            "ok", "capture", step=step, stall=handle.stall_seconds, hold=round(job.manager.last_hold_seconds, 4)
        )
        state.memory = step  # the cadence counts from the save, as a user's loop does
        self.acks.memory(step, handle, memory)
        if commit is not None:
            state.durable, state.durable_at, state.durable_wall = step, began, began_wall
            self.acks.add(step, handle, commit)
        progress.emit("save", step=step, tier="durable" if durable else "memory", stall=handle.stall_seconds,
                      hold=job.manager.last_hold_seconds)  # fmt: skip

    # ----------------------------------------------------------------------------------------- training
    def target(self) -> int:
        """``--steps``, or the step a soak's harness asked to finish at (it writes the file atomically)."""
        if self.args.finish_file is None:
            return int(self.args.steps)
        try:
            return int(json.loads(Path(self.args.finish_file).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return int(self.args.steps)

    def train(self, job: Job) -> int:
        args, progress, state = self.args, self.progress, self.state
        while (step := int(job.model.step.numpy())) < self.target():
            state.seen = step
            progress.emit("step", step=step, memory=state.memory, durable=self.acks.acked)
            if state.due(state.memory, args.memory_every, step):
                self.save(job, step)
                if not state.kill_sent and step >= args.kill_at and self.acks.acked is not None:
                    state.kill_sent = True
                    progress.emit("kill", step=step)
            if self.stuck.is_set():
                progress.emit("hung", step=step)
                hang_forever()
            progress.op("invoke", "train", step=step, steps=args.chunk)
            try:
                job.trainer.train(args.chunk)
            except Exception as e:
                progress.op("info", "train", error=error_line(e, type(e).__name__))
                raise
            progress.op("ok", "train", step=int(job.model.step.numpy()))
        job.manager.close()
        self.acks.join(args.save_timeout)  # every save's answer in the history before the final records
        final = int(job.model.step.numpy())
        self.evaluate(job, final)
        return final

    def evaluate(self, job: Job, step: int) -> None:
        """The final loss on a fixed batch, for the chaos checker that compares it with a fault-free run."""
        import tensorflow as tf

        from psguard.testbed.model import labels_for

        config = self.config
        self.progress.op("invoke", "eval", step=step)
        try:
            ids = tf.random.stateless_uniform(
                [2048, config.features], seed=[self.args.seed, 7919], maxval=config.vocab_size, dtype=tf.int64
            )
            labels = labels_for(ids)
            logits = job.model(ids)
            loss = float(tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)))
        except Exception as e:  # the loss is evidence for a checker, not a reason to fail the run
            self.progress.op("fail", "eval", step=step, error=str(e)[:300])
            return
        self.progress.op("ok", "eval", step=step, loss=loss)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    from psguard.trainer.recovery import run_with_recovery

    run = DemoTrainer(args)
    final, report = run_with_recovery(
        run.build, run.train, restart_ps=run.restart_ps, close=run.close, on_recovery=run.on_recovery
    )
    run.progress.emit("done", step=final, recoveries=len(report.recoveries))
    run.progress.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
