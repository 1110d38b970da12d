"""The agent's POST routes (psguard.agent.routes): a malformed body is a 400 naming what is wrong and reaches
nothing; a good one reaches Recovery (the lost steps counted) or the agent's stop (POST /finish)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from psguard.agent.control.httpd import Request, RequestError
from psguard.agent.control.metrics import AgentMetrics
from psguard.agent.recovery import Recovery
from psguard.agent.routes import Routes


def _request(body: Any) -> Request:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Request("POST", "/", {}, {}, raw)


def _routes(finished: list[str]) -> tuple[Routes, AgentMetrics]:
    metrics = AgentMetrics()
    recovery = Recovery(
        "chief:0",
        "chief",
        restart_ps=False,
        metrics=metrics,
        peer_sync=None,  # type: ignore[arg-type]  # no route here reaches the peers
        supervisor=lambda: None,
        monitor=lambda: None,
        export_ahead=lambda: None,
        on_done=lambda: None,
    )
    return Routes("chief:0", recovery, lambda: None, finished.append), metrics


@pytest.mark.parametrize(
    ("route", "body", "status", "says"),
    [
        ("recovered", [1], 400, "expected a JSON object"),
        ("recovered", {"seen_step": 3}, 400, "lost_steps"),
        ("recovered", {"lost_steps": -1}, 400, '"lost_steps": expected an integer >= 0'),
        ("recovered", {"restored_step": True}, 400, '"restored_step"'),
        ("recovered", {"restored_step": 5, "shards_mapped": [3, 2]}, 400, '"shards_mapped"'),
        ("failure", {"step": 3}, 400, "failed_at"),
        ("failure", {"failed_at": 1.0, "step": -2}, 400, '"step"'),
        ("new_generation", {"failed_at": "yesterday"}, 400, "failed_at"),
        ("finish", [], 400, "must be a JSON object"),
        ("restart", b"{not json", 400, "not valid JSON"),
        ("restart", {}, 503, "not supervised yet"),
    ],
)
def test_a_malformed_request_is_refused_naming_what_is_wrong(route: str, body: Any, status: int, says: str) -> None:
    finished: list[str] = []
    routes, metrics = _routes(finished)
    with pytest.raises(RequestError, match=says) as refused:
        getattr(routes, route)(_request(body))
    assert refused.value.status == status
    assert not finished and "psguard_lost_steps_total 0" in metrics.registry.render()


def test_a_restored_trainers_report_counts_its_lost_steps() -> None:
    routes, metrics = _routes([])
    answer = routes.recovered(_request({"restored_step": 100, "seen_step": 130, "source": "memory"}))
    assert answer.status == 200 and answer.body == {"ok": True}
    assert "psguard_lost_steps_total 30" in metrics.registry.render()
    assert routes.recovery.status()["last_restore"]["source"] == "memory"


def test_finish_stops_the_agent_with_its_reason() -> None:
    finished: list[str] = []
    routes, _ = _routes(finished)
    answer = routes.finish(_request({"reason": "the job is done"}))
    assert answer.status == 202 and finished == ["the job is done"]
