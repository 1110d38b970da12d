"""The chief's agent and its peers: PS servers restarted for every new trainer generation.

A PS that survives its chief keeps the old chief's eager context and variables, and TensorFlow offers no way
to drop a remote context from outside; the new generation restores every variable anyway. So before a new
trainer generation starts, the chief's agent asks every PS peer to restart its task and waits until each
serves again (docs/design.md, "New trainer generation", has the measurements behind this decision).
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from psguard.agent.process.prober import MonitorConfig
from psguard.config import Check, Duration, validate
from psguard.handoff.client import http_json

__all__ = ["PeerSync", "PeersConfig"]

log = logging.getLogger(__name__)

#: Peers a generation visits at once (each visit is an HTTP call or two).
_MAX_PARALLEL = 32
#: Between rounds of GET /status to the peers still starting (a new generation's restart, the start's sync).
_POLL_SECONDS = 0.025


@dataclass(frozen=True)
class PeersConfig:
    """``peers:``: the chief's agent watches the other agents and restarts the PS servers per generation."""

    restart_ps: bool = True  # on every new trainer generation (see the module docstring)
    # ... and the workers too when the new generation's trainer is a new process. A worker's servers keep the
    # device resources every earlier chief created there: a restarted chief numbers its lookup tables from the
    # same counter (``ops.uid()``), so a Keras StringLookup of the new chief finds an old chief's table under
    # its name ("Table was already initialized with different data"), and each chief restart leaks the last
    # one's tables and iterators. An in-process rejoin keeps its counter and its workers.
    restart_workers: bool = True
    # An in-process rejoin (run_with_recovery: the same trainer process) leaves a PS that survived the failure
    # running, serving and ready, instead of restarting it; a PS started after the failure is waited for as
    # always, and a new trainer process restarts every PS whatever this says. Saves the survivors' restart (0.1 s
    # of a 1 GB recovery, and part of the cluster reset). Off by default: a kept PS grows with every recovery
    # when the manager captures or restores (50-130 MB per recovery at 64 MB per PS, soak of 2026-12-06): tf.cond
    # branch graphs reachable from the functions psguard keeps across generations hold each generation's variable
    # handles, which keeps those variables on the PS. docs/bench/keep_survivors_rss.py reproduces it in a minute
    # and has the evidence; BENCHMARKS.md ("chaos soak") the soaks.
    keep_survivors: bool = False
    # Peer copies (psguard/agent/tiers/peer_copy.py): "full" has every PS agent keep a copy of another node's
    # shards, so a lost node restores from a peer's memory instead of the durable log. Costs each PS agent's
    # memory twice over. "parity": one XOR block per group of ``parity_group`` PS tasks (ps:0..ps:K-1, ...), held
    # by an agent outside the group on another node (psguard/agent/tiers/parity.py): costs the holder the largest
    # member's memory (1/K of the group), survives one lost node per group. "none": off.
    copies: Literal["none", "full", "parity"] = "none"
    # Owner PS task -> the PS task whose agent holds its copy (default: the next PS on another node).
    copy_placement: Mapping[str, str] = field(default_factory=dict)
    parity_group: Annotated[int, Check(lambda n: n >= 2, ">= 2")] = 2  # PS tasks per parity block
    # A group ("ps:0,ps:1") -> the PS task whose agent holds its parity (default: the first PS after the group, in
    # ring order, on a node no member is on).
    parity_placement: Mapping[str, str] = field(default_factory=dict)
    # When the trainer exits 0, tell every peer agent that the job is done (POST /finish): PS and worker agents
    # stop their servers and exit 0, so their pods complete (Kubernetes Jobs). Off by default: psguard wrap,
    # demo and chaos stop their agents themselves.
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
        # Called with a PS task's name and its /status when :meth:`sync` first sees its agent as fresh (started after
        # the failure: a replacement node's agent, whose tier is empty): the chief's agent has it fetch its shards
        # from the peer's copy at once, while its PS server still starts, instead of after the whole generation is
        # ready.
        self.on_fresh: Callable[[str, Mapping[str, Any]], None] | None = None

    def sync(
        self,
        *,
        restart_ps: bool,
        why: str = "",
        failed_at: float | None = None,
        workers: bool = False,
        keep_survivors: bool = False,
    ) -> dict[str, str]:
        """Bring the peers to a known state before the trainer starts; the outcome per peer URL.

        ``restart_ps``: every peer whose ``/status`` says ``role: ps`` (and ``worker`` too with ``workers``)
        restarts its task (``POST /restart``) and is waited for until its restart count went up and it is
        ready; other peers are skipped. Otherwise every peer is only waited for until ready. Peers that do not
        answer yet (their agent is still starting) are
        retried until ``peers.ready_timeout``; an HTTP error (a wrong token) ends the wait for that peer.
        ``failed_at`` (Unix time, this host's clock): a moment the failed trainer generation still ran (its last
        step, or when it saw the failure). A PS whose current run started after it is left alone (only waited
        for): the generation connected to the PS before that moment, so this process holds none of its state;
        typically the PS that died, already restarted by its own agent. Its start is judged by its
        uptime, so the PS host's clock does not matter. ``keep_survivors`` (with ``failed_at``): a ready PS whose run
        began before it is left running too (``peers.keep_survivors``, an in-process rejoin only).
        """
        cfg = self.config
        restarted_roles = {"ps", "worker"} if workers else {"ps"}
        deadline = time.monotonic() + cfg.ready_timeout
        outcome: dict[str, str] = {}
        pending: dict[str, int | None] = dict.fromkeys(self.peers)  # None: not asked yet; int: restarts before
        fresh: set[str] = set()
        left_alone: set[str] = set()  # asked to restart, the agent answered that its run is fresh
        last_error: dict[str, str] = {}

        def visit(url: str, before: int | None) -> None:
            """One peer's round: its status, its restart if due, its outcome once settled. Each visit touches
            only its own peer's keys, so the peers are visited side by side."""
            asked_at = time.time()  # the answer's uptime is measured later: the PS started after asked - uptime
            try:
                code, doc = http_json(
                    "GET", f"{url}/status", token=self._peer_token, timeout=cfg.request_timeout, tls=self._tls
                )
            except OSError as e:
                last_error[url] = str(e)
                return  # not serving yet: retried until the deadline
            if code != 200 or not isinstance(doc, dict):
                outcome[url] = f"error: GET /status answered HTTP {code}"
                del pending[url]
                return
            if isinstance(doc.get("task"), str):
                self.names[url] = doc["task"]
                node = doc.get("node")
                self.nodes[doc["task"]] = node if isinstance(node, str) else None
                shards = doc.get("shards")
                if isinstance(shards, dict) and isinstance(shards.get("folder"), str):
                    self.part_dirs[doc["task"]] = shards["folder"]
                    self.part_stores[doc["task"]] = shards.get("store") is True
            restarts, ready = int(doc.get("restarts") or 0), doc.get("ready") is True
            uptime = (doc.get("supervisor") or {}).get("uptime_seconds")
            if (
                before is None
                and restart_ps
                and doc.get("role") in restarted_roles
                and (
                    # A new agent (a replacement node) that has not started its PS yet: that PS will hold
                    # nothing of any generation. Asked to restart it, the agent answers 409 (idle).
                    (doc.get("state") == "idle" and restarts == 0)
                    or (
                        failed_at is not None
                        and isinstance(uptime, int | float)
                        and asked_at - uptime > failed_at  # a lower bound of its start: no margin needed
                    )
                )
            ):
                fresh.add(url)  # started after the failure: wait for it, do not restart it again
                pending[url] = restarts
                before = restarts
                if self.on_fresh is not None and doc.get("role") == "ps" and isinstance(doc.get("task"), str):
                    self.on_fresh(doc["task"], doc)
            survivor = url not in fresh and before is None and failed_at is not None and doc.get("role") == "ps"
            if survivor and keep_survivors and ready:  # serving: its old variables go with the failed generation
                outcome[url] = "kept (survived the failure)"
                del pending[url]
                return
            if url in fresh:
                if ready:
                    outcome[url] = "fresh (started after the failure)"
                    del pending[url]
            elif before is None and restart_ps and doc.get("role") in restarted_roles:
                try:
                    # A run that started after the failure is left alone by the peer: it may have come up
                    # since its /status above (out of its restart backoff).
                    since = {} if failed_at is None else {"unless_started_within": time.time() - failed_at}
                    code, answer = http_json(
                        "POST",
                        f"{url}/restart",
                        body={"reason": why, **since},
                        token=self._peer_token,
                        timeout=cfg.request_timeout,
                        tls=self._tls,
                    )
                except OSError as e:
                    last_error[url] = str(e)
                    return
                if not 200 <= code < 300:
                    message = answer.get("error", "") if isinstance(answer, dict) else ""
                    outcome[url] = f"error: POST /restart answered HTTP {code}: {message}"
                    del pending[url]
                    return
                if isinstance(answer, dict) and answer.get("fresh") is True:
                    # The agent left its run alone: it started after the failure. A replacement node's agent
                    # whose PS came up between its /status and this request is on its first run, and its
                    # restart count never goes up: waiting for that held a generation for ready_timeout.
                    left_alone.add(url)
                    if self.on_fresh is not None and doc.get("role") == "ps" and isinstance(doc.get("task"), str):
                        self.on_fresh(doc["task"], doc)
                pending[url] = restarts
            elif before is None and restart_ps:
                outcome[url] = f"skipped ({doc.get('role')})"
                del pending[url]
            elif ready and (before is None or restarts > before):
                outcome[url] = "restarted" if before is not None else "ready"
                del pending[url]
            elif ready and url in left_alone:
                outcome[url] = "fresh (started after the failure)"
                del pending[url]

        # Side by side: one at a time, a restart request reached the N-th PS N round trips after the first (about
        # 25 ms each on loopback: 2.4 s at 100 PS, on every recovery's path).
        with ThreadPoolExecutor(
            min(_MAX_PARALLEL, max(1, len(self.peers))), thread_name_prefix="psguard-peers"
        ) as pool:
            while pending and not self._stop.is_set() and time.monotonic() < deadline:
                list(pool.map(lambda item: visit(*item), list(pending.items())))
                if pending:
                    # Polling the peers' state, bounded by the deadline. The trainer waits for the last PS seen
                    # ready: at 0.1 s a round cost 0.05 s of every recovery on average; a round is one GET /status
                    # per PS still pending.
                    self._stop.wait(_POLL_SECONDS)
        for url in pending:
            detail = f" (last error: {last_error[url]})" if url in last_error else ""
            if self._stop.is_set():
                outcome[url] = (
                    f"error: this agent stopped before the peer was {'restarted and ' if restart_ps else ''}ready"
                )
            else:
                outcome[url] = (
                    f"error: not {'restarted and ' if restart_ps else ''}ready within {cfg.ready_timeout:g}s{detail}"
                )
        return outcome

    def tasks(self) -> dict[str, str]:
        """Task name -> base URL of every peer whose name is known."""
        return {task: url for url, task in self.names.items()}

    def post(self, url: str, body: Mapping[str, Any], timeout: float) -> Any:
        """POST to a peer agent with the agents' credentials; the answer's JSON, or OSError/ShardError-like
        ``RuntimeError`` for an HTTP error status (its message included)."""
        code, answer = http_json("POST", url, body=body, token=self._peer_token, timeout=timeout, tls=self._tls)
        if not 200 <= code < 300:
            message = answer.get("error", "") if isinstance(answer, dict) else ""
            raise RuntimeError(f"HTTP {code}: {message}")
        return answer

    def finish(self, reason: str) -> dict[str, str]:
        """The job is done: ``POST /finish`` to every peer agent (each stops its task and exits 0); the outcome per
        peer URL. A peer that does not answer is tried again once after a second; an HTTP error is final."""
        outcome: dict[str, str] = {}
        for url in self.peers:
            for attempt in (1, 2):
                try:
                    code, answer = http_json(
                        "POST",
                        f"{url}/finish",
                        body={"reason": reason},
                        token=self._peer_token,
                        timeout=self.config.request_timeout,
                        tls=self._tls,
                    )
                except OSError as e:
                    outcome[url] = f"error: {e}"
                    if attempt == 1:
                        time.sleep(1.0)  # not self._stop.wait: the agent may be stopping; this is its last word
                    continue
                if 200 <= code < 300:
                    outcome[url] = "finished"
                else:
                    message = answer.get("error", "") if isinstance(answer, dict) else ""
                    outcome[url] = f"error: POST /finish answered HTTP {code}: {message}"
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
            return self._restart_ps(
                reason,
                failed_at,
                workers=new_process and self.config.restart_workers,
                keep_survivors=not new_process and self.config.keep_survivors,
            )

    def _restart_ps(
        self, reason: str, failed_at: float | None, *, workers: bool, keep_survivors: bool
    ) -> dict[str, Any]:
        with self._lock:
            self.generation += 1
            generation = self.generation
        t0 = time.monotonic()
        log.info(
            "event=generation task=%s generation=%d reason=%r peers=%d", self.task, generation, reason, len(self.peers)
        )
        why = f"new trainer generation {generation}: {reason}"
        outcome = self.sync(
            restart_ps=True, why=why, failed_at=failed_at, workers=workers, keep_survivors=keep_survivors
        )
        seconds = time.monotonic() - t0
        failed = {u: o for u, o in outcome.items() if o.startswith("error")}
        (log.error if failed else log.info)(
            "event=generation_ready task=%s generation=%d seconds=%.2f outcome=%s",
            self.task,
            generation,
            seconds,
            json.dumps(outcome),
        )
        result = {"generation": generation, "reason": reason, "at": time.time(), "seconds": seconds, "peers": outcome}
        with self._lock:
            self.last = result
        return result
