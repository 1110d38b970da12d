"""Where a captured save goes, chosen once per manager (:func:`choose_sink`): :class:`StoreSink` commits it to
the durable log on a background thread (one job writing, one waiting, later saves folded into it, a failed
write's rows carried into the next), :class:`AgentSink` hands it to ``psguard agent`` through the spool (its
memory tier makes it *restorable*, its writer *durable*). Both give a :class:`SaveHandle`; ``wait`` means every
save since the last wait reached the strongest tier it was for, or it raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Literal

from psguard.errors import ConfigError, NoCheckpointError, PsguardError, SaveError
from psguard.handoff.contract import ENV_SPOOL, ENV_STORE, NEW_BASE_KEY, RETENTION_KEY, STALL_KEY, Tier
from psguard.handoff.parts import PartCapture, ShardKey
from psguard.handoff.spool import Capture, NeedFullCaptureError, Restored
from psguard.policy.engine import ChainLimit, Retention, base_rule
from psguard.storage.registry import canonical_url
from psguard.store import CheckpointInfo, Store
from psguard.store.durable import ChainState, DurableWriter
from psguard.tensors import Full, Rows, TensorUpdate, merge_updates
from psguard.trainer.spool_writer import CaptureHandle, SpoolWriter

log = logging.getLogger(__name__)

#: Deltas after which the chain gets a new base when the manager sets none (the agent's ``max_chain`` default too).
NEW_BASE_AFTER = 16

BOTH = frozenset({Tier.MEMORY, Tier.DURABLE})


@dataclass(frozen=True)
class MemoryCheckpoint:
    """A save held by the agent's memory tier only: restorable from it, not written to the durable log."""

    step: int
    token: str


@dataclass(frozen=True)
class Restorable:
    """Where a save survives this process. ``copies``: with peer copies on, each PS task whose rows the agents
    keep -> the PS task whose agent holds a copy (``None``: none yet); ``durable``: committed to the log."""

    step: int
    copies: Mapping[str, str | None]
    durable: bool = False


class SaveHandle:
    """The pending result of one :meth:`CheckpointManager.save`.

    ``result(timeout)`` waits for the strongest tier the save was for: the committed
    :class:`~psguard.store.CheckpointInfo`, or a :class:`MemoryCheckpoint` of a memory-only save; it re-raises
    why the save failed. ``restorable(timeout)`` returns once the save survives this process. Folded saves all
    resolve to the checkpoint that contains them.
    """

    def __init__(self, step: int, stall_seconds: float, tiers: frozenset[Tier]) -> None:
        self.step = step
        self.stall_seconds = stall_seconds
        self.tiers = tiers

    @property
    def durable(self) -> bool:
        """Whether this save was asked to reach the durable log."""
        return Tier.DURABLE in self.tiers

    def result(self, timeout: float | None = None) -> CheckpointInfo | MemoryCheckpoint:
        raise NotImplementedError

    def restorable(self, timeout: float | None = None) -> Restorable:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def store_retrying(self) -> str | None:
        """Why the durable write is failing and being retried while this save waits for it (``None``: it is not,
        or no memory tier keeps the save restorable meanwhile, so only its answer counts)."""
        return None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except TimeoutError:
            raise
        except BaseException as e:
            return e
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(step={self.step}, {'done' if self.done() else 'pending'})"


class _StoreSaveHandle(SaveHandle):
    def __init__(self, step: int, stall_seconds: float, tiers: frozenset[Tier]) -> None:
        super().__init__(step, stall_seconds, tiers)
        self.future: Future[CheckpointInfo] = Future()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        try:
            return self.future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"save of step {self.step} not durable within {timeout}s") from None

    def restorable(self, timeout: float | None = None) -> Restorable:
        info = self.result(timeout)  # no memory tier without an agent: restorable means committed
        return Restorable(info.step, {}, durable=True)

    def done(self) -> bool:
        return self.future.done()


class _AgentSaveHandle(SaveHandle):
    def __init__(self, step: int, stall_seconds: float, spooled: CaptureHandle, store: Store) -> None:
        super().__init__(step, stall_seconds, spooled.tiers)
        self._spooled = spooled
        self._store = store
        self._outcome: CheckpointInfo | MemoryCheckpoint | BaseException | None = None

    def restorable(self, timeout: float | None = None) -> Restorable:
        ack = self._spooled.result(timeout)
        return Restorable(self.step, dict(ack.copies or {}))

    def result(self, timeout: float | None = None) -> CheckpointInfo | MemoryCheckpoint:
        if self._outcome is None:
            self._outcome = self._wait(timeout)
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def _wait(self, timeout: float | None) -> CheckpointInfo | MemoryCheckpoint | BaseException:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            ack = self._spooled.result(timeout)  # TimeoutError propagates: the outcome is still unknown
            if not self.durable:
                return MemoryCheckpoint(self.step, str(ack.token))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            durable = self._spooled.durable(left)
            return CheckpointInfo.of(self._store.manifest(str(durable.checkpoint)))
        except TimeoutError:
            raise
        except PsguardError as e:
            return e

    def store_retrying(self) -> str | None:
        return self._spooled.store_retrying() if self.durable and self._outcome is None else None

    def done(self) -> bool:
        spooled = self._spooled
        return self._outcome is not None or (spooled.done() and (not self.durable or spooled.durable_answered()))


@dataclass
class Job:
    """One capture on its way to a sink."""

    step: int
    updates: dict[str, TensorUpdate]
    metadata: dict[str, Any]
    metrics: dict[str, float]
    tiers: frozenset[Tier] = BOTH
    handles: list[_StoreSaveHandle] = field(default_factory=list)
    #: Shards captured into files on their PS nodes; only an agent sink takes them (never folded).
    parts: tuple[PartCapture, ...] = ()

    def fold(self, newer: Job) -> Job:
        """This job followed by ``newer``, as one."""
        merged = dict(self.updates)
        for name, update in newer.updates.items():
            merged[name] = merge_updates(merged[name], update) if name in merged else update
        return Job(
            newer.step, merged, newer.metadata, newer.metrics, self.tiers | newer.tiers, [*self.handles, *newer.handles]
        )


class StoreSink:
    """The manager's own writer: commits captures to ``store`` on a background thread (see the module doc)."""

    supervised = False

    def __init__(
        self, store: Store, *, retention: Callable[[], Retention | None], on_parent_missing: Callable[[], None]
    ) -> None:
        self.store = store
        self.new_base_after = NEW_BASE_AFTER
        self._retention = retention
        self._on_parent_missing = on_parent_missing
        self.writer = DurableWriter(store, base_rule=self._base_due, retention=self._retention_spec, compact=True)
        self._cond = threading.Condition()
        self._waiting: Job | None = None
        self._carry: Job | None = None  # rows of a failed write, folded into the next job
        self._busy = False  # a commit under way: the policy's "save in flight"
        self._tidying = False  # its compaction and retention, after the acknowledgment: not a save in flight
        self._stop = False
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="psguard-writer", daemon=True)
        self._thread.start()

    def whole_next(self) -> bool:
        return False  # the capturer sends whole tensors itself when it has no fingerprints

    def takes(self, tiers: frozenset[Tier], urgent: bool) -> bool:
        # No memory tier without an agent: memory-only saves wait for the durable cadence.
        return Tier.DURABLE in tiers or urgent

    def submit(self, job: Job, stall_seconds: float) -> SaveHandle:
        if job.parts:
            raise ConfigError("shards captured on the PS nodes need the PS agents to keep them; this sink has none")
        handle = _StoreSaveHandle(job.step, stall_seconds, job.tiers)
        job.handles.append(handle)
        with self._cond:
            if self._stop:
                raise SaveError("the checkpoint manager is closed")
            self._waiting = self._waiting.fold(job) if self._waiting is not None else job
            self._cond.notify_all()
        return handle

    def busy(self) -> frozenset[Tier]:
        return frozenset({Tier.DURABLE}) if self.in_flight() else frozenset()

    def in_flight(self) -> bool:
        with self._cond:
            return self._busy or self._waiting is not None

    def rebase(self, checkpoint_id: str | None, token: str | None) -> None:
        self.writer.adopt(checkpoint_id)

    def memory_snapshot(self, timeout: float) -> Restored | None:
        return None

    def set_new_base_after(self, deltas: int | None) -> None:
        self.new_base_after = NEW_BASE_AFTER if deltas is None else deltas

    def _base_due(self, chain: ChainState, step: int) -> bool:
        """``new_base_after``, read at each decision, as the writer's rule."""
        limit = self.new_base_after
        return limit > 0 and base_rule(ChainLimit(max_chain=limit))(chain, step)

    def _retention_spec(self, info: CheckpointInfo) -> dict[str, Any] | None:
        retention = self._retention()
        return retention.as_kwargs() if retention is not None else None

    def heartbeat(self, step: int, hang_after: float | None) -> None:
        """No agent watches this process."""

    def wait(self, timeout: float | None) -> list[BaseException]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._busy or self._tidying or self._waiting is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"pending saves not durable within {timeout}s")
                self._cond.wait(left)
            errors, self._errors = self._errors, []
            return errors

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    # ---- the writer thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._stop:
                    self._cond.wait()
                if self._waiting is None:
                    return
                job, self._waiting = self._waiting, None
                if self._carry is not None:
                    job, self._carry = self._carry.fold(job), None
                self._busy = True
            try:
                info = self.writer.save(
                    job.step,
                    job.updates,
                    whole=all(isinstance(u, Full) for u in job.updates.values()),
                    metadata=job.metadata,
                    metrics=job.metrics,
                )
            except BaseException as e:  # the handles carry it to the caller
                log.error("checkpoint write failed: %s", e)
                # Without a last commit (its parent was gone, or nothing was ever committed) a delta cannot be
                # carried over: the next capture must be whole.
                keep = self.writer.last is not None
                if not keep:
                    self._on_parent_missing()
                for h in job.handles:
                    h.future.set_exception(e)
                with self._cond:
                    if keep:
                        self._carry = Job(job.step, job.updates, job.metadata, job.metrics, job.tiers)
                    self._errors.append(e)
            else:
                for h in job.handles:
                    h.future.set_result(info)
                # After the acknowledgment a held trainer goes on, and the policy may ask for the next save, while
                # compaction and retention run (that save waits for them in the writer).
                with self._cond:
                    self._busy, self._tidying = False, True
                self.writer.tidy(info, new_base=Tier.BASE in job.tiers)
            finally:
                with self._cond:
                    self._busy = self._tidying = False
                    self._cond.notify_all()


class AgentSink:
    """Hands captures to the agent on this node through the spool (see the module doc)."""

    supervised = True

    def __init__(self, spool: SpoolWriter, store: Store, *, retention: Callable[[], Retention | None]) -> None:
        self.spool = spool
        self.store = store
        self._retention = retention
        self._new_base_after: int | None = None
        self._lock = threading.Lock()
        self._pending: list[_AgentSaveHandle] = []  # handed off since the last wait
        self._errors: list[tuple[int, bool, BaseException]] = []  # (step, durable, failure) swept before a wait
        # The newest steps whose saves reached their tier (memory, durable): see _redone.
        self._applied = {False: -1, True: -1}

    def whole_next(self) -> bool:
        return self.spool.parent is None

    def takes(self, tiers: frozenset[Tier], urgent: bool) -> bool:
        return True

    def submit(self, job: Job, stall_seconds: float) -> SaveHandle:
        metadata = dict(job.metadata)
        metadata[STALL_KEY] = round(stall_seconds, 6)  # the agent reports the training stall it cost
        retention = self._retention()
        if retention is not None:  # the agent writes the log: it applies our retention after each commit
            metadata[RETENTION_KEY] = retention.as_kwargs()
        if self._new_base_after is not None:  # one rule with one setting: it replaces the agent's max_chain
            metadata[NEW_BASE_KEY] = {"max_chain": self._new_base_after}
        spooled = self.spool.submit(Capture(job.step, job.updates, metadata, job.tiers, job.metrics, job.parts))
        handle = _AgentSaveHandle(job.step, stall_seconds, spooled, self.store)
        with self._lock:  # the pending list kept bounded: handles whose answers are in settled, failures kept
            still: list[_AgentSaveHandle] = []
            for h in self._pending:
                if not h.done():
                    still.append(h)
                elif (error := h.exception(0)) is not None:
                    self._errors.append((h.step, h.durable, error))
                else:
                    self._note_applied(h)
            self._pending = [*still, handle]
        return handle

    def busy(self) -> frozenset[Tier]:
        """Busy only until the last capture is in the memory tier: the agent folds durable requests that arrive
        during a write into the next one."""
        with self._lock:
            last = self._pending[-1] if self._pending else None
        answered = last is None or last._outcome is not None or last._spooled.done()  # applied, or refused
        return frozenset() if answered else frozenset({Tier.MEMORY})

    def in_flight(self) -> bool:
        return False  # handed off: the agent finishes it whether or not this process lives

    def rebase(self, checkpoint_id: str | None, token: str | None) -> None:
        self.spool.parent = token  # the next delta applies to exactly this state (None: send it whole)

    def set_new_base_after(self, deltas: int | None) -> None:
        self._new_base_after = deltas  # sent with each capture, for the agent's writer

    def heartbeat(self, step: int, hang_after: float | None) -> None:
        self.spool.heartbeat(step, hang_after)

    def memory_snapshot(self, timeout: float) -> Restored | None:
        if not self.spool.agent_alive():
            log.warning("no psguard agent holds spool %s: restoring from the durable log", self.spool.root)
            return None
        try:
            return self.spool.request_restore().result(timeout)
        except NoCheckpointError:
            return None
        except (TimeoutError, PsguardError) as e:
            log.warning("the memory tier could not be used (%s): restoring from the durable log", e)
            return None

    def durable_snapshot(
        self, checkpoint: str, shards: Mapping[str, Sequence[ShardKey]], timeout: float, *, force: bool = False
    ) -> Restored:
        """Every tier brought to ``checkpoint`` (each PS's agent reading its own rows), then its snapshot."""
        return self.spool.request_restore(checkpoint=checkpoint, shards=shards, force=force).result(timeout)

    def wait(self, timeout: float | None) -> list[BaseException]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending, self._pending = self._pending, []
            errors, self._errors = self._errors, []
        try:
            while pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    pending[0].result(left)
                    with self._lock:
                        self._note_applied(pending[0])
                except TimeoutError:
                    raise TimeoutError(
                        f"save of step {pending[0].step} not {'durable' if pending[0].durable else 'acknowledged'} "
                        f"within {timeout}s"
                    ) from None
                except PsguardError as e:
                    errors.append((pending[0].step, pending[0].durable, e))
                pending.pop(0)
        finally:
            if pending:  # a timeout: what is still pending stays for the next wait
                with self._lock:
                    self._pending[:0] = pending
                    self._errors[:0] = errors
        return [e for step, durable, e in errors if not self._redone(step, durable, e)]

    def _note_applied(self, handle: _AgentSaveHandle) -> None:
        for durable in {False, handle.durable}:
            self._applied[durable] = max(self._applied[durable], handle.step)

    def _redone(self, step: int, durable: bool, error: BaseException) -> bool:
        """Whether a failed save's state was saved after all: a capture the agent did not apply for want of its
        parent state (a tier or a peer copy that was reset) is redone whole by the next one, so once a later
        save as strong (durable for a durable one) reached its tier, nothing the caller asked for is missing."""
        if isinstance(error, NeedFullCaptureError) and step < self._applied[durable]:
            log.info("the save of step %d was not applied (%s); a later one was", step, error)
            return True
        return False

    def close(self) -> None:
        self.spool.close()


def summary(updates: Mapping[str, TensorUpdate]) -> str:
    """``3 whole, 120 changed rows`` for logs."""
    full = sum(isinstance(u, Full) for u in updates.values())
    rows = sum(len(u.ids) for u in updates.values() if isinstance(u, Rows))
    return f"{full} whole, {rows} changed rows"


# ---------------------------------------------------------------------------------------------- which sink

#: The manager's ``sink=`` (``None``: the agent's when ``$PSGUARD_SPOOL`` names a spool, else the store).
SinkKind = Literal["store", "agent"]


@dataclass(frozen=True)
class SinkChoice:
    """Which sink a manager uses and why, as its ``repr`` shows it (``store(sink='store')``)."""

    kind: SinkKind
    why: str
    spool: str | None = None

    def __str__(self) -> str:
        where = f"spool={self.spool}, " if self.spool is not None else ""
        return f"{self.kind}({where}{self.why})"


def choose_sink(sink: SinkKind | None, spool: str | os.PathLike[str] | None, directory: str) -> SinkChoice:
    """Where a manager writing ``directory`` sends its saves: ``sink`` as asked, an explicit ``spool``, else
    ``$PSGUARD_SPOOL`` checked against its agent's ``$PSGUARD_STORE``. A choice that cannot hold is refused."""
    if sink not in (None, "store", "agent"):
        raise ConfigError(f"sink must be 'store', 'agent' or None ($PSGUARD_SPOOL decides), not {sink!r}")
    if spool is not None:
        if sink == "store":
            raise ConfigError("sink='store' and a spool (options.spool) both given: the spool is the agent's sink")
        return SinkChoice("agent", "from options.spool", os.fspath(spool))
    env_spool = os.environ.get(ENV_SPOOL) or None
    agent_store = os.environ.get(ENV_STORE)
    if sink == "store":
        if env_spool and agent_store and canonical_url(agent_store) == canonical_url(directory):
            raise ConfigError(
                f"sink='store', but this trainer's psguard agent (${ENV_SPOOL}={env_spool}) writes {directory} "
                "too: two writers of one durable log. Fix: leave sink= unset (or sink='agent') to hand saves to "
                "the agent, or point the manager at another URL"
            )
        return SinkChoice("store", "sink='store'")
    if env_spool is None:
        if sink == "agent":
            raise ConfigError(
                f"sink='agent', but ${ENV_SPOOL} is not set: no psguard agent runs this trainer. Fix: run it "
                "under psguard agent / psguard wrap (they set it), or give options=psguard.ManagerOptions(spool=...)"
            )
        return SinkChoice("store", f"${ENV_SPOOL} unset")
    if agent_store == "":  # the agent was started without --store
        if sink == "agent":
            raise ConfigError(
                f"sink='agent', but the psguard agent running this trainer (${ENV_SPOOL}={env_spool}) was started "
                f"without --store and keeps checkpoints in memory only. Fix: start it with --store {directory}"
            )
        what = "the agent running this trainer has no --store, so this manager writes the durable log itself"
        log.warning(
            "event=agent_without_store spool=%s: %s. Fix: start the agent with --store %s", env_spool, what, directory
        )
        return SinkChoice("store", f"the agent of ${ENV_SPOOL} has no --store")
    if agent_store is not None and canonical_url(agent_store) != canonical_url(directory):
        raise ConfigError(
            f"this trainer's psguard agent writes checkpoints to --store {agent_store}, but the manager is pointed "
            f"at {directory}: everything would go to {agent_store} and {directory} would stay empty. Fix: give "
            f"psguard.CheckpointManager the agent's URL ({agent_store}) or start the agent with --store {directory}"
        )
    return SinkChoice("agent", f"from ${ENV_SPOOL}", env_spool)


#: Where a manager's captures go.
Sink = StoreSink | AgentSink
