"""Waiting for a store that does not answer, where nothing can stand in for it.

A process whose only source of state is the store (a chief's agent whose memory tier died with its predecessor,
a trainer with no memory tier) has no better answer than the store's: exiting ends the job, starting from initial
values loses every acknowledged commit. So :class:`StoreWait` tries again until the store answers, with capped
exponential backoff, and says what it waits for, since when and how many tries (``/status``, readiness, a
metric). A ``timeout`` turns the wait back into an error.

Each try first asks a cheap ``probe`` with the backend's retries capped at none, so the status is right from the
first second; the real call then runs with the usual retries. Only unavailability is waited out: any other error
is raised at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from psguard.errors import StorageUnavailableError
from psguard.storage.base import Backend
from psguard.storage.registry import redact
from psguard.storage.retry import RetryingBackend, one_line

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Waiting:
    """A wait in progress: what for, since when (Unix time), how many tries failed, the last error."""

    url: str
    since: float
    attempt: int
    error: str
    retry_in: float

    def describe(self) -> str:
        when = datetime.fromtimestamp(self.since, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"waiting for storage {self.url}: {self.error}, since {when}, attempt {self.attempt}"


class StoreWait:
    """Calls that wait for ``backend``'s store to answer (see the module's text), for at most ``timeout``
    seconds (``None``: as long as it takes) or until ``stop`` is set, backing off from ``initial`` to ``cap``.
    ``clock`` and ``sleep`` are for tests."""

    def __init__(
        self,
        backend: Backend,
        *,
        timeout: float | None = None,
        stop: threading.Event | None = None,
        initial: float = 1.0,
        cap: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], bool] | None = None,
    ) -> None:
        self.backend = backend
        self.url = redact(backend.url)
        self.timeout = timeout
        self.initial = initial
        self.cap = cap
        self._clock = clock
        self._stop = stop or threading.Event()
        self._sleep = sleep or self._stop.wait
        self._lock = threading.Lock()
        self._waiting: Waiting | None = None
        self._began: float | None = None  # clock() at the first failed try of the wait in progress

    @property
    def waiting(self) -> Waiting | None:
        """The wait in progress, or None (not waiting: not started, or the store answered)."""
        with self._lock:
            return self._waiting

    def seconds(self) -> float:
        """Seconds the wait in progress has lasted so far; 0 when not waiting (a gauge's function)."""
        with self._lock:
            return 0.0 if self._began is None else self._clock() - self._began

    def status(self) -> dict[str, Any] | None:
        """The wait in progress for ``/status`` (``reason`` says it in a line), or None."""
        waiting = self.waiting
        if waiting is None:
            return None
        return {"reason": waiting.describe(), **asdict(waiting), "waited_seconds": round(self.seconds(), 3)}

    def call(self, fn: Callable[[], T], *, probe: Callable[[], object] | None = None) -> T:
        """``fn()`` once the store answers ``probe()`` (if given) and ``fn`` did not find it unavailable; until
        then try again with backoff. Raises :class:`StorageUnavailableError` when ``timeout`` is spent or
        ``stop`` is set, and any other error of ``probe`` or ``fn`` at once."""
        attempt = 0
        delay = self.initial
        try:
            while True:
                attempt += 1
                try:
                    if probe is not None:  # failing on the first unavailable answer: the wait's backoff is the only one
                        with self.backend.capped(0.0) if isinstance(self.backend, RetryingBackend) else nullcontext():
                            probe()
                    result = fn()
                except StorageUnavailableError as e:
                    delay = self._failed(attempt, delay, e)
                    continue
                if attempt > 1:
                    log.info(
                        "event=storage_answered url=%s attempts=%d waited=%.1fs", self.url, attempt, self.seconds()
                    )
                return result
        finally:
            with self._lock:
                self._waiting, self._began = None, None

    def _failed(self, attempt: int, delay: float, error: StorageUnavailableError) -> float:
        """Record try ``attempt``'s failure, wait ``delay`` (less if the timeout comes first); the next delay."""
        now = self._clock()
        with self._lock:
            if self._began is None:
                self._began = now
            began = self._began
        waited = now - began
        cause = error.__cause__ or error  # the storage's failure, as the backend explains it (never a credential)
        why = self.backend.explain(cause) or one_line(cause, 200)
        if self.timeout is not None and waited >= self.timeout:
            raise StorageUnavailableError(
                f"storage {self.url} did not answer for {waited:.0f}s ({attempt} tries; the wait's timeout is "
                f"{self.timeout:g}s); last error: {why}. Check that the storage service is up and reachable."
            ) from error
        pause = delay if self.timeout is None else min(delay, self.timeout - waited)
        with self._lock:
            since = self._waiting.since if self._waiting is not None else time.time()
            self._waiting = Waiting(self.url, since, attempt, why, pause)
        log.warning(
            "event=waiting_for_storage url=%s attempt=%d waited=%.0fs retry_in=%.1fs error=%r",
            self.url,
            attempt,
            waited,
            pause,
            why,
        )
        if self._sleep(pause):
            raise StorageUnavailableError(
                f"stopped waiting for storage {self.url} after {waited:.0f}s ({attempt} tries): the process is "
                f"stopping; last error: {why}"
            ) from error
        return min(delay * 2, self.cap)
