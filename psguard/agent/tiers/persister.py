"""The second half of the double write: a background thread that makes the memory tier durable.

It persists *from the memory tier*, not from a queue of captures: a request is a note ("make the current state
durable"), and the requests made while a save runs join one batch, served by one save of what the tier holds then:
memory stays bounded and the log skips steps rather than lag further.

Each save writes what :meth:`~psguard.agent.tiers.memory_tier.MemoryTier.take_dirty` says: a full base (first,
after a layout change, when asked, or when the new-base policy says so), else a delta over the last durable
checkpoint; commits, the missing-parent rule and retention are :class:`~psguard.store.durable.DurableWriter`'s.
A failed save aborts its take (the marks go back to the tier), fails the batch's handle and is retried on the next
request or after ``retry_after``; the thread never dies on an error.
"""

from __future__ import annotations

import functools
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
from psguard.policy.engine import ChainLimit, Retention, SavePolicy, base_rule
from psguard.storage.retry import Retrying, RetryingBackend
from psguard.store import CheckpointInfo, Store
from psguard.store.durable import DurableWriter

log = logging.getLogger(__name__)

#: Seconds between WARNING lines of one failure repeating (the rest go to DEBUG, counted).
REPEAT_LOG_SECONDS = 30.0

Phase = Literal["first-base", "base", "delta", "retention"]


@dataclass(frozen=True)
class PersistEvent:
    """One persist attempt, for metrics. ``kind``: committed, failed, or skipped (nothing new)."""

    kind: Literal["committed", "failed", "skipped"]
    step: int | None
    coalesced: int
    encoding: Literal["full", "delta"] | None = None
    payload_bytes: int = 0
    checkpoint: str | None = None
    bytes_written: int = 0


@dataclass(frozen=True)
class PersisterStatus:
    running: bool
    last_id: str | None
    last_step: int | None
    lag_steps: int | None
    pending_requests: int
    in_flight: bool
    checkpoints_written: int
    bytes_persisted: int
    failures: int
    consecutive_failures: int
    last_error: str | None
    #: The durable lag (:mod:`psguard.policy.lag`): steps from the newest commit to the newest step asked to be
    #: durable (0 when nothing waits), and how long the oldest such request waited.
    durable_lag_steps: int = 0
    durable_lag_seconds: float = 0.0
    #: What the write in flight does (the chaos harness aims faults by it): "first-base" (no durable checkpoint to
    #: build on), "base" (a new base over a chain), "delta", "retention" (with its gc); None: no write.
    phase: Phase | None = None


class PersistHandle(Future[CheckpointInfo | None]):
    """A request to make the memory tier durable, shared by every request one save serves. Its result is the
    committed checkpoint (at least the tier's step at request time), or None when the tier was empty."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0
        self.new_base = False


class Persister:
    """Writes the memory tier to a :class:`Store` in the background. Start it, request, stop it.

    ``last``: the durable checkpoint the tier was seeded from (:func:`resume`; None: the next save is a full base).
    ``retry_after``: seconds after a failure before the thread retries by itself (None: only on a request).
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
        shards: ShardClient | None = None,
    ) -> None:
        self.store = store
        self.tier = tier
        #: The PS agents that hold the shards (issue 12): each writes its part, this persister commits once.
        self.shards = shards
        self._max_delta_percent = max_delta_percent
        #: The new-base rule: the agent's, until a trainer's ``new_base_after`` (``NEW_BASE_KEY``) replaces it.
        self._rule = base_rule(base_policy or ChainLimit(max_chain=max_chain, max_delta_percent=max_delta_percent))
        # The agent holds the whole state in its tier, so it rewrites bases from memory instead of compacting.
        self.writer = DurableWriter(
            store, base_rule=lambda chain, step: self._rule(chain, step), retention=self._retention, compact=False
        )
        self.retry_after = retry_after
        self.on_event = on_event
        self._cond = threading.Condition()
        self._pending: PersistHandle | None = None
        self._in_flight: PersistHandle | None = None
        self._phase: Phase | None = None  # what the write in flight is doing (PersisterStatus.phase)
        self._stopping = False
        self._drain = True
        self._retry_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="psguard-persister", daemon=True)
        self._started = False
        self._last_token: str | None = None  # the memory-tier token of the last commit's state
        self._due: list[tuple[int, float]] = []  # (step, when asked) of durable requests no commit covers yet
        self._written = 0
        self._bytes = 0
        self._failures = 0
        self._consecutive_failures = 0
        self._last_error: str | None = None
        self._last_warned = float("-inf")  # when a failure was last logged at WARNING
        self._silenced = 0  # the same failure since then, logged at DEBUG
        self._last_kind = ""
        if last is not None:  # continue the chain of the checkpoint the tier was seeded from
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
        """Stop the thread. ``drain``: finish the pending batch first; otherwise fail it. A running save is never
        interrupted: False when the thread was still busy after ``timeout`` seconds."""
        with self._cond:
            self._stopping = True
            self._drain = drain
            if not self._started and self._pending is not None:
                pending, self._pending = self._pending, None
                pending.set_exception(SaveError("persister stopped before it started; request abandoned"))
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
        """Ask for the tier's state (at least ``step``) to be made durable, as a full base when ``new_base``.
        Never blocks, never copies."""
        with self._cond:
            if self._stopping:
                raise PsguardError("persister is stopped; it takes no more requests")
            if step is not None:
                self._due.append((step, time.time()))
            return self._join(new_base)

    def _join(self, new_base: bool = False) -> PersistHandle:
        """The pending batch, with one more request in it (under ``_cond``)."""
        if self._pending is None:
            self._pending = PersistHandle()
        self._pending.requests += 1
        self._pending.new_base |= new_base
        self._cond.notify_all()
        return self._pending

    def start_first_base(self) -> bool:
        """Write the tier's state as the log's first base now, when the log has none and nothing is on its way:
        written while training runs, the first durable save then waits only for a delta. Whether one started."""
        with self._cond:
            if self._stopping or self._last is not None or self._pending is not None or self._in_flight is not None:
                return False
            self._join()
            return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is asked or in flight, the retention after the last commit included (a commit is
        acknowledged before it): False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight is None and self._pending is None, timeout)

    def status(self) -> PersisterStatus:
        with self._cond:
            last_step = self._last.step if self._last else None
            newest = max((step for step, _ in self._due), default=None)
            return PersisterStatus(
                running=self._started and self._thread.is_alive() and not self._stopping,
                last_id=self._last.id if self._last else None,
                last_step=last_step,
                lag_steps=self._lag(),
                pending_requests=self._pending.requests if self._pending else 0,
                in_flight=self._in_flight is not None,
                checkpoints_written=self._written,
                bytes_persisted=self._bytes,
                failures=self._failures,
                consecutive_failures=self._consecutive_failures,
                last_error=self._last_error,
                durable_lag_steps=0 if newest is None else max(0, newest - (last_step or 0)),
                durable_lag_seconds=max(0.0, time.time() - self._due[0][1]) if self._due else 0.0,
                phase=self._phase,
            )

    # ------------------------------------------------------------------------------------------- the thread
    def _next_batch(self) -> PersistHandle | None:
        with self._cond:
            while True:
                if self._stopping and (not self._drain or self._pending is None):
                    if self._pending is not None:
                        self._pending.set_exception(
                            SaveError("persister stopped without draining; this request was abandoned (the memory "
                                      "tier still holds the state)")
                        )  # fmt: skip
                        self._pending = None
                    return None
                if self._pending is None and self._retry_at is not None and time.monotonic() >= self._retry_at:
                    self._join()
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
                    batch.set_exception(e)
            finally:
                with self._cond:
                    self._in_flight = None
                    self._phase = None
                    self._cond.notify_all()

    def _serve(self, batch: PersistHandle) -> None:
        t0 = time.perf_counter()
        take: DirtyTake | None = None
        parts: tuple[tuple[str, ...], str] | None = None
        try:
            take, parts = self._take(base=batch.new_base or self.writer.base_due(self.tier.step or 0))
            if take is not None:
                with self._cond:
                    self._phase = "first-base" if self._last is None else "base" if take.base else "delta"
            info, fresh = self._write(take, parts) if take is not None else (None, False)
        except Exception as e:
            if take is not None and take._state == "open":
                take.abort()
            self._close_parts(parts, committed=False)
            self._failed(batch, e, take)
            return
        if fresh and info is not None and take is not None:
            log.info(
                "persisted step %d as %s %s (%d of %d bytes written, %.3fs, %d request(s), lag %s steps)",
                info.step,
                info.kind,
                info.id,
                info.stored_bytes,
                take.payload_bytes,
                time.perf_counter() - t0,
                batch.requests,
                self._lag(),
            )
        self._emit(
            PersistEvent(
                kind="committed" if fresh else "skipped",
                step=info.step if info else None,
                checkpoint=info.id if info else None,
                encoding=("full" if info.kind == "full" else "delta") if info and fresh else None,
                payload_bytes=take.payload_bytes if take is not None and fresh else 0,
                bytes_written=info.stored_bytes if info and fresh else 0,
                coalesced=batch.requests,
            )
        )
        batch.set_result(info)
        if fresh and info is not None:  # acknowledged: retention (a verifying gc) runs after, off the held path
            self.writer.tidy(info)

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
        """Save the take (``parts``: the PS tasks that took their share, and its id), or skip it when the log holds
        this state already: the checkpoint that covers the tier's state now, and whether this call wrote it."""
        last = self._last
        if not take.changed and last is not None and take.step == last.step and take.token == self._last_token:
            take.commit()
            self._close_parts(parts, committed=True)
            return last, False
        metadata = take.metadata | ({TOKEN_KEY: take.token} if take.token is not None else {})
        shards = self.shards
        try:
            info = self.writer.save(
                take.step,
                take.updates,
                whole=take.base or last is None,
                metadata=metadata,
                metrics=take.metrics,
                payload_bytes=take.payload_bytes,
                parts=functools.partial(shards.write, *parts) if parts is not None and shards is not None else None,
            )
        except BaseException:
            take.abort()
            with self._cond:
                if self.writer.last is None:  # its parent was gone: the writer forgot it
                    self._last_token = None
            raise
        self._close_parts(parts, committed=True)
        take.commit()
        self._follow_trainer(info)
        with self._cond:
            self._last_token = take.token
            self._due = [(step, at) for step, at in self._due if step > info.step]
            self._written += 1
            self._bytes += info.stored_bytes
            self._consecutive_failures = 0
        return info, True

    def _close_parts(self, parts: tuple[tuple[str, ...], str] | None, *, committed: bool) -> None:
        """End the PS agents' share of a save (``parts``: their tasks and the take's id), if it had one."""
        if parts is not None and self.shards is not None:
            self.shards.finish(*parts, committed=committed)

    def _retention(self, info: CheckpointInfo) -> dict[str, Any] | None:
        """The retention the trainer asked for with ``info`` (``RETENTION_KEY``), if any; its phase begins."""
        spec = info.metadata.get(RETENTION_KEY)
        if not isinstance(spec, dict):
            return None
        kwargs = from_data(Retention, spec, source=f"{info.id}: {RETENTION_KEY}").as_kwargs()  # ConfigError: skipped
        with self._cond:
            self._phase = "retention"
        return kwargs

    def _follow_trainer(self, info: CheckpointInfo) -> None:
        """Take the trainer's ``new_base_after`` from its commit (``NEW_BASE_KEY``): with the agent's
        ``max_delta_percent``, it replaces the agent's rule, so the setting means the same under an agent."""
        spec = info.metadata.get(NEW_BASE_KEY)
        if not isinstance(spec, dict):
            return
        limit = spec.get("max_chain")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            log.warning("ignoring a malformed new-base request in %s: %r", info.id, spec)
        elif limit == 0 and self._max_delta_percent is None:
            self._rule = lambda chain, step: False  # new_base_after=0 and no size limit
        else:
            self._rule = base_rule(ChainLimit(max_chain=limit or None, max_delta_percent=self._max_delta_percent))

    def _failed(self, batch: PersistHandle, error: Exception, take: DirtyTake | None) -> None:
        with self._cond:
            self._failures += 1
            self._consecutive_failures += 1
            self._last_error = f"{type(error).__name__}: {error}"
            # The same failure again (every capture retries while a lost PS node's tier is rebuilt) is said at
            # WARNING once per REPEAT_LOG_SECONDS with how often it happened meanwhile, not once per attempt.
            now = time.monotonic()
            # Numbers and ids blanked: the same failure at another step, token or checkpoint id is the same.
            kind = re.sub(r"[0-9a-f]{8,}|\d+", "#", self._last_error)
            repeat = kind == self._last_kind and now - self._last_warned < REPEAT_LOG_SECONDS
            self._last_kind = kind
            if repeat:
                self._silenced += 1
                silenced = 0
            else:
                silenced, self._silenced = self._silenced, 0
                self._last_warned = now
            if self.retry_after is not None and not self._stopping:
                self._retry_at = now + self.retry_after
        log.log(
            logging.DEBUG if repeat else logging.WARNING,
            "event=persist_failed step=%s error=%r: the persist failed; the memory tier keeps the changes, retrying on "
            "the next request%s%s",
            take.step if take else self.tier.step,
            self._last_error,
            f" or in {self.retry_after:g}s" if self.retry_after is not None else "",
            f" (persists failed {silenced} more time(s) since the last such line)" if silenced else "",
        )
        self._emit(
            PersistEvent(
                kind="failed",
                step=take.step if take else self.tier.step,
                coalesced=batch.requests,
                encoding=("full" if take.base else "delta") if take else None,
                payload_bytes=take.payload_bytes if take else 0,
            )
        )
        batch.set_exception(error)

    def _lag(self) -> int | None:
        mem = self.tier.step
        return None if mem is None else mem - (self._last.step if self._last else 0)

    def _emit(self, event: PersistEvent) -> None:
        try:
            if self.on_event is not None:
                self.on_event(event)
        except Exception:
            log.exception("persister event callback failed (ignored)")


def resume(store: Store, tier: MemoryTier, *, skip_sharded: bool = False) -> CheckpointInfo | None:
    """Seed ``tier`` from the newest durable checkpoint, so that it takes deltas over its token; return it (for
    ``Persister(last=...)``), None when the log is empty. ``skip_sharded``: only the tensors stored whole (the PS
    agents load the shards themselves)."""
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
