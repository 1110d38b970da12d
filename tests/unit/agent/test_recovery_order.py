"""The chief agent's order at a new trainer generation (psguard.agent.recovery.Recovery): every PS restart is asked
for before the PS agents start exporting the memory tier ahead of the restore.

Why it matters: an agent busy with that export answered the restart request 50 ms after the others on the 1 GB
bench, on every PS failure's critical path, while the restore asks for the files only after the cluster reset and
the model's rebuild (0.5 s and more later).
"""

from __future__ import annotations

import time
from typing import Any

from psguard.agent.control.metrics import AgentMetrics
from psguard.agent.process.lifecycle import EventKind, SupervisorEvent
from psguard.agent.recovery import Recovery
from psguard.handoff.contract import EXIT_RESTART


class _Peers:
    """A PeerSync's generation call, recorded."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def new_generation(self, reason: str, failed_at: float | None = None, **kwargs: Any) -> dict[str, Any]:
        self.calls.append("restart every PS")
        return {"generation": 1, "peers": {}}


def _recovery(calls: list[str]) -> Recovery:
    return Recovery(
        "chief:0",
        "chief",
        restart_ps=True,
        metrics=AgentMetrics.create(),
        peer_sync=_Peers(calls),  # type: ignore[arg-type]
        supervisor=lambda: None,
        monitor=lambda: None,
        export_ahead=lambda: calls.append("export ahead"),
        on_done=lambda: None,
    )


def test_an_in_process_rejoin_restarts_every_ps_before_the_export_ahead() -> None:
    calls: list[str] = []
    _recovery(calls).new_generation("in-process rejoin", failed_at=time.time())
    assert calls == ["restart every PS", "export ahead"]


def test_a_trainer_restart_restarts_every_ps_before_the_export_ahead() -> None:
    calls: list[str] = []
    exited = SupervisorEvent(
        EventKind.EXITED, "chief:0", time.time(), exit_code=EXIT_RESTART, reason="exited 75", run_seconds=10.0,
        backoff_seconds=0.0,
    )  # fmt: skip
    _recovery(calls).on_supervisor_event(exited)
    assert calls == ["restart every PS", "export ahead"]
