"""The one durable writer of a job: what every commit to the log follows, whoever makes it.

Two processes write a job's durable log, never at once: the trainer's own writer when no agent runs on its node
(:class:`~psguard.trainer.sinks.StoreSink`) and the chief's agent from its memory tier
(:class:`~psguard.agent.tiers.persister.Persister`). Both hold a :class:`DurableWriter`, which owns:

- **the last commit** (the next delta's parent) and the chain behind it, read back from the log when a writer
  takes over (:meth:`DurableWriter.adopt`);
- **the missing-parent rule**: a delta with no parent, or one the store says is gone (``ParentMissingError``),
  makes the writer forget its last commit and raise; the caller's next save is whole;
- **the new-base rule**: one predicate over :class:`ChainState` (:func:`psguard.policy.engine.base_rule`). The
  agent rewrites the base from memory (asks :meth:`base_due`); the trainer, holding only deltas, compacts the
  chain in storage right after the delta that made it due;
- **retention after each commit**, with the settings the caller gives for that commit.

The store layer knows no policies: the rule and the retention come in as callables.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from psguard.errors import ParentMissingError, PsguardError
from psguard.store.facade import Store
from psguard.store.index import CheckpointInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainState:
    """The chain behind the last commit: what a new-base rule decides on.

    ``delta_bytes`` counts the deltas' logical payload when this writer made them and their stored bytes when
    read back from the log (the rule only compares it with ``base_bytes``, the base's logical size).
    """

    last: CheckpointInfo | None = None
    chain_length: int = 0
    delta_bytes: int = 0
    base_bytes: int = 0
    base_step: int | None = None


#: ``(chain, step about to be saved) -> whether the next save should be a new base``.
BaseRule = Callable[[ChainState, int], bool]
#: ``Store.retain``'s keyword arguments for the commit just made (``None``: no retention asked for).
RetentionSpec = Callable[[CheckpointInfo], Mapping[str, Any] | None]


class DurableWriter:
    """Commits a job's checkpoints to ``store`` by the rules in the module doc. Thread-safe. ``compact``: make new
    bases by compacting the chain in storage; otherwise the caller writes them whole when :meth:`base_due` says so."""

    def __init__(
        self,
        store: Store,
        *,
        base_rule: BaseRule,
        retention: RetentionSpec,
        compact: bool,
        last: CheckpointInfo | None = None,
    ) -> None:
        self.store = store
        self.base_rule = base_rule
        self.retention = retention
        self.compact = compact
        self._lock = threading.Lock()  # the state, never held across storage I/O
        self._saving = threading.Lock()  # one commit at a time
        self._state = ChainState()
        #: Set when the chain could not be read back: the next save must be a base.
        self._force_base = False
        self._pending: str | None = None  # adopted by id, not read yet
        if last is not None:
            self.adopt(last)

    # ------------------------------------------------------------------------------------------- state
    @property
    def last(self) -> CheckpointInfo | None:
        """The last commit (a checkpoint adopted by id and not read yet does not show here)."""
        with self._lock:
            return self._state.last

    @property
    def state(self) -> ChainState:
        with self._lock:
            return self._state

    def _resolve(self) -> None:
        """Read the checkpoint adopted by id, now that it is needed (on the saving thread, without the state lock
        held across the read)."""
        with self._lock:
            checkpoint_id, self._pending = self._pending, None
        if checkpoint_id is None:
            return
        try:
            last = CheckpointInfo.of(self.store.manifest(checkpoint_id))
        except PsguardError as e:
            log.warning("could not read checkpoint %s (%s); the next save is a new base", checkpoint_id, e)
            last = None
        self.adopt(last)

    def adopt(self, last: CheckpointInfo | str | None) -> None:
        """Continue from ``last`` (a restored or resumed checkpoint; ``None``: the next save is whole), reading
        its chain from the log for the new-base rule. Given by id, it is read at the next decision, on the
        writer's thread rather than the caller's (a restore's)."""
        if isinstance(last, str) or last is None:
            with self._lock:
                self._force_base, self._pending = False, last
                if last is None:
                    self._state = ChainState()
            return
        try:
            chain = self.store.chain(last.id)
        except PsguardError as e:
            log.warning("could not read the chain of %s (%s); the next save is a new base", last.id, e)
            state, forced = ChainState(last, last.chain_length), True
        else:
            delta_bytes = sum(sum(r.size for r in m.refs()) for m in chain[1:])
            base_bytes = CheckpointInfo.of(chain[0]).logical_bytes
            state, forced = ChainState(last, last.chain_length, delta_bytes, base_bytes, chain[0].step), False
        with self._lock:
            self._pending, self._force_base, self._state = None, forced, state

    def forget(self) -> None:
        """The last commit can no longer be built on (the caller lost track of it): the next save is whole."""
        self.adopt(None)

    def base_due(self, step: int) -> bool:
        """Whether the next save should be a new base: no parent, an unreadable chain, or the rule."""
        self._resolve()
        with self._lock:
            state, forced = self._state, self._force_base
        return state.last is None or forced or bool(self.base_rule(state, step))

    # ------------------------------------------------------------------------------------------- commits
    def save(
        self,
        step: int,
        updates: Mapping[str, Any],
        *,
        whole: bool,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        payload_bytes: int | None = None,
        parts: Callable[[str | None], Any] | None = None,
    ) -> CheckpointInfo:
        """Commit ``updates`` whole or as a delta over the last commit. The caller acknowledges the commit, then
        calls :meth:`tidy`: the commit's journal entry, compaction and retention (a gc that verifies what it keeps)
        stay off the path a held trainer waits on.

        ``parts``: called inside the open transaction with the checkpoint to dedup against, it returns the PS agents'
        part entries. ``payload_bytes``: the delta's logical bytes, for the rule. ``ParentMissingError`` when a delta
        has no parent: the writer forgets its last commit and the caller's next save must be whole."""
        with self._saving:
            self._resolve()
            last = self.last
            if not whole and last is None:
                raise ParentMissingError(
                    f"step {step}: a delta without a checkpoint to build on (the next save is whole)"
                )
            parent = None if whole else last.id  # type: ignore[union-attr]
            dedup = last.id if last is not None else None
            try:
                if parts is not None:
                    with self.store.begin_save(step, parent=parent, dedup_against=dedup) as tx:
                        info = tx.commit(
                            updates, parts=lambda: parts(dedup), metadata=metadata, metrics=metrics, journal=False
                        )
                else:
                    info = self.store.save(
                        step,
                        updates,
                        parent=parent,
                        metadata=metadata,
                        metrics=metrics,
                        dedup_against=dedup if whole else None,
                        journal=False,
                    )
            except ParentMissingError:
                log.warning(
                    "checkpoint %s is gone from %s; the next save is a new base",
                    last.id if last else None,
                    self.store.url,
                )
                self.forget()
                raise
            self._record(info, payload_bytes)
            return info

    def tidy(self, info: CheckpointInfo, *, new_base: bool = False) -> None:
        """After the commit ``info`` (the last :meth:`save`): its journal entry (best effort, as ever: the manifest
        is the commit); for a compacting writer, a new base in storage when ``new_base`` or the rule asks; then the
        retention. Never raises: the commit is acknowledged already, and what tidying leaves undone the next
        commit's tidy (or a gc) does."""
        with self._saving:
            try:
                self.store.append_journal(info)
                if info.kind == "delta" and self.compact and (new_base or self.base_rule(self.state, info.step)):
                    try:
                        compacted = self.store.compact(info.id)
                    except PsguardError as e:
                        log.warning("compaction after %s failed (the chain grows on): %s", info.id, e)
                    else:
                        if compacted is not None:
                            self._record(compacted, None)
                self._retain(self.last or info)
            except Exception:
                log.exception("compaction or retention after %s failed (the commit stands)", info.id)

    def _record(self, info: CheckpointInfo, payload_bytes: int | None) -> None:
        with self._lock:
            s = self._state
            self._force_base = False
            if info.kind == "full":
                self._state = ChainState(info, 0, 0, info.logical_bytes, info.step)
            else:
                added = payload_bytes if payload_bytes is not None else info.stored_bytes
                self._state = ChainState(info, info.chain_length, s.delta_bytes + added, s.base_bytes, s.base_step)

    def _retain(self, info: CheckpointInfo) -> None:
        try:
            spec = self.retention(info)
        except PsguardError as e:  # a malformed request: this commit stands, its retention is skipped
            log.warning("ignoring the retention asked for with %s: %s", info.id, e)
            return
        if spec is None:
            return
        try:
            self.store.retain(**spec)
        except PsguardError as e:
            log.warning("retention after %s failed (retried after the next commit): %s", info.id, e)
