"""The second half of the double write: a background thread that makes the memory tier durable.

Why a thread that persists *from the memory tier* rather than a queue of captures: captures of a large model
arrive faster than object storage may take them, and queueing them would hold a copy of the model per capture.
Here a request is only a note ("make the current state durable"); when the persister falls behind, every
request that arrives while a save is running joins one pending batch, served by a single save of whatever the
tier holds by then. Memory stays bounded (the tier's marks plus one take in flight, whose whole tensors are
leased, not copied) and the durable log skips intermediate steps instead of lagging further.

Each save writes what :meth:`~psguard.agent.tiers.memory_tier.MemoryTier.take_dirty` says: a full base first, after a
layout change, when asked, or when the new-base policy (a :class:`~psguard.policy.engine.SavePolicy`, by default
:class:`~psguard.policy.engine.ChainLimit` on chain links and delta bytes as a percentage of the base) says the chain
is long enough; otherwise a delta over the last durable checkpoint (changed rows, whole tensors that changed,
``Same`` for the rest). A new base is written from memory with ``dedup_against`` the previous checkpoint, so
unchanged chunks are not uploaded again and nothing is read back from storage (cheaper than
``Store.compact``, which rebuilds the chain from the log). The commits themselves, the missing-parent rule and the
retention are :class:`~psguard.store.durable.DurableWriter`'s, the same as the trainer's own writer; a trainer's
``new_base_after`` travels with its captures (``NEW_BASE_KEY``) and replaces the agent's ``max_chain``.

Failures: a failed save aborts its take (the dirty marks go back to the tier), fails the batch's handles with
the store's error, is reported (status, event callback), and is retried on the next request or, with
``retry_after``, by the thread itself. The thread never dies on an error. A process killed mid-save leaves no
torn checkpoint (the manifest is the commit); :func:`resume` seeds a successor's tier from the log.

Typical use in the agent::

    tier = MemoryTier()
    last = resume(store, tier)                    # None on a fresh job
    with Persister(store, tier, last=last, max_chain=8) as persister:
        ...
        handle = persister.request(step)          # after applying a capture meant for the durable tier
        handle.add_done_callback(lambda h: ...)   # e.g. write the trainer's durable ack
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from psguard.agent.tiers.memory_tier import DirtyTake, MemoryTier
from psguard.agent.tiers.shard_client import ShardClient
from psguard.config import from_data
from psguard.errors import NoCheckpointError, PsguardError, SaveError
from psguard.handoff.contract import NEW_BASE_KEY, RETENTION_KEY, TOKEN_KEY
from psguard.policy.engine import ChainLimit, Retention, SaveContext, SavePolicy, TierState, Verdict, base_rule
from psguard.storage.retry import Retrying, RetryingBackend
from psguard.store import CheckpointInfo, Store
from psguard.store.durable import ChainState, DurableWriter

__all__ = ["PersistEvent", "PersistHandle", "Persister", "PersisterStatus", "resume"]

log = logging.getLogger(__name__)

#: Seconds between WARNING lines of one failure repeating (the rest go to DEBUG, counted).
REPEAT_LOG_SECONDS = 30.0

Phase = Literal["first-base", "base", "delta", "retention"]


@dataclass(frozen=True)
class PersistEvent:
    """One persist attempt, for metrics and logs. ``kind``: committed, failed, or skipped (nothing new)."""

    kind: Literal["committed", "failed", "skipped"]
    step: int | None
    checkpoint: str | None
    encoding: Literal["full", "delta"] | None
    payload_bytes: int
    bytes_written: int
    seconds: float
    lag_steps: int | None
    coalesced: int
    error: str | None = None


@dataclass(frozen=True)
class PersisterStatus:
    running: bool
    last_id: str | None
    last_step: int | None
    memory_step: int | None
    lag_steps: int | None
    pending_requests: int
    in_flight: bool
    chain_length: int
    checkpoints_written: int
    bytes_persisted: int
    failures: int
    consecutive_failures: int
    last_error: str | None
    last_error_at: float | None
    #: The durable lag (:mod:`psguard.policy.lag`): from the newest step asked to be durable and not committed
    #: yet, the steps past the newest commit (0 when nothing waits), and how long the oldest such request waited.
    durable_lag_steps: int = 0
    durable_lag_seconds: float = 0.0
    #: What the write in flight is doing (None: no write, or it is still taking the state): "first-base" (a whole
    #: state with no durable checkpoint to build on: the log's first base, or after its chain was lost), "base" (a
    #: new base over a chain: the agent's compaction, rewritten from memory), "delta", or "retention" (the
    #: retention after a commit, with its gc when a checkpoint is due to go). The chaos harness aims faults by it.
    phase: Phase | None = None


class PersistHandle:
    """A request to make the memory tier durable; resolved by the save that covers it.

    Several requests made while the persister is busy share one handle (they are served by one save).
    ``result`` returns the committed checkpoint (its step is at least the tier's step at request time), or
    None when the tier was empty; it re-raises the save's error.
    """

    def __init__(self, *, new_base: bool = False, internal: bool = False) -> None:
        self._future: Future[CheckpointInfo | None] = Future()
        self.requests = 0
        self.new_base = new_base
        self.internal = internal
        self.first_step: int | None = None
        self.last_step: int | None = None

    def _add(self, step: int | None, new_base: bool) -> None:
        self.requests += 1
        self.new_base = self.new_base or new_base
        if step is not None:
            self.first_step = step if self.first_step is None else min(self.first_step, step)
            self.last_step = step if self.last_step is None else max(self.last_step, step)

    def result(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the save; :class:`TimeoutError` if it takes longer than ``timeout`` seconds."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[PersistHandle], None]) -> None:
        """Call ``fn(handle)`` when done (at once if it already is), from the persister's thread."""
        self._future.add_done_callback(lambda _: fn(self))


class Persister:
    """Writes the memory tier to a :class:`Store` in the background. Start it, request, stop it.

    ``last``: the newest durable checkpoint the tier's state derives from (from :func:`resume`); None means
    the next save is a full base. ``base_policy`` decides when the chain gets a new base (default
    ``ChainLimit(max_chain, max_delta_percent)``). ``retry_after``: seconds after a failure before the thread
    retries by itself (None: only on the next request). ``on_event`` is called after every attempt.
    """

    def __init__(
        self,
        store: Store,
        tier: MemoryTier,
        *,
        last: CheckpointInfo | None = None,
        max_chain: int | None = 16,
        max_delta_percent: float | None = 100.0,
        base_policy: SavePolicy | None = None,
        retry_after: float | None = 5.0,
        on_event: Callable[[PersistEvent], None] | None = None,
        name: str = "psguard-persister",
        shards: ShardClient | None = None,
    ) -> None:
        self.store = store
        self.tier = tier
        #: The PS agents that hold the shards (issue 12): each writes its part, this persister commits once.
        self.shards = shards
        self.base_policy: SavePolicy = base_policy or ChainLimit(
            max_chain=max_chain, max_delta_percent=max_delta_percent
        )
        self._max_delta_percent = max_delta_percent
        #: The trainer's ``new_base_after`` (``NEW_BASE_KEY`` of its last commit), which replaces ``max_chain``.
        self._trainer_rule: SavePolicy | None = None
        # The log's rules (last commit, missing parent, new base, retention): the agent holds the whole state
        # in its tier, so it rewrites bases from memory instead of compacting.
        self.writer = DurableWriter(store, base_rule=self._base_rule, retention=self._retention, compact=False)
        self.retry_after = retry_after
        self.on_event = on_event
        self._cond = threading.Condition()
        self._pending: PersistHandle | None = None
        self._in_flight: PersistHandle | None = None
        self._phase: Phase | None = None  # what the write in flight is doing (PersisterStatus.phase)
        self._stopping = False
        self._drain = True
        self._retry_at: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        self._last_token: str | None = None  # the memory-tier token of the last commit's state
        self._due: list[tuple[int, float]] = []  # (step, when asked) of durable requests no commit covers yet
        # counters
        self._written = 0
        self._bytes = 0
        self._failures = 0
        self._consecutive_failures = 0
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._last_warned = float("-inf")  # when a failure was last logged at WARNING
        self._silenced = 0  # the same failure since then, logged at DEBUG
        self._last_kind = ""
        if last is not None:
            self._adopt(last)

    def _adopt(self, last: CheckpointInfo) -> None:
        """Continue the chain of ``last`` (the checkpoint the tier was seeded from)."""
        self._last_token = last.metadata.get(TOKEN_KEY)
        self._follow_trainer(last)
        self.writer.adopt(last)

    @property
    def _last(self) -> CheckpointInfo | None:
        return self.writer.last

    def store_retrying(self) -> Retrying | None:
        """The store call that is failing and being retried now, if any (the trainer's durable hold ends on it)."""
        backend = self.store.backend
        return backend.retrying() if isinstance(backend, RetryingBackend) else None

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> Persister:
        with self._cond:
            if self._started:
                raise PsguardError("persister already started")
            self._started = True
        self._thread.start()
        return self

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop the thread. ``drain``: finish the pending batch first; otherwise fail it (abandoned).

        A save already running is never interrupted (it commits or fails whole). Returns False when the
        thread was still busy after ``timeout`` seconds (it stops once that save ends).
        """
        with self._cond:
            self._stopping = True
            self._drain = drain
            if not self._started and self._pending is not None:
                pending, self._pending = self._pending, None
                pending._future.set_exception(SaveError("persister stopped before it started; request abandoned"))
            self._cond.notify_all()
        if self._started:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def __enter__(self) -> Persister:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------- requests
    def request(self, step: int | None = None, *, new_base: bool = False) -> PersistHandle:
        """Ask for the tier's state (at least ``step``) to be made durable. Never blocks, never copies.

        ``new_base``: write a full base (e.g. the checkpoint policy's ``BASE`` tier fired).
        """
        with self._cond:
            if self._stopping:
                raise PsguardError("persister is stopped; it takes no more requests")
            if self._pending is None:
                self._pending = PersistHandle()
            self._pending._add(step, new_base)
            if step is not None:
                self._due.append((step, time.time()))
            self._cond.notify_all()
            return self._pending

    def start_first_base(self) -> bool:
        """Write the tier's state as the log's first base now, when the log has none and nothing is on its way.

        A job's first durable save is its whole state (1 GB takes a minute to object storage here). Started at the
        first capture instead of the first durable one, it is written while training runs, so the first durable
        save only waits for what is left (a delta) and a node lost early has a base to restore from. Returns
        whether a write was started."""
        with self._cond:
            if self._stopping or self._last is not None or self._pending is not None or self._in_flight is not None:
                return False
            self._pending = PersistHandle(internal=True)
            self._pending._add(None, False)
            self._cond.notify_all()
            return True

    def status(self) -> PersisterStatus:
        with self._cond:
            mem = self.tier.step
            last_step = self._last.step if self._last else None
            lag_steps, lag_seconds = self._durable_lag(last_step)
            return PersisterStatus(
                running=self._started and self._thread.is_alive() and not self._stopping,
                last_id=self._last.id if self._last else None,
                last_step=last_step,
                memory_step=mem,
                lag_steps=None if mem is None else mem - (last_step if last_step is not None else 0),
                pending_requests=self._pending.requests if self._pending else 0,
                in_flight=self._in_flight is not None,
                chain_length=self.writer.state.chain_length,
                checkpoints_written=self._written,
                bytes_persisted=self._bytes,
                failures=self._failures,
                consecutive_failures=self._consecutive_failures,
                last_error=self._last_error,
                last_error_at=self._last_error_at,
                durable_lag_steps=lag_steps,
                durable_lag_seconds=lag_seconds,
                phase=self._phase,
            )

    def _durable_lag(self, last_step: int | None) -> tuple[int, float]:
        """(steps, seconds) of the durable lag; call under the lock."""
        if not self._due:
            return 0, 0.0
        newest = max(step for step, _ in self._due)
        return max(0, newest - (last_step or 0)), max(0.0, time.time() - self._due[0][1])

    # ------------------------------------------------------------------------------------------- the thread
    def _next_batch(self) -> PersistHandle | None:
        with self._cond:
            while True:
                if self._stopping and (not self._drain or self._pending is None):
                    if self._pending is not None:
                        self._pending._future.set_exception(
                            SaveError(
                                "persister stopped without draining; this request was abandoned (the memory tier "
                                "still holds the state)"
                            )
                        )
                        self._pending = None
                    return None
                if self._pending is None and self._retry_at is not None and time.monotonic() >= self._retry_at:
                    self._pending = PersistHandle(internal=True)
                    self._pending._add(None, False)
                if self._pending is not None:
                    batch, self._pending = self._pending, None
                    self._in_flight = batch
                    self._retry_at = None
                    return batch
                wait = None if self._retry_at is None else max(0.0, self._retry_at - time.monotonic())
                self._cond.wait(wait)

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._serve(batch)
            except BaseException as e:  # never die with a handle unresolved
                log.exception("persister: unexpected error")
                if not batch.done():
                    batch._future.set_exception(e)
            finally:
                with self._cond:
                    self._in_flight = None
                    self._phase = None

    def _serve(self, batch: PersistHandle) -> None:
        t0 = time.perf_counter()
        take: DirtyTake | None = None
        parts: tuple[tuple[str, ...], str] | None = None
        try:
            take, parts = self._take(base=batch.new_base or self._base_due())
            if take is not None:
                with self._cond:
                    self._phase = "first-base" if self._last is None else "base" if take.base else "delta"
            info, fresh = self._write(take, parts) if take is not None else (None, False)
        except Exception as e:
            if take is not None and take._state == "open":
                take.abort()
            if parts is not None and self.shards is not None:
                self.shards.finish(parts[0], parts[1], committed=False)
            self._failed(batch, e, take, time.perf_counter() - t0)
            return
        seconds = time.perf_counter() - t0
        lag = self._lag()
        if fresh and info is not None and take is not None:
            log.info(
                "persisted step %d as %s %s (%d of %d bytes written, %.3fs, %d request(s), lag %s steps)",
                info.step,
                info.kind,
                info.id,
                info.stored_bytes,
                take.payload_bytes,
                seconds,
                batch.requests,
                lag,
            )
        self._emit(
            PersistEvent(
                kind="committed" if fresh else "skipped",
                step=info.step if info else None,
                checkpoint=info.id if info else None,
                encoding=("full" if info.kind == "full" else "delta") if info and fresh else None,
                payload_bytes=take.payload_bytes if take is not None and fresh else 0,
                bytes_written=info.stored_bytes if info and fresh else 0,
                seconds=seconds,
                lag_steps=lag,
                coalesced=batch.requests,
            )
        )
        batch._future.set_result(info)

    def _take(self, *, base: bool) -> tuple[DirtyTake | None, tuple[tuple[str, ...], str] | None]:
        """What the log lacks, from this tier and (with shards) from every PS agent's, at one capture's state."""
        if self.shards is None:
            return self.tier.take_dirty(base=base), None
        with self.shards.order:  # no capture is applied anywhere between the takes
            take = self.tier.take_dirty(base=base)
            tasks = self.shards.active
            if take is None or not tasks or take.token is None:
                return take, None
            take_id = secrets.token_hex(8)
            try:
                self.shards.take(tasks, take_id, take.token, take.base or self._last is None)
            except BaseException:
                take.abort()
                raise
            return take, (tasks, take_id)

    def _write(
        self, take: DirtyTake, parts: tuple[tuple[str, ...], str] | None = None
    ) -> tuple[CheckpointInfo | None, bool]:
        """Save the take, or skip it when the log already holds this state; the take is closed either way.

        ``parts``: the PS tasks that took their shards' share for this save, and the take's id. Each writes its
        chunks, and the manifest that names them all is the one commit.

        Returns the checkpoint that now covers the tier's state and whether it was written by this call.
        """
        last = self._last
        if not take.changed and last is not None and take.step == last.step and take.token == self._last_token:
            take.commit()
            if parts is not None and self.shards is not None:
                self.shards.finish(parts[0], parts[1], committed=True)
            return last, False
        metadata = dict(take.metadata)
        if take.token is not None:
            metadata[TOKEN_KEY] = take.token
        write_parts = None
        if parts is not None and self.shards is not None:
            shards, (tasks, take_id) = self.shards, parts

            def write_parts(dedup: str | None) -> Any:
                return shards.write(tasks, take_id, dedup)

        try:
            info = self.writer.save(
                take.step,
                take.updates,
                whole=take.base or last is None,
                metadata=metadata,
                metrics=take.metrics,
                payload_bytes=take.payload_bytes,
                parts=write_parts,
            )
        except BaseException:
            take.abort()
            with self._cond:
                if self.writer.last is None:  # its parent was gone: the writer forgot it
                    self._last_token = None
            raise
        if parts is not None and self.shards is not None:
            self.shards.finish(parts[0], parts[1], committed=True)
        take.commit()
        self._follow_trainer(info)
        with self._cond:
            self._last_token = take.token
            self._due = [(step, at) for step, at in self._due if step > info.step]
            self._written += 1
            self._bytes += info.stored_bytes
            self._consecutive_failures = 0
        return info, True

    def _retention(self, info: CheckpointInfo) -> dict[str, Any] | None:
        """The retention to apply after committing ``info`` (:func:`_retention_asked`); its phase begins."""
        spec = _retention_asked(info)
        if spec is not None:
            with self._cond:
                self._phase = "retention"
        return spec

    def _base_due(self) -> bool:
        return self.writer.base_due(self.tier.step or 0)

    def _base_rule(self, chain: ChainState, step: int) -> bool:
        return base_rule(self._trainer_rule or self.base_policy)(chain, step)

    def _follow_trainer(self, info: CheckpointInfo) -> None:
        """Take the trainer's ``new_base_after`` from its commit (``NEW_BASE_KEY``): with the agent's
        ``max_delta_percent``, it replaces the agent's rule, so the setting means the same under an agent."""
        spec = info.metadata.get(NEW_BASE_KEY)
        if not isinstance(spec, dict):
            return
        limit = spec.get("max_chain")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            log.warning("ignoring a malformed new-base request in %s: %r", info.id, spec)
            return
        chain = limit if limit > 0 else None
        if chain is None and self._max_delta_percent is None:
            self._trainer_rule = _NEVER
            return
        self._trainer_rule = ChainLimit(max_chain=chain, max_delta_percent=self._max_delta_percent)

    def _failed(self, batch: PersistHandle, error: Exception, take: DirtyTake | None, seconds: float) -> None:
        with self._cond:
            self._failures += 1
            self._consecutive_failures += 1
            error_text = f"{type(error).__name__}: {error}"
            # The same failure again (every capture retries while a lost PS node's tier is rebuilt) is said at
            # WARNING once per REPEAT_LOG_SECONDS with how often it happened meanwhile, not once per attempt.
            now = time.monotonic()
            kind = _shape(error_text)  # the same failure at another step, token or checkpoint id is the same
            repeat = kind == self._last_kind and now - self._last_warned < REPEAT_LOG_SECONDS
            self._last_kind = kind
            if repeat:
                self._silenced += 1
                silenced = 0
            else:
                silenced, self._silenced = self._silenced, 0
                self._last_warned = now
            self._last_error = error_text
            self._last_error_at = time.time()
            if self.retry_after is not None and not self._stopping:
                self._retry_at = time.monotonic() + self.retry_after
        log.log(
            logging.DEBUG if repeat else logging.WARNING,
            "event=persist_failed step=%s error=%r: persist of step %s failed; the memory tier keeps the changes, "
            "retrying on the next request%s%s",
            take.step if take else self.tier.step,
            self._last_error,
            take.step if take else self.tier.step,
            f" or in {self.retry_after:g}s" if self.retry_after is not None else "",
            f" (persists failed {silenced} more time(s) since the last such line)" if silenced else "",
        )
        self._emit(
            PersistEvent(
                kind="failed",
                step=take.step if take else self.tier.step,
                checkpoint=None,
                encoding=("full" if take.base else "delta") if take else None,
                payload_bytes=take.payload_bytes if take else 0,
                bytes_written=0,
                seconds=seconds,
                lag_steps=self._lag(),
                coalesced=batch.requests,
                error=self._last_error,
            )
        )
        batch._future.set_exception(error)

    def _lag(self) -> int | None:
        mem = self.tier.step
        if mem is None:
            return None
        return mem - (self._last.step if self._last else 0)

    def _emit(self, event: PersistEvent) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(event)
        except Exception:
            log.exception("persister event callback failed (ignored)")


class _Never:
    """The new-base rule of a trainer that asked for none (``new_base_after=0``) when the agent has no size limit."""

    def describe(self) -> str:
        return "never"

    def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict:
        return Verdict(False, "the trainer asked for no new bases (new_base_after=0)")


_NEVER = _Never()


def _shape(error: str) -> str:
    """An error's text with its numbers and ids blanked: what stays the same when one failure repeats."""
    return re.sub(r"[0-9a-f]{8,}|\d+", "#", error)


def _retention_asked(info: CheckpointInfo) -> dict[str, Any] | None:
    """The retention the trainer asked for with this checkpoint (``RETENTION_KEY``), if any."""
    spec = info.metadata.get(RETENTION_KEY)
    if not isinstance(spec, dict):
        return None
    return from_data(Retention, spec, source=f"{info.id}: {RETENTION_KEY}").as_kwargs()  # ConfigError: skipped


def resume(store: Store, tier: MemoryTier, *, skip_sharded: bool = False) -> CheckpointInfo | None:
    """Seed ``tier`` from the newest usable durable checkpoint; return it (for ``Persister(last=...)``).

    An agent that restarts (or succeeds a killed one) calls this so its tier is at least as fresh as the
    durable log and accepts deltas relative to that checkpoint's token. None when the log is empty.
    ``skip_sharded``: the chief's agent of PS agents that keep the shards loads only the tensors stored whole
    (its memory stays independent of the model's size); the shards are loaded by the PS agents themselves
    when a trainer restores (format 2, row-range reads).
    """
    names = None
    if skip_sharded:
        latest = store.latest()
        if latest is None:
            return None
        names = [n for n, e in store.manifest(latest.id).tensors.items() if e.encoding != "sharded"]
    try:
        loaded = store.load_latest(names)
    except NoCheckpointError:
        return None
    metadata = dict(loaded.info.metadata)
    token = metadata.pop(TOKEN_KEY, None)
    tier.seed(
        loaded.info.step, loaded.tensors, metadata=metadata, metrics=loaded.info.metrics, token=token, durable=True
    )
    return loaded.info
