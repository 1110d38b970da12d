"""This process's checkpoint managers and the steps they saw: what a recovery needs to know of them.

Recovery happens outside any one manager (the user's ``build`` makes them, the user's ``train`` sees the failure),
so every :class:`~psguard.CheckpointManager` registers here and notes every step it saves; recovery and the exit
hook ask this one object (:data:`process_managers`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Protocol

from psguard.errors import PsguardError

log = logging.getLogger(__name__)


class Manager(Protocol):
    """What the registry does with an open manager: close it."""

    def close(self, timeout: float | None = None) -> None: ...


class Writes(Protocol):
    """A manager's pending saves (its sink): whether it writes any itself, and waiting for them."""

    def in_flight(self) -> bool: ...

    def wait(self, timeout: float | None) -> list[BaseException]: ...


class ManagerRegistry:
    """The open managers of this process (weakly: a manager nobody holds any more is not kept alive) and the
    steps they saw. One per process: :data:`process_managers`."""

    def __init__(self) -> None:
        # The highest step each store directory's managers saw: the steps a restore lost are counted from it.
        self._seen_lock = threading.Lock()
        self._seen_steps: dict[str, int] = {}
        # When a manager last saw a step of the running generation (None: none since it began).
        self._step_seen_at: float | None = None
        # Each open manager's sink, weakly too: a sink may hold its manager, which would then live for ever.
        self._open: weakref.WeakKeyDictionary[Manager, weakref.ref[Writes]] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------------------------ managers' side

    def opened(self, manager: Manager, writes: Writes) -> None:
        """``manager`` is open, its pending saves in ``writes`` (its sink)."""
        self._open[manager] = weakref.ref(writes)

    def closed(self, manager: Manager) -> None:
        """``manager`` is closed (or closing): recovery and the exit no longer wait for it."""
        self._open.pop(manager, None)

    def is_open(self, manager: Manager) -> bool:
        return manager in self._open

    def note_step(self, directory: str, step: int) -> None:
        """A manager of ``directory`` saw ``step`` of the running generation, now."""
        with self._seen_lock:
            self._step_seen_at = time.time()
            if step > self._seen_steps.get(directory, -1):
                self._seen_steps[directory] = step

    # ------------------------------------------------------------------------------------ recovery's side

    def last_seen_step(self, directory: str | None = None) -> int | None:
        """The highest step a manager of this process saw, for ``directory`` or any; ``None`` before any."""
        with self._seen_lock:
            if directory is not None:
                return self._seen_steps.get(directory)
            return max(self._seen_steps.values(), default=None)

    def generation_ran_at(self) -> float | None:
        """When the running generation last made a step a manager saw (``time.time()``; ``None``: none)."""
        with self._seen_lock:
            return self._step_seen_at

    def release_after_failure(self, timeout: float = 30.0) -> None:
        """Close every open manager of a generation a cluster failure ended, logging (not raising) its failures.
        Saves handed to a sidecar are not waited for (the agent finishes them); a manager's own writes are, up
        to ``timeout``."""
        with self._seen_lock:
            self._step_seen_at = None  # the next generation's steps are its own
        for manager, writes in self._open_now():
            own_writes = writes.in_flight()
            try:
                manager.close(timeout=timeout if own_writes else 0.0)
            except TimeoutError:
                if own_writes:
                    log.warning("the failed generation's pending saves did not finish within %.0fs", timeout)
                else:
                    log.info("the failed generation's pending saves are left to the agent, which finishes them")
            except PsguardError as e:
                log.info("the failed generation's saves: %s", e)

    def coordinators(self) -> list[Any]:
        """The ``ClusterCoordinator`` of each open manager that has one (each once)."""
        found = (getattr(manager, "coordinator", None) for manager, _ in self._open_now())
        return list({id(c): c for c in found if c is not None}.values())

    # ------------------------------------------------------------------------------------ the exit's side

    def drain_at_exit(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the pending writes of every manager still open (each in turn); log, never
        raise, what is lost or failed: the interpreter is exiting."""
        for _, writes in self._open_now():
            if not writes.in_flight():
                continue
            log.warning("the process is exiting: waiting up to %.0fs for pending checkpoint writes", timeout)
            try:
                errors = writes.wait(timeout)
            except TimeoutError:
                log.error("pending checkpoint writes did not finish within %.0fs: they are lost", timeout)
                continue
            for e in errors:
                log.error("a checkpoint write failed before exit: %s", e)

    def _open_now(self) -> list[tuple[Manager, Writes]]:
        """The open managers and their sinks at this moment (a copy: closing a manager unregisters it)."""
        return [(manager, writes) for manager, ref in list(self._open.items()) if (writes := ref()) is not None]


#: This process's registry, which every manager and recovery use.
process_managers = ManagerRegistry()
