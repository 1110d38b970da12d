"""Hang detection for the chief's trainer: a process that is alive but makes no steps.

The trainer's manager writes a heartbeat into the spool (:mod:`psguard.handoff.spool`): its step, pid and the
bound its policy sets (``hang:``). :class:`HangWatch` reads it on the agent's own clock: when the step has not
changed for that bound, it asks the trainer for its Python stacks (``HANG_DUMP_SIGNAL``, into the task log), then
calls ``on_hang``. Only heartbeats written after the current run started count, and a bound of ``null`` (no step
time measured yet) judges nothing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from psguard.agent.process.reaper import descendants
from psguard.errors import PsguardError
from psguard.handoff.contract import HANG_DUMP_SIGNAL
from psguard.local_files import read_regular

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hang:
    """A hung trainer: its last step, how long it has been stuck, the bound, and its pid."""

    step: int
    stuck_seconds: float
    bound: float
    pid: int | None
    stacks_requested: bool


@dataclass(eq=False)
class HangWatch:
    """Watches ``heartbeat`` (a path) for the run of the trainer whose process is ``task_pid()``.

    A run is told apart by its process (``task_pid()``, ``None`` while no trainer runs); ``uptime()`` says how
    long it has run, so heartbeats older than the run are ignored. ``on_hang`` is called once per run that
    hangs, on the watch's thread.
    """

    heartbeat: Path
    _: KW_ONLY
    task_pid: Callable[[], int | None]
    uptime: Callable[[], float | None]
    on_hang: Callable[[Hang], None]
    interval: float = 1.0
    dump_grace: float = 2.0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._run: int | None = None  # the trainer process being judged
        self._run_started = 0.0  # Unix time it started (heartbeats before it are its predecessor's)
        self._step: int | None = None
        self._changed_at = 0.0  # monotonic: when this watch saw the step change last
        self._hung_run: int | None = None
        self.last_step: int | None = None
        self._unreadable = ""  # the last reason the heartbeat could not be read (said once)

    def start(self) -> HangWatch:
        self._thread = threading.Thread(target=self._loop, name="psguard-hang-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def hung(self) -> bool:
        """True from a hang until a new trainer run makes a step."""
        with self._lock:
            return self._hung_run is not None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check(time.monotonic())
            except Exception:  # a watch that dies silently would turn hang detection off for good
                log.exception("event=hang_watch_error heartbeat=%s", self.heartbeat)

    def check(self, now: float) -> Hang | None:
        """One look at the heartbeat; the hang it declared, if any (also passed to ``on_hang``)."""
        run, uptime = self.task_pid(), self.uptime()
        doc = self._read()
        with self._lock:
            if run != self._run:  # a new trainer run: judged afresh
                self._run, self._step, self._changed_at = run, None, now
                self._run_started = time.time() - (uptime or 0.0)
            if run is None or doc is None or float(doc.get("at", 0.0)) < self._run_started:
                return None  # no trainer, or no heartbeat of this run yet
            step = int(doc["step"])
            if step != self._step:
                self._step, self._changed_at = step, now
                self.last_step = step
                if self._hung_run is not None and self._hung_run != run:
                    self._hung_run = None  # a new trainer makes steps: ready again
                return None
            bound = doc.get("hang_after")
            if bound is None or self._hung_run == run:
                return None
            stuck = now - self._changed_at
            if stuck < float(bound):
                return None
            self._hung_run = run
        pid = doc["pid"] if isinstance(doc.get("pid"), int) else None
        asked = self._dump_stacks(pid)
        hang = Hang(step, stuck, float(bound), pid, asked)
        log.error(
            "event=hang step=%d stuck_seconds=%.1f bound=%.1f pid=%s stacks=%s",
            step,
            stuck,
            float(bound),
            pid,
            "in the task log" if asked else "not requested",
        )
        self.on_hang(hang)
        return hang

    def _read(self) -> dict[str, Any] | None:
        try:  # never waits on what is there: a FIFO in its place once kept the watch, and the agent's stop, for good
            doc = json.loads(read_regular(self.heartbeat, "heartbeat", max_bytes=1 << 16, private=True))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, PsguardError) as e:
            if str(e) != self._unreadable:
                self._unreadable = str(e)
                log.warning("event=heartbeat_unreadable heartbeat=%s error=%r", self.heartbeat, str(e))
            return None
        return doc if isinstance(doc, dict) and isinstance(doc.get("step"), int) else None

    def _dump_stacks(self, pid: int | None) -> bool:
        """Ask the trainer for its stacks, only if ``pid`` is really the process this agent supervises."""
        task = self.task_pid()
        if pid is None or task is None or (pid != task and pid not in descendants(task)):
            return False
        try:
            os.kill(pid, HANG_DUMP_SIGNAL)
        except OSError:
            return False
        self._stop.wait(self.dump_grace)  # faulthandler writes at once; give the pipe to the task log a moment
        return True
