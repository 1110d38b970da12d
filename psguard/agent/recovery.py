"""What an agent does when its task fails, hangs or comes back: the recovery rules, and the state they keep.

:class:`Recovery` is the one place that connects the parts that notice (the supervisor's events, the monitor's
verdicts, the hang watch, the trainer's ``POST /failure`` and ``POST /recovery``, its first capture) to the parts
that act (the supervisor's restart, the peers' new generation, the tiers' export ahead). The rules:

- **An outage** begins when a run ends with a restart to follow, or the monitor finds the task unhealthy; it
  ends at the first sign the new run serves (a PS or worker answering its probes, the trainer's capture). Its
  length is ``psguard_recovery_seconds``.
- **The monitor** is reset whenever the task's process changes: the gap before the next start is no hang, and a
  verdict about an earlier run restarts nothing.
- **A new trainer generation** (the chief's agent, ``peers.restart_ps``): when the trainer's run ends with a
  restart to follow, every PS peer is restarted before the next trainer starts (on the supervisor's thread), then
  the PS agents export the memory tier ahead of the restore; ``POST /new-generation`` does the same for an
  in-process rejoin, and so does an agent resuming a job. docs/design.md has the protocol.
- **A hang** is counted and the trainer restarted (a crash); the new trainer restores from the memory tier.
- **Lost steps**: the step a failed trainer reported (``POST /failure``) against the step the restored one
  restored (``POST /recovery``), unless the trainer counted them itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from psguard.agent.control.metrics import AgentMetrics
from psguard.agent.control.peers import PeerSync
from psguard.agent.process.hang import Hang
from psguard.agent.process.lifecycle import EventKind, SupervisorEvent
from psguard.agent.process.prober import Health, HealthMonitor, HealthReport
from psguard.agent.process.supervisor import Supervisor
from psguard.handoff.plan import Facts, Failure, Process, TaskReport, plan, reported_moment

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Recovery:
    """The recovery rules of one agent (``task``, in ``role``) and the state of the outage under way.

    ``supervisor`` and ``monitor`` return the agent's current ones (``None`` before start and after stop);
    ``export_ahead`` asks the PS agents to export the memory tier ahead of a restore; ``on_done`` is called
    when supervision is over (completed, gave up, stopped). The ``on_*`` methods are the callbacks of the
    supervisor, the health monitor and the hang watch; the others serve the trainer's requests.
    """

    task: str
    role: str
    _: KW_ONLY
    restart_ps: bool
    metrics: AgentMetrics
    peer_sync: PeerSync
    supervisor: Callable[[], Supervisor | None]
    monitor: Callable[[], HealthMonitor | None]
    export_ahead: Callable[[], None]
    on_done: Callable[[], None]

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._failure_at: float | None = None  # monotonic: when the current outage began
        self._reported_failure: float | None = None  # POST /failure: when the trainer saw it (Unix time)
        self._reported_step: int | None = None  # ... and the last step it trained
        self._last_lost_steps: int | None = None
        self._hangs = 0
        self._last_hang: dict[str, Any] | None = None
        self._last_restore: dict[str, Any] | None = None  # POST /recovery: the step and tier the trainer restored

    # ------------------------------------------------------------------------------------------ callbacks
    def on_supervisor_event(self, event: SupervisorEvent) -> None:
        self.metrics.on_supervisor_event(event)
        monitor = self.monitor()
        if event.kind in (EventKind.STARTED, EventKind.RESTARTED, EventKind.EXITED) and monitor is not None:
            # After an exit no process runs until the next start: STARTING ignores failures until it answers.
            monitor.reset()
        if event.kind is EventKind.EXITED and event.backoff_seconds is not None:  # a restart follows
            self._outage_began()
            if self.role == "chief" and self.restart_ps:
                # Runs on the supervisor's thread: the trainer is not started again until this returns.
                with self._lock:
                    reported, self._reported_failure = self._reported_failure, None
                run_start = event.time - (event.run_seconds or 0.0)
                failed_at = reported_moment(reported, run_started_at=run_start, exit_code=event.exit_code)
                self.peer_sync.new_generation(f"the trainer {event.reason}", failed_at)
                self.export_ahead()  # after the restarts, as for an in-process rejoin (new_generation says why)
        elif event.kind in (EventKind.COMPLETED, EventKind.GAVE_UP, EventKind.STOPPED):
            self.on_done()

    def _outage_began(self) -> None:
        with self._lock:
            if self._failure_at is None:
                self._failure_at = time.monotonic()

    def on_hang(self, hang: Hang) -> None:
        """The trainer is alive and makes no steps (:mod:`psguard.agent.process.hang`): count it and restart it;
        the new trainer restores from the memory tier (a new generation: the PS servers are restarted first)."""
        self.metrics.hangs.inc()
        with self._lock:
            self._hangs += 1
            self._last_hang = {"step": hang.step, "stuck_seconds": round(hang.stuck_seconds, 1), "at": time.time()}
        sup = self.supervisor()
        if sup is not None:
            sup.restart(f"hung: no step for {hang.stuck_seconds:.0f}s at step {hang.step} (bound {hang.bound:.0f}s)")

    def on_unhealthy(self, report: HealthReport) -> None:
        sup, monitor = self.supervisor(), self.monitor()
        if sup is None or sup.pid is None:
            return  # between runs: the supervisor is already on it (backoff, or PS restarts for a generation)
        if monitor is not None and monitor.health is Health.STARTING:
            return  # the task was (re)started after this verdict was reached: it is about an earlier run
        self._outage_began()
        sup.restart(f"unhealthy: {report.reason}")

    def on_health(self, task: str, health: Health) -> None:
        self.metrics.on_health(task, health)
        if health is Health.HEALTHY and self.role != "chief":
            self.on_capture()  # a PS or worker that serves is as healthy as a trainer that delivers

    def on_capture(self) -> None:
        """The task does its job (the trainer delivered a capture, a server serves): its run is healthy, a later
        death no crash loop, and an outage under way is over."""
        sup = self.supervisor()
        if sup is not None:
            sup.mark_healthy()
        with self._lock:
            began, self._failure_at = self._failure_at, None
        if began is not None:
            seconds = time.monotonic() - began
            self.metrics.record_recovery(seconds)
            log.info("event=recovered task=%s seconds=%.2f", self.task, seconds)

    def restart(self, sup: Supervisor, reason: str) -> bool:
        """An operator's restart (``POST /restart``): no crash. False when the task is not supervised."""
        monitor = self.monitor()
        if monitor is not None:
            # The old process stays a zombie until reaped: the probes must not count that against the new run.
            monitor.reset()
        return sup.restart(reason, crash=False)

    def started_within(self, sup: Supervisor, seconds: float) -> bool:
        """Whether the recovery plan leaves the task's run alone, the failure having been ``seconds`` ago: a run
        that began since replaced the failed one (a generation's ``POST /restart`` must not kill it). Judged on
        this host's clock alone (the run's uptime against the seconds since the failure)."""
        uptime = sup.status().uptime_seconds
        now = time.monotonic()
        report = TaskReport(self.task, run_started_at=None if uptime is None else now - uptime, role=self.role)
        part = plan(Facts((report,), failure=Failure(now - seconds))).tasks[self.task]
        fresh = part.process is Process.WAIT_FOR
        if fresh:
            log.info("event=restart_skipped task=%s uptime=%.2fs reason=%r", self.task, uptime, part.why)
        return fresh

    # ------------------------------------------------------------------------------------------ generations
    def new_generation(self, reason: str, failed_at: float | None) -> dict[str, Any]:
        """The trainer rejoins in-process after a PS failure: restart every PS peer first (``POST
        /new-generation``); then the PS agents export the memory tier ahead of the restore that follows. After
        the restarts, not beside them: an exporting PS agent answers its restart later, and the restore asks for
        the files only after the model's rebuild, by when the export is done."""
        outcome = self.peer_sync.new_generation(reason, failed_at, new_process=False)
        self.export_ahead()
        return outcome

    # ------------------------------------------------------------------------------------------ reports
    def failure_reported(self, failed_at: float, step: int | None) -> None:
        """``POST /failure``: the trainer saw a cluster failure at ``failed_at`` (Unix time) and is about to exit
        75, having trained up to ``step``."""
        with self._lock:
            self._reported_failure = failed_at
            if step is not None:
                self._reported_step = step
        log.info("event=failure_reported task=%s age=%.2fs", self.task, time.time() - failed_at)

    def recovery_reported(
        self,
        lost: int | None,
        restored: int | None,
        seen: int | None,
        seconds: float | None,
        *,
        source: str | None = None,
        mapped: tuple[int, int] | None = None,
    ) -> int | None:
        """``POST /recovery``: count the steps lost, from the trainer's own figure (``lost``) or from the step it
        restored against the step it (``seen``) or its failed predecessor (``POST /failure``) had reached. The
        steps lost, or ``None`` when there is nothing to compare with. ``source``: the tier the trainer restored
        from (``memory``, ``durable``), logged and kept for ``/status`` whatever the count; ``mapped``: of the
        shard files its PS nodes loaded, how many they mapped (zero-copy) and how many there were, likewise."""
        if restored is not None:
            last: dict[str, Any] = {"step": restored, "source": source, "at": time.time()}
            shown = ""
            if mapped is not None:
                last["shards_mapped"], last["shards_loaded"] = mapped
                shown = f" shards_mapped={mapped[0]}/{mapped[1]}"
            with self._lock:
                self._last_restore = last
            log.info("event=trainer_restored task=%s restored_step=%d source=%s%s", self.task, restored, source, shown)
        if lost is None:
            with self._lock:
                reported, self._reported_step = self._reported_step, None
            seen = seen if seen is not None else reported
            if seen is None:  # a first start, or a trainer that died without a word: nothing to compare with
                return None
            assert restored is not None
            lost = max(0, seen - restored)
        self.metrics.lost_steps.inc(lost)
        with self._lock:
            self._last_lost_steps = lost
        log.info("event=recovery_reported task=%s lost_steps=%d restored_step=%s", self.task, lost, restored)
        if seconds is not None:  # a recovery timed by the trainer (in process)
            self.metrics.record_recovery(seconds)
        return lost

    def status(self) -> dict[str, Any]:
        """The recovery's part of the agent's ``/status``."""
        with self._lock:
            return {
                "last_lost_steps": self._last_lost_steps,
                "last_restore": self._last_restore,
                "hangs": self._hangs,
                "last_hang": self._last_hang,
            }
