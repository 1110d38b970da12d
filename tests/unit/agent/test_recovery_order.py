"""The agent's recovery (psguard.agent.recovery.Recovery) carrying out its part of the recovery plan.

The chief's order at a new trainer generation: every PS restart is asked for before the PS agents start exporting
the memory tier ahead of the restore (an agent busy with that export answered the restart request 50 ms after the
others on the 1 GB bench, on every PS failure's critical path, while the restore asks for the files only after
the cluster reset and the model's rebuild, 0.5 s and more later). The failure moment it passes on, and a PS
agent's own part: a run that began after the failure is not restarted again.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from psguard.agent.control.metrics import AgentMetrics
from psguard.agent.process.lifecycle import EventKind, SupervisorEvent
from psguard.agent.recovery import Recovery
from psguard.handoff.contract import EXIT_RESTART


class _Peers:
    """A PeerSync's generation call, recorded."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def new_generation(self, reason: str, failed_at: float | None = None, **kwargs: Any) -> dict[str, Any]:
        self.calls.append("restart every PS" if failed_at is None else f"restart every PS (failed_at {failed_at})")
        return {"generation": 1, "peers": {}}


def _recovery(calls: list[str]) -> Recovery:
    return Recovery(
        "chief:0",
        "chief",
        restart_ps=True,
        metrics=AgentMetrics(),
        peer_sync=_Peers(calls),  # type: ignore[arg-type]
        supervisor=lambda: None,
        monitor=lambda: None,
        export_ahead=lambda: calls.append("export ahead"),
        on_done=lambda: None,
    )


def test_an_in_process_rejoin_restarts_every_ps_before_the_export_ahead() -> None:
    calls: list[str] = []
    _recovery(calls).new_generation("in-process rejoin", failed_at=None)
    assert calls == ["restart every PS", "export ahead"]


def test_a_trainer_restart_restarts_every_ps_before_the_export_ahead() -> None:
    calls: list[str] = []
    exited = SupervisorEvent(
        EventKind.EXITED, "chief:0", time.time(), exit_code=EXIT_RESTART, reason="exited 75", run_seconds=10.0,
        backoff_seconds=0.0,
    )  # fmt: skip
    _recovery(calls).on_supervisor_event(exited)
    assert calls == ["restart every PS", "export ahead"]


class _Supervisor:
    """A supervisor's status, as far as the recovery plan reads it."""

    def __init__(self, uptime: float | None) -> None:
        self.uptime = uptime

    def status(self) -> Any:
        return type("Status", (), {"uptime_seconds": self.uptime})()


@pytest.mark.parametrize(("uptime", "left_alone"), [(0.2, True), (5.0, False), (None, False)])
def test_a_ps_agent_leaves_a_run_that_began_after_the_failure_alone(uptime: float | None, left_alone: bool) -> None:
    """``POST /restart {unless_started_within: 1}``: a run younger than the failure replaced the failed one."""
    recovery = Recovery(
        "ps:0", "ps", restart_ps=False, metrics=AgentMetrics(), peer_sync=_Peers([]),  # type: ignore[arg-type]
        supervisor=lambda: None, monitor=lambda: None, export_ahead=lambda: None, on_done=lambda: None,
    )  # fmt: skip
    assert recovery.started_within(_Supervisor(uptime), 1.0) is left_alone  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exit_code", "reported_ago", "passed_on"),
    [(EXIT_RESTART, 1.0, True), (EXIT_RESTART, 20.0, False), (1, 1.0, False)],
)
def test_a_new_generation_gets_the_failure_moment_only_from_the_run_that_asked_for_it(
    exit_code: int, reported_ago: float, passed_on: bool
) -> None:
    """The run lasted 10 s: a report older than that came from an earlier run; a crash reports nothing."""
    calls: list[str] = []
    recovery = _recovery(calls)
    now = time.time()
    recovery.failure_reported(now - reported_ago, step=7)
    exited = SupervisorEvent(
        EventKind.EXITED, "chief:0", now, exit_code=exit_code, reason="exited", run_seconds=10.0, backoff_seconds=0.0
    )
    recovery.on_supervisor_event(exited)
    assert calls[0] == (f"restart every PS (failed_at {now - reported_ago})" if passed_on else "restart every PS")
