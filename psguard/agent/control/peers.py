"""The chief's agent and its peers: PS servers restarted for every new trainer generation, since a PS that
survives its chief keeps the old chief's context and TensorFlow cannot drop it from outside (docs/design.md,
"New trainer generation")."""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from psguard.agent.process.prober import MonitorConfig
from psguard.config import Check, Duration, validate
from psguard.handoff.client import http_json
from psguard.handoff.plan import Facts, Failure, Options, Process, TaskReport, TaskState, plan

log = logging.getLogger(__name__)

#: Peers a generation visits at once (each visit is an HTTP call or two).
_MAX_PARALLEL = 32
#: Between rounds of GET /status to the peers still starting (a new generation's restart, the start's sync).
_POLL_SECONDS = 0.025


@dataclass(frozen=True)
class PeersConfig:
    """``peers:``: the chief's agent watches the other agents and restarts the PS servers per generation."""

    restart_ps: bool = True  # on every new trainer generation (see the module docstring)
    # ... and the workers too when the new generation's trainer is a new process: a worker keeps the device
    # resources (lookup tables, iterators) of every earlier chief, which a new chief's collide with.
    restart_workers: bool = True
    # An in-process rejoin leaves a PS that survived the failure running instead of restarting it. Off by
    # default: a kept PS grows with every recovery (docs/bench/keep_survivors_rss.py has the evidence).
    keep_survivors: bool = False
    # Peer copies (docs/design.md, "Peer copies"): "full", every PS agent keeps a copy of another node's shards;
    # "parity", one XOR block per group of parity_group PS tasks, held by an agent outside the group; "none": off.
    copies: Literal["none", "full", "parity"] = "none"
    # Owner PS task -> the PS task whose agent holds its copy (default: the next PS on another node).
    copy_placement: Mapping[str, str] = field(default_factory=dict)
    parity_group: Annotated[int, Check(lambda n: n >= 2, ">= 2")] = 2  # PS tasks per parity block
    # A group ("ps:0,ps:1") -> the PS task whose agent holds its parity (default: the first PS after the group, in
    # ring order, on a node no member is on).
    parity_placement: Mapping[str, str] = field(default_factory=dict)
    # When the trainer exits 0, POST /finish to every peer agent: PS and worker agents stop their servers and exit
    # 0, so their pods complete (Kubernetes Jobs).
    finish_on_success: bool = False
    ready_timeout: Duration = 180.0  # for all PS agents to report a restarted, healthy server
    request_timeout: Duration = 10.0
    probe: MonitorConfig = field(default_factory=lambda: MonitorConfig(interval=2.0, deadline=2.0))

    def __post_init__(self) -> None:
        validate(self)


class PeerSync:
    """The peers of the chief's agent (their base URLs) and the trainer generations it started.

    :meth:`sync` brings them to a known state before a trainer starts; :meth:`new_generation` restarts every
    PS peer, one generation at a time (the supervisor's exit callback and ``POST /new-generation`` may both
    ask). ``stop``: set when the agent stops, ends every wait.
    """

    def __init__(
        self,
        task: str,
        peers: Sequence[str],
        config: PeersConfig,
        token: str | None,
        stop: threading.Event,
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.task = task
        self.peers = list(peers)
        self.config = config
        self._peer_token = token
        self._tls = tls  # https:// peers: verified against the agent's CA; our client certificate under mTLS
        self._stop = stop
        self._lock = threading.Lock()
        self._one_at_a_time = threading.Lock()
        self.generation = 0
        self.last: dict[str, Any] | None = None
        self.names: dict[str, str] = {}  # peer URL -> its task's name (``ps:0``), from its /status
        self.part_dirs: dict[str, str] = {}  # PS task -> the part folder its agent keeps shards in (/status)
        self.part_stores: dict[str, bool] = {}  # PS task -> whether its agent can write the durable log
        self.nodes: dict[str, str | None] = {}  # task -> the node its agent runs on (/status), for peer copies
        # Called with a PS task's name and its /status when :meth:`sync` first sees its agent as fresh (started
        # after the failure, its tier empty): the chief's agent has it fetch its shards from the peer's copy now.
        self.on_fresh: Callable[[str, Mapping[str, Any]], None] | None = None

    def sync(
        self, *, restart_ps: bool, why: str = "", failed_at: float | None = None, new_process: bool = False
    ) -> dict[str, str]:
        """Bring the peers to a known state before the trainer starts; the outcome per peer URL.

        Each peer does its part of the recovery plan (:mod:`psguard.handoff.plan`) on its ``/status``: restarted
        (then waited for until its restart count went up and it is ready), waited for until ready, or kept.
        ``failed_at``: a moment the failed generation still ran (Unix time, this host's clock; a peer's run start
        is its uptime before the answer). Peers that do not answer yet are retried until ``peers.ready_timeout``;
        an HTTP error ends that peer's wait.
        """
        cfg = self.config
        failure = Failure(failed_at, new_trainer_process=new_process)
        facts = Facts(failure=failure, options=Options(restart_ps, cfg.restart_workers, cfg.keep_survivors))
        generation = _Round(self, facts, why)
        deadline = time.monotonic() + cfg.ready_timeout
        # Side by side: one at a time, the N-th PS would wait N round trips, on every recovery's path.
        with ThreadPoolExecutor(
            min(_MAX_PARALLEL, max(1, len(self.peers))), thread_name_prefix="psguard-peers"
        ) as pool:
            while generation.pending and not self._stop.is_set() and time.monotonic() < deadline:
                list(pool.map(generation.visit, list(generation.pending)))
                if generation.pending:
                    self._stop.wait(_POLL_SECONDS)  # polling the peers' state, bounded by the deadline
        return generation.finish(restart_ps, stopped=self._stop.is_set())

    def learn(self, url: str, doc: Mapping[str, Any]) -> None:
        """What a peer's ``/status`` tells of it: its task's name, node and shard folder."""
        if not isinstance(doc.get("task"), str):
            return
        self.names[url] = doc["task"]
        node = doc.get("node")
        self.nodes[doc["task"]] = node if isinstance(node, str) else None
        shards = doc.get("shards")
        if isinstance(shards, dict) and isinstance(shards.get("folder"), str):
            self.part_dirs[doc["task"]] = shards["folder"]
            self.part_stores[doc["task"]] = shards.get("store") is True

    def report(self, url: str, doc: Mapping[str, Any], asked_at: float) -> TaskReport:
        """A peer's ``/status`` as the recovery plan reads it; its run's start on this host's clock (``asked_at``
        less its uptime: a lower bound, since the uptime was measured after the question left)."""
        uptime = (doc.get("supervisor") or {}).get("uptime_seconds")
        restarts, state = int(doc.get("restarts") or 0), str(doc.get("state"))
        task_state = TaskState.NEW if state == "idle" and restarts == 0 else _STATES.get(state, TaskState.DOWN)
        if task_state is TaskState.UP and doc.get("health") == "unhealthy":
            task_state = TaskState.HUNG
        task = doc["task"] if isinstance(doc.get("task"), str) else url
        return TaskReport(
            task,
            task_state,
            asked_at - uptime if isinstance(uptime, int | float) else None,
            ready=doc.get("ready") is True,
            node=self.nodes.get(task),
            copies=() if self.config.copies == "none" else None,  # the holders answer when asked
            role=str(doc.get("role") or "?"),
        )

    def tasks(self) -> dict[str, str]:
        """Task name -> base URL of every peer whose name is known."""
        return {task: url for url, task in self.names.items()}

    def call(
        self, method: str, url: str, body: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> tuple[int, Any]:
        """One request to a peer agent with the agents' credentials (``OSError`` when it does not answer)."""
        timeout = self.config.request_timeout if timeout is None else timeout
        return http_json(method, url, body=body, token=self._peer_token, timeout=timeout, tls=self._tls)

    def post(self, url: str, body: Mapping[str, Any], timeout: float) -> Any:
        """POST to a peer agent; the answer's JSON, or ``RuntimeError`` for an HTTP error status (its message
        included)."""
        code, answer = self.call("POST", url, body, timeout)
        if not 200 <= code < 300:
            raise RuntimeError(f"HTTP {code}: {_error(answer)}")
        return answer

    def finish(self, reason: str) -> dict[str, str]:
        """The job is done: ``POST /finish`` to every peer agent (each stops its task and exits 0); the outcome per
        peer URL. A peer that does not answer is tried again once after a second; an HTTP error is final."""
        outcome: dict[str, str] = {}
        for url in self.peers:
            for attempt in (1, 2):
                try:
                    code, answer = self.call("POST", f"{url}/finish", {"reason": reason})
                except OSError as e:
                    outcome[url] = f"error: {e}"
                    if attempt == 1:
                        time.sleep(1.0)  # not self._stop.wait: the agent may be stopping; this is its last word
                    continue
                ok = 200 <= code < 300
                outcome[url] = "finished" if ok else f"error: POST /finish answered HTTP {code}: {_error(answer)}"
                break
        failed = any(o.startswith("error") for o in outcome.values())
        (log.error if failed else log.info)(
            "event=peers_finished task=%s reason=%r outcome=%s", self.task, reason, json.dumps(outcome)
        )
        return outcome

    def new_generation(
        self, reason: str, failed_at: float | None = None, *, new_process: bool = True
    ) -> dict[str, Any]:
        """Restart every PS peer (and every worker for a ``new_process`` trainer, unless
        ``peers.restart_workers`` is off) and wait until all serve again; the outcome.

        One at a time: the supervisor's exit callback and ``POST /new-generation`` may both ask.
        """
        with self._one_at_a_time:
            with self._lock:
                self.generation += 1
                generation = self.generation
            t0, peers = time.monotonic(), len(self.peers)
            log.info("event=generation task=%s generation=%d reason=%r peers=%d", self.task, generation, reason, peers)
            why = f"new trainer generation {generation}: {reason}"
            outcome = self.sync(restart_ps=True, why=why, failed_at=failed_at, new_process=new_process)
            seconds = time.monotonic() - t0
            failed = {u: o for u, o in outcome.items() if o.startswith("error")}
            (log.error if failed else log.info)(
                "event=generation_ready task=%s generation=%d seconds=%.2f outcome=%s",
                self.task,
                generation,
                seconds,
                json.dumps(outcome),
            )
            result = dict(generation=generation, reason=reason, at=time.time(), seconds=seconds, peers=outcome)
            with self._lock:
                self.last = result
            return result


def _error(answer: Any) -> str:
    return str(answer.get("error", "")) if isinstance(answer, dict) else ""


_STATES = {"running": TaskState.UP, "backoff": TaskState.RESTARTING, "stopping": TaskState.RESTARTING}
_FRESH = "fresh (started after the failure)"


class _Round:
    """One :meth:`PeerSync.sync`: each peer's part of the plan, carried out, and its outcome once settled.

    ``pending``: the peers not settled yet, each with its restart count when it was asked to restart (or found
    fresh), ``None`` before its first answer. Each visit touches only its own peer's keys, so the peers are
    visited side by side.
    """

    def __init__(self, peers: PeerSync, facts: Facts, why: str) -> None:
        self.peers, self.facts, self.why = peers, facts, why
        self.pending: dict[str, int | None] = dict.fromkeys(peers.peers)
        self.outcome: dict[str, str] = {}
        self.waiting: dict[str, str] = {}  # waited for, not restarted: the outcome it settles with once ready
        self.left_alone: set[str] = set()  # asked to restart, its agent answered that its run is fresh
        self.last_error: dict[str, str] = {}

    def visit(self, url: str) -> None:
        """One peer's round: its status, its part of the plan at its first answer, its outcome once settled."""
        asked_at = time.time()  # the answer's uptime is measured later: the task started after asked - uptime
        try:
            code, doc = self.peers.call("GET", f"{url}/status")
        except OSError as e:
            self.last_error[url] = str(e)
            return  # not serving yet: retried until the deadline
        if code != 200 or not isinstance(doc, dict):
            self._settle(url, f"error: GET /status answered HTTP {code}")
            return
        self.peers.learn(url, doc)
        restarts, ready = int(doc.get("restarts") or 0), doc.get("ready") is True
        before = self.pending[url]
        if before is None and url not in self.waiting:
            self._carry_out(url, doc, asked_at, restarts, ready)
        elif ready and url in self.waiting:  # (not ready: waited for still)
            self._settle(url, self.waiting[url])
        elif ready and before is not None and restarts > before:
            self._settle(url, "restarted")
        elif ready and url in self.left_alone:
            self._settle(url, _FRESH)

    def _carry_out(self, url: str, doc: Mapping[str, Any], asked_at: float, restarts: int, ready: bool) -> None:
        report = self.peers.report(url, doc, asked_at)
        part = plan(replace(self.facts, tasks=(report,))).tasks[report.task]
        if part.process is Process.KEEP:
            kept = "survivor-kept" in part.rules
            self._settle(url, "kept (survived the failure)" if kept else f"skipped ({doc.get('role')})")
        elif part.process is Process.WAIT_FOR:
            self.waiting[url] = "ready" if "only-waited" in part.rules else _FRESH
            if self.waiting[url] == _FRESH:
                self.pending[url] = restarts
                self._fresh(doc)
            if ready:
                self._settle(url, self.waiting[url])
        else:
            self._restart(url, doc, restarts)

    def _restart(self, url: str, doc: Mapping[str, Any], restarts: int) -> None:
        failed_at = self.facts.failure.at
        try:
            # A run that started after the failure is left alone by the peer: it may have come up since its
            # /status above (out of its restart backoff).
            since = {} if failed_at is None else {"unless_started_within": time.time() - failed_at}
            code, answer = self.peers.call("POST", f"{url}/restart", {"reason": self.why, **since})
        except OSError as e:
            self.last_error[url] = str(e)
            return
        if not 200 <= code < 300:
            self._settle(url, f"error: POST /restart answered HTTP {code}: {_error(answer)}")
            return
        if isinstance(answer, dict) and answer.get("fresh") is True:
            # The agent left its run alone (it started after the failure): its restart count may never go up.
            self.left_alone.add(url)
            self._fresh(doc)
        self.pending[url] = restarts

    def _fresh(self, doc: Mapping[str, Any]) -> None:
        """A PS started after the failure (a replacement's may still be starting): the chief's agent has it
        fetch its shards now (``on_fresh``), beside the rest of the generation."""
        if self.peers.on_fresh is not None and doc.get("role") == "ps" and isinstance(doc.get("task"), str):
            self.peers.on_fresh(doc["task"], doc)

    def _settle(self, url: str, outcome: str) -> None:
        self.outcome[url] = outcome
        del self.pending[url]

    def finish(self, restart_ps: bool, *, stopped: bool) -> dict[str, str]:
        """The outcomes, with an error for each peer still pending."""
        what = f"{'restarted and ' if restart_ps else ''}ready"
        for url in self.pending:
            detail = f" (last error: {self.last_error[url]})" if url in self.last_error else ""
            if stopped:
                self.outcome[url] = f"error: this agent stopped before the peer was {what}"
            else:
                self.outcome[url] = f"error: not {what} within {self.peers.config.ready_timeout:g}s{detail}"
        return self.outcome
