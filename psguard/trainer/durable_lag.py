"""The trainer's side of the durable lag bound (:mod:`psguard.policy.lag`): measure the lag, hold when it is past.

Only the trainer can hold training and knows which captures were due for the durable tier. A capture counts from
its hand-off until its durable answer is in; after a save and at every ``maybe_save``, while the oldest would be
more than ``max_steps`` behind (or ``max_seconds``), the manager waits on its handle. A failed durable write, or a
store being retried, turns holding off until a durable save succeeds (an outage must not stop training its memory
tier keeps restorable); a wait also ends when no agent holds the spool. Each is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from psguard.policy.lag import LagBound
from psguard.trainer.sinks import SaveHandle

log = logging.getLogger(__name__)

#: Seconds between the progress lines of a long hold (a 1 GB base on object storage takes a minute).
PROGRESS_EVERY = 10.0
#: Seconds a hold waits on its handle before it looks again whether it should stop (a SIGTERM, the agent gone).
WAIT_SLICE = 0.25


@dataclass(frozen=True)
class LagStatus:
    """The durable lag as the trainer sees it. ``steps``/``seconds``: how far training is past the oldest capture
    still waiting for its durable answer (0 when none waits); ``failing``: the last durable answer was a failure
    (holding is off until one succeeds)."""

    steps: int
    seconds: float
    pending: int
    holds: int
    held_seconds: float
    failing: bool
    last_durable_step: int | None


class LagGuard:
    """Counts the captures waiting for their durable answer and holds training past the bound."""

    def __init__(
        self,
        bound: Callable[[], LagBound],
        *,
        agent_alive: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        progress_every: float = PROGRESS_EVERY,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        self._bound = bound
        self._progress_every = progress_every
        self._cancel = cancel
        self._agent_alive = agent_alive
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[tuple[SaveHandle, float]] = []  # (handle, when handed off), oldest first
        self._step: int | None = None
        self._holds = 0
        self._held = 0.0
        self._failing = False
        self._last_durable: int | None = None

    def submitted(self, handle: SaveHandle) -> None:
        """A save was handed off; it counts when it was asked for the durable tier."""
        if handle.durable:
            with self._lock:
                self._pending.append((handle, self._clock()))

    def check(self, step: int) -> float:
        """Training is at ``step`` and about to go on: hold while the bound says so. Returns the seconds held."""
        self._step = step
        bound = self._bound()
        began: float | None = None
        next_line = 0.0
        while True:
            oldest = self._settle()
            if oldest is None or not bound.holds or self._failing:
                break
            handle, since = oldest
            if not bound.exceeded(step + 1 - handle.step, self._clock() - since):
                break
            if began is None:
                began, next_line = self._clock(), self._clock() + self._progress_every
                self._holds += 1
                what = f"training waits for the durable commit of step {handle.step} (durable_lag: {bound.describe()})"
                log.info("event=durable_hold step=%d waiting_for=%d: %s", step, handle.step, what)
            try:
                handle.exception(timeout=WAIT_SLICE)
            except TimeoutError:
                if (retrying := handle.store_retrying()) is not None:
                    # The store is down: no holding until a durable save succeeds (the answers still count).
                    with self._lock:
                        failing, self._failing = self._failing, True
                    if not failing:
                        _say_failing(handle.step, retrying)
                    break
                # The answer cannot come, or must not be waited for any more.
                why = None
                if self._cancel is not None and self._cancel():
                    why = "the job is being preempted: its grace period is for the preemption save"
                elif self._agent_alive is not None and not self._agent_alive():
                    why = "no agent holds the spool any more, so the durable answer cannot come"
                if why is not None:
                    log.warning(
                        "event=durable_hold_ended step=%d waiting_for=%d: %s; training goes on", step, handle.step, why
                    )
                    with self._lock:
                        self._pending.clear()
                    break
                if self._clock() >= next_line:
                    held_s = self._clock() - began
                    log.info(
                        "event=durable_hold step=%d waiting_for=%d held_s=%.1f: still waiting",
                        step,
                        handle.step,
                        held_s,
                    )
                    next_line += self._progress_every
        held = self._clock() - began if began is not None else 0.0
        self._held += held
        return held

    def _settle(self) -> tuple[SaveHandle, float] | None:
        """Drop the captures whose durable answer is in (noting the last success or failure); the oldest left."""
        with self._lock:
            left = []
            for handle, since in self._pending:
                if not handle.done():
                    left.append((handle, since))
                    continue
                error = handle.exception(timeout=0)
                if error is None:
                    self._last_durable = max(self._last_durable or handle.step, handle.step)
                    if self._failing:
                        log.info("event=durable_recovered step=%d: the durable log takes commits again", handle.step)
                    self._failing = False
                elif not self._failing:
                    self._failing = True
                    _say_failing(handle.step, f"a durable save failed: {error}")
            self._pending = left
            return left[0] if left else None

    def status(self) -> LagStatus:
        """The lag now (for the manager's ``status()`` and the demo's summary)."""
        oldest = self._settle()
        steps = seconds = 0.0
        if oldest is not None:
            handle, since = oldest
            steps = max(0, (self._step if self._step is not None else handle.step) - handle.step)
            seconds = max(0.0, self._clock() - since)
        with self._lock:
            return LagStatus(
                steps=int(steps),
                seconds=float(seconds),
                pending=len(self._pending),
                holds=self._holds,
                held_seconds=self._held,
                failing=self._failing,
                last_durable_step=self._last_durable,
            )


def _say_failing(step: int, why: str) -> None:
    """The one line of a durable log that stopped taking commits (a failed save, or the store being retried)."""
    log.warning(
        "event=durable_failing step=%d error=%r: training goes on without waiting for the durable log (the memory "
        "tier keeps saves restorable) until a durable save succeeds",
        step,
        why[:300],
    )
