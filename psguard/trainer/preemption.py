"""Preemption: SIGTERM becomes "save now" (``SaveContext.preempted_at``), so a preempted trainer leaves a
checkpoint before it goes."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from psguard.errors import PsguardError
from psguard.policy.engine import SaveContext

logger = logging.getLogger(__name__)


class PreemptionHandler:
    """Records when SIGTERM (or other ``signals``) came; the trainer's loop passes it into its decisions
    (:meth:`apply`), saves on the urgent one within :meth:`remaining` and exits with :attr:`exit_code`. The
    handler does no locking or I/O; a second signal gives up and lets the default action kill the process."""

    def __init__(
        self, *, grace: float = 20.0, signals: Sequence[int] = (signal.SIGTERM,), clock: Callable[[], float] = time.time
    ) -> None:
        if grace <= 0:
            raise ValueError(f"grace must be > 0 seconds, got {grace!r}")
        self.grace = grace
        self._signals = tuple(signals)
        self._clock = clock
        self._previous: dict[int, Any] = {}
        #: When the preemption request came, by the handler's clock; ``None`` if none came.
        self.requested_at: float | None = None
        self._signum: int | None = None

    def install(self) -> PreemptionHandler:
        """Install the handler for each signal (main thread only); :meth:`uninstall` puts the old ones back."""
        if threading.current_thread() is not threading.main_thread():
            raise PsguardError("PreemptionHandler.install() must run in the main thread (Python's signal rule)")
        for signum in self._signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.requested_at is not None:  # second signal: stop waiting, let the default action happen
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signum = signum
        self.requested_at = self._clock()

    @property
    def exit_code(self) -> int:
        """128 + the signal number (143 for SIGTERM): supervisors see a termination, not a crash."""
        return 128 + (self._signum if self._signum is not None else signal.SIGTERM)

    def apply(self, context: SaveContext) -> SaveContext:
        """``context`` with ``preempted_at`` set from this handler (unchanged when no request came)."""
        if self.requested_at is None or context.preempted_at == self.requested_at:
            return context
        return dataclasses.replace(context, preempted_at=self.requested_at)

    def remaining(self) -> float:
        """Seconds left of the grace period (the full grace if no request came yet; never negative)."""
        if self.requested_at is None:
            return self.grace
        return max(0.0, self.requested_at + self.grace - self._clock())

    def done(self) -> None:
        """Say the preemption save is restorable (the memory tier has it)."""
        took = self._clock() - self.requested_at if self.requested_at is not None else 0.0
        logger.warning("event=preemption_saved signal=%s seconds=%.3f", self._signum, took)
