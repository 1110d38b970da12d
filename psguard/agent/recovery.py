"""What an agent does when its task fails, hangs or comes back: the recovery rules, and the state they keep.

The parts that notice (the supervisor's events, the health monitor's verdicts, the hang watch, the trainer's
``POST /failure`` and ``POST /recovery``, its first capture after a restart) and the parts that act (the
supervisor's restart, the peers' new generation, the tiers' export ahead) are built elsewhere; :class:`Recovery`
is the one place that connects the first to the second, so that the rules read in one piece and the agent
(:mod:`psguard.agent.daemon`) only forwards to it. The rules:

- **An outage** begins when a run ends with a restart to follow, or when the monitor finds the task unhealthy
  (it is then restarted); it ends at the first sign the new run serves: a PS or worker answering its probes
  (the run is also declared healthy, so its end is no crash loop), the chief's trainer delivering a capture.
  Its length is ``psguard_recovery_seconds``.
- **The monitor** is reset whenever the task's process changes (started, restarted, exited, killed for an
  operator's restart): the gap before the next start (a backoff, the PS restarts of a generation) is no hang,
  and a verdict reached about an earlier run (``STARTING`` again, or no process at all) restarts nothing.
- **A new trainer generation** (the chief's agent, ``peers.restart_ps``): when the trainer's run ends with a
  restart to follow, every PS peer (and every worker: ``peers.restart_workers``) is restarted before the next
  trainer starts (this runs on the supervisor's
  thread, which starts the trainer only once it returns), after asking the PS agents to export the memory tier
  ahead of the restore that follows. ``failed_at`` from ``POST /failure`` is passed on only if the run that
  reported it is the one that just asked for a restart (exit 75): a PS started since that time is left alone.
  An in-process rejoin asks for the same through ``POST /new-generation`` (its workers are kept: the same
  process numbers its resources on, so nothing it creates meets an earlier generation's); an agent resuming a
  job from the durable log starts one too, since the PS servers may hold the earlier chief's context. The
  protocol as a whole is in docs/design.md ("The generation protocol of a PS-failure recovery").
- **A hang** (:mod:`psguard.agent.process.hang`) is counted and the trainer restarted (a crash); the new trainer
  restores from the memory tier.
- **Lost steps**: the step a failed trainer reported (``POST /failure``) against the step the restored one
  restored (``POST /recovery``), unless the trainer counted them itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from psguard.agent.control.httpd import RequestError
from psguard.agent.control.metrics import AgentMetrics
from psguard.agent.control.peers import PeerSync
from psguard.agent.process.hang import Hang
from psguard.agent.process.lifecycle import EventKind, SupervisorEvent
from psguard.agent.process.prober import Health, HealthMonitor, HealthReport
from psguard.agent.process.supervisor import Supervisor
from psguard.handoff.plan import Facts, Failure, Process, TaskReport, plan, reported_moment

__all__ = ["Recovery", "shards_mapped"]

log = logging.getLogger(__name__)


class Recovery:
    """The recovery rules of one agent (``task``, in ``role``) and the state of the outage under way.

    ``supervisor`` and ``monitor`` return the agent's current ones (``None`` before start and after stop);
    ``export_ahead`` asks the PS agents to export the memory tier ahead of a restore; ``on_done`` is called
    when supervision is over (completed, gave up, stopped). The ``on_*`` methods are the callbacks of the
    supervisor, the health monitor and the hang watch; the others serve the trainer's requests.
    """

    def __init__(
        self,
        task: str,
        role: str,
        *,
        restart_ps: bool,
        metrics: AgentMetrics,
        peer_sync: PeerSync,
        supervisor: Callable[[], Supervisor | None],
        monitor: Callable[[], HealthMonitor | None],
        export_ahead: Callable[[], None],
        on_done: Callable[[], None],
    ) -> None:
        self.task = task
        self.role = role
        self.restart_ps = restart_ps
        self.metrics = metrics
        self.peer_sync = peer_sync
        self._supervisor = supervisor
        self._monitor = monitor
        self._export_ahead = export_ahead
        self._on_done = on_done
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
        monitor = self._monitor()
        if event.kind in (EventKind.STARTED, EventKind.RESTARTED):
            if monitor is not None:
                monitor.reset()
        elif event.kind is EventKind.EXITED:
            # No process until the next start (backoff, PS restarts): the monitor must not count that gap as
            # a hang and cut the backoff short or kill the next run; STARTING ignores failures until it answers.
            if monitor is not None:
                monitor.reset()
            restart_follows = event.backoff_seconds is not None
            if restart_follows:
                with self._lock:
                    if self._failure_at is None:
                        self._failure_at = time.monotonic()
            if restart_follows and self.role == "chief" and self.restart_ps:
                # Runs on the supervisor's thread: the trainer is not started again until this returns.
                with self._lock:
                    reported, self._reported_failure = self._reported_failure, None
                run_start = event.time - (event.run_seconds or 0.0)
                failed_at = reported_moment(reported, run_started_at=run_start, exit_code=event.exit_code)
                self.peer_sync.new_generation(f"the trainer {event.reason}", failed_at)
                self._export_ahead()  # after the restarts, as for an in-process rejoin (new_generation says why)
        elif event.kind in (EventKind.COMPLETED, EventKind.GAVE_UP, EventKind.STOPPED):
            self._on_done()

    def on_hang(self, hang: Hang) -> None:
        """The trainer is alive and makes no steps (:mod:`psguard.agent.process.hang`): count it and restart it;
        the new trainer restores from the memory tier (a new generation: the PS servers are restarted first)."""
        self.metrics.hangs.inc()
        with self._lock:
            self._hangs += 1
            self._last_hang = {"step": hang.step, "stuck_seconds": round(hang.stuck_seconds, 1), "at": time.time()}
        sup = self._supervisor()
        if sup is not None:
            sup.restart(f"hung: no step for {hang.stuck_seconds:.0f}s at step {hang.step} (bound {hang.bound:.0f}s)")

    def on_unhealthy(self, report: HealthReport) -> None:
        sup, monitor = self._supervisor(), self._monitor()
        if sup is None or sup.pid is None:
            return  # between runs: the supervisor is already on it (backoff, or PS restarts for a generation)
        if monitor is not None and monitor.health is Health.STARTING:
            return  # the task was (re)started after this verdict was reached: it is about an earlier run
        with self._lock:
            if self._failure_at is None:
                self._failure_at = time.monotonic()
        sup.restart(f"unhealthy: {report.reason}")

    def on_health(self, task: str, health: Health) -> None:
        self.metrics.on_health(task, health)
        if health is Health.HEALTHY and self.role != "chief":
            sup = self._supervisor()
            if sup is not None:
                sup.mark_healthy()  # it serves: its end will not count towards a crash loop
            self.recovered()

    def on_capture(self) -> None:
        """The trainer delivered a capture: it trains."""
        sup = self._supervisor()
        if sup is not None:
            sup.mark_healthy()  # the trainer trains: a later death is no crash loop
        if self.role == "chief":
            self.recovered()  # the new generation's first capture: training runs again

    def recovered(self) -> None:
        with self._lock:
            began, self._failure_at = self._failure_at, None
        if began is not None:
            seconds = time.monotonic() - began
            self.metrics.record_recovery(seconds)
            log.info("event=recovered task=%s seconds=%.2f", self.task, seconds)

    def restart(self, sup: Supervisor, reason: str) -> bool:
        """An operator's restart (``POST /restart``): no crash. False when the task is not supervised."""
        monitor = self._monitor()
        if monitor is not None:
            # The old process is killed now and stays a zombie until reaped: the probes must not count that as
            # the new run failing (they killed a standby just swapped in, and the PS then started cold).
            monitor.reset()
        return sup.restart(reason, crash=False)

    def started_within(self, sup: Supervisor, seconds: float) -> bool:
        """Whether the recovery plan leaves the task's run alone, the failure having been ``seconds`` ago: a run
        that began since replaced the failed one (``started-after``). The race it closes: a new generation saw the
        crashed PS in its restart backoff (no run), its agent restarted it from the standby 0.1 s later, and the
        generation's ``POST /restart`` would then kill that run. Judged on this host's clock alone (the run's
        uptime against the seconds since the failure)."""
        uptime = sup.status().uptime_seconds
        now = time.monotonic()
        report = TaskReport(self.task, run_started_at=None if uptime is None else now - uptime, role=self.role)
        part = plan(Facts((report,), failure=Failure(now - seconds))).tasks[self.task]
        fresh = part.process is Process.WAIT_FOR
        if fresh:
            log.info("event=restart_skipped task=%s uptime=%.2fs reason=%r", self.task, uptime, part.why)
        return fresh

    # ------------------------------------------------------------------------------------------ generations
    def resumed(self, step: int) -> None:
        """An earlier chief ran this job (the tier was seeded from the durable log at ``step``): the PS servers
        may hold its context. Start from clean ones."""
        self.peer_sync.new_generation(f"the agent resumed a job (durable step {step})")

    def new_generation(self, reason: str, failed_at: float | None) -> dict[str, Any]:
        """The trainer rejoins in-process after a PS failure: restart every PS peer first (``POST
        /new-generation``); then the PS agents export the memory tier ahead of the restore that follows.

        The export after the restarts, not beside them: a surviving PS agent busy exporting answered the restart
        request 50 ms after the others (1 GB bench, 2026-12-06), and the restore asks for the files only after the
        cluster reset and the model's rebuild (0.5 s and more), by when the export (0.15-0.2 s) is done. A
        replacement agent (its node lost) is asked as soon as it answers (``on_fresh``), its fetch from the peer's
        copy overlapping the other PS's restarts."""
        outcome = self.peer_sync.new_generation(reason, failed_at, new_process=False)
        self._export_ahead()
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
            if mapped is not None:
                last["shards_mapped"], last["shards_loaded"] = mapped
            with self._lock:
                self._last_restore = last
            log.info(
                "event=trainer_restored task=%s restored_step=%d source=%s%s",
                self.task,
                restored,
                source,
                f" shards_mapped={mapped[0]}/{mapped[1]}" if mapped is not None else "",
            )
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


def shards_mapped(value: Any) -> tuple[int, int] | None:
    """``POST /recovery``'s ``shards_mapped`` ([mapped, loaded], two integers, mapped <= loaded), or None when
    absent; :class:`RequestError` (400) for anything else."""
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)
    if not ok or value[0] > value[1]:
        raise RequestError(400, f'"shards_mapped": expected [mapped, loaded], integers, got {value!r}')
    return int(value[0]), int(value[1])
