"""The agent's POST routes: each request's body checked (a 400 that names the field) and handed to what acts on it
(:class:`~psguard.agent.recovery.Recovery`, or for ``/finish`` the agent's own stop)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from psguard.agent.control.httpd import AgentHTTPServer, Request, RequestError, Response
from psguard.agent.process.supervisor import Supervisor
from psguard.agent.recovery import Recovery

log = logging.getLogger(__name__)


@dataclass
class Routes:
    """The POST routes of task ``task``'s agent; ``on_finish`` stops the agent (``POST /finish``'s reason given)."""

    task: str
    recovery: Recovery
    supervisor: Callable[[], Supervisor | None]
    on_finish: Callable[[str], None]

    def serve_on(self, http: AgentHTTPServer, *, chief: bool) -> None:
        http.add_post("/restart", self.restart)
        http.add_post("/recovery", self.recovered)
        if chief:
            http.add_post("/new-generation", self.new_generation)
            http.add_post("/failure", self.failure)
        else:
            http.add_post("/finish", self.finish)

    def restart(self, request: Request) -> Response:
        body, reason = _reason(request, "POST /restart")
        sup = self.supervisor()
        if sup is None:
            raise RequestError(503, "the task is not supervised yet")
        before = sup.status().restarts
        within = body.get("unless_started_within")  # seconds: a run that young is left alone
        if isinstance(within, int | float) and self.recovery.started_within(sup, float(within)):
            return Response(200, {"ok": True, "task": self.task, "restarts_before": before, "fresh": True})
        if not self.recovery.restart(sup, f"requested over HTTP: {reason}"):
            raise RequestError(409, f"task {self.task} is not running under supervision ({sup.status().state.value})")
        log.info("event=restart_requested task=%s reason=%r", self.task, reason)
        return Response(202, {"ok": True, "task": self.task, "restarts_before": before})

    def finish(self, request: Request) -> Response:
        """The job is done (the chief's agent says so when its trainer exited 0): stop the task, exit 0."""
        _, reason = _reason(request, "POST /finish")
        log.info("event=finish_requested task=%s reason=%r", self.task, reason)
        self.on_finish(reason)
        return Response(202, {"ok": True, "task": self.task})

    def new_generation(self, request: Request) -> Response:
        """The trainer rejoins in-process after a PS failure: restart every PS peer first, answer when done."""
        body, reason = _reason(request, "POST /new-generation")
        failed_at = body.get("failed_at")
        if failed_at is not None and (not isinstance(failed_at, int | float) or failed_at > time.time() + 5):
            raise RequestError(400, "failed_at: expected the Unix time at which the trainer saw the failure")
        result = self.recovery.new_generation(
            f"in-process rejoin: {reason}", None if failed_at is None else float(failed_at)
        )
        failed = any(str(o).startswith("error") for o in result["peers"].values())
        return Response(503 if failed else 200, {"ok": not failed, **result})

    def failure(self, request: Request) -> Response:
        """The trainer saw a cluster failure and is about to exit 75: when, so that the next generation leaves
        alone a PS that was started since (see :func:`report_failure`)."""
        body = request.json()
        failed_at = body.get("failed_at") if isinstance(body, dict) else None
        if not isinstance(failed_at, int | float) or failed_at > time.time() + 5:
            raise RequestError(400, 'expected {"failed_at": <Unix time at which the trainer saw the failure>}')
        self.recovery.failure_reported(float(failed_at), _count(body, "step"))  # the last step trained
        return Response(200, {"ok": True})

    def recovered(self, request: Request) -> Response:
        """A trainer restored: count the steps lost, from its own figure or from the steps it reports."""
        body = request.json()
        if not isinstance(body, dict):
            raise RequestError(400, 'expected a JSON object: {"lost_steps": N} or {"restored_step": N}')
        lost, restored, seen = (_count(body, key) for key in ("lost_steps", "restored_step", "seen_step"))
        if lost is None and restored is None:
            raise RequestError(400, 'expected {"lost_steps": N} or {"restored_step": N, "seen_step": M}')
        timed = float(sec) if isinstance(sec := body.get("seconds"), int | float) and sec >= 0 else None
        source = str(src)[:40] if isinstance(src := body.get("source"), str) else None
        mapped = body.get("shards_mapped")  # [mapped, loaded]: of the shard files the PS nodes loaded
        ints = isinstance(mapped, list) and len(mapped) == 2 and all(type(v) is int for v in mapped)
        if mapped is not None and not (ints and 0 <= mapped[0] <= mapped[1]):
            raise RequestError(400, f'"shards_mapped": expected [mapped, loaded], integers, got {mapped!r}')
        mapped = None if mapped is None else (mapped[0], mapped[1])
        if self.recovery.recovery_reported(lost, restored, seen, timed, source=source, mapped=mapped) is None:
            return Response(200, {"ok": True, "lost_steps": None})
        return Response(200, {"ok": True})


def _reason(request: Request, default: str) -> tuple[dict[str, Any], str]:
    """The body, a JSON object or nothing, and its ``reason`` (at most 300 characters)."""
    body = request.json()
    if body is not None and not isinstance(body, dict):
        raise RequestError(400, 'the body must be a JSON object, e.g. {"reason": "..."}')
    body = body or {}
    return body, str(body.get("reason") or default)[:300]


def _count(body: dict[str, Any], key: str) -> int | None:
    """``body[key]``: absent, or a whole number >= 0 (else a 400 that names it)."""
    value = body.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise RequestError(400, f'"{key}": expected an integer >= 0, got {value!r}')
    return value
