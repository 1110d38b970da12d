"""``psguard agent``: the sidecar beside each task of a parameter-server job.

One agent per task process (the chief's trainer, each PS, optionally each worker)::

    psguard agent --role ps --index 0 --cluster cluster.json                  # built-in tf.distribute.Server
    psguard agent --role chief --index 0 --cluster cluster.json --store s3://b/job \\
        --peer http://ps0:8470 --peer http://ps1:8470 -- python train.py        # the user's trainer

It wires the parts built elsewhere; it adds no mechanism of its own beyond the generation rule below.

==================  ==========================================================================================
supervision         :class:`~psguard.agent.supervisor.Supervisor` runs the task in its own process group (same address
                    every restart, backoff, crash-loop limit), marks its whole process tree and records it under
                    ``state_dir``: a guard kills the tree if the agent is SIGKILLed, and the next agent kills what still
                    survives (:mod:`psguard.agent.reaper`). Exit 0 of the task: the agent drains and exits 0. Crash
                    loop: the agent exits 1 with the :class:`~psguard.errors.CrashLoopError` message. SIGTERM / SIGINT:
                    the task is stopped gracefully (SIGTERM, then SIGKILL after ``supervisor.stop_timeout``), the
                    persister drained, exit 0. In the built-in server mode a **warm standby**
                    (:mod:`psguard.agent.standby`: a second server process with TensorFlow imported, its port not yet
                    bound) is started ``supervisor.standby_delay`` (5 s) after each run and swapped in on a restart:
                    ~0.2 s instead of a Python + TensorFlow start (3-6 s here). Costs one idle process (~250 MB RSS) per
                    task; ``supervisor.standby: false`` turns it off. A user's command (after ``--``) never gets one: it
                    would not wait to bind.
health              ps / worker: :class:`~psguard.agent.prober.HealthMonitor` with process + TCP + ``GetStatus``
                    RPC probes (a SIGSTOPped server keeps its port; only the RPC deadline notices); an
                    unhealthy task is restarted. Chief: a process probe. The chief's agent also probes every
                    ``--peer`` agent's ``/readyz`` (reported in ``/status`` and ``/metrics`` only).
memory tier         chief only: :class:`~psguard.agent.memory_tier.MemoryTier` fed by a
                    :class:`~psguard.agent.spool_server.SpoolServer` (``--spool``, default
                    :func:`~psguard.handoff.spool.default_spool_dir` of the job) and written to the durable log by a
                    :class:`~psguard.agent.persister.Persister` (``--store``). At start
                    :func:`~psguard.agent.persister.resume` seeds the tier from the durable log, so an agent
                    restarted after a crash (even a SIGKILL in the middle of a persist: the manifest is the
                    commit) continues from the last commit.
HTTP                :class:`~psguard.agent.httpd.AgentHTTPServer` (127.0.0.1 by default; any other address needs
                    ``--token-file``): ``/healthz``, ``/readyz``, ``/metrics``, ``/status`` (JSON), ``POST
                    /restart`` (restart the task), ``POST /recovery`` (a restored trainer reports the step
                    it restored and, in process, the step it had reached; with the step a failed trainer gave
                    in ``POST /failure`` the agent counts ``psguard_lost_steps_total``) and, on the chief,
                    ``POST /new-generation`` (restart every PS now; see below).
==================  ==========================================================================================

The trainer (the chief's task) gets ``TF_CONFIG`` (the cluster from ``cluster.json``, task ``chief:0``),
``PSGUARD_SPOOL`` (the spool folder of :mod:`psguard.handoff.spool`) and ``PSGUARD_AGENT_URL`` (this agent's HTTP
base URL; ``PSGUARD_AGENT_TOKEN_FILE`` names the token file when there is one). Every task gets ``TF_CONFIG``
for its own role and index and ``PSGUARD_TASK`` (``ps:0``).

New trainer generation: the PS servers are restarted first
-----------------------------------------------------------
A PS that survives its chief keeps the old chief's eager context and its variables: measured here, a PS with a
2M x 16 table grew by about 75 MB per recovery even after the old variables were deleted, and never gave the
memory back (DESIGN.md: 1.2 GB -> 1.5 GB over two chief restarts). TensorFlow offers no way to drop a remote
context from outside, and the new generation restores every variable anyway, so a surviving PS has nothing
worth keeping. **Decision: on every new trainer generation the chief's agent restarts the PS servers.** A new
generation is any start of the trainer after the first: a crash, a hang caught by the probe, ``POST
/restart``, or exit :data:`~psguard.handoff.contract.EXIT_RESTART` (75), which the trainer uses after a PS failure
when it cannot rejoin in-process. The first start counts too when the agent resumed state (the durable log
was not empty, so an earlier chief may have left contexts behind). Before the trainer is started again, the
chief's agent asks every ``--peer`` whose ``/status`` says ``role: ps`` to ``POST /restart`` its task, in
parallel, and waits (``peers.ready_timeout``) until each reports a restart count above the one it had and a
healthy task; then the supervisor starts the trainer. This runs inside the supervisor's exit callback, on its
thread, so no trainer can start while PS servers are being replaced. A peer that does not come back in time is
logged and reported in ``/status``; the trainer is started anyway (it fails on the missing PS and exits again,
which counts towards the crash-loop limit). Workers are not restarted: they hold no variables and rejoin
through TensorFlow's own retry.

A trainer that rejoins in-process (:func:`psguard.trainer.recovery.run_with_recovery` with a model factory) starts a
new generation without exiting: it passes :func:`restart_ps_servers` as ``restart_ps``, which calls ``POST
/new-generation`` on its agent and returns once every PS serves again (before its ``update_server_def``).
One PS start is saved when the trainer says when it saw the failure (``restart_ps_servers(failed_at=...)``, or
:func:`report_failure` before exiting 75): a PS whose current run started after that moment (the one that died,
already restarted by its own agent) cannot hold a context of the failed generation and is only waited for.

Cost and evidence: one PS start per recovery, before the trainer starts again: about 0.2-0.5 s with the
warm standby (a cold start: 3-5 s on an idle machine here, 20-35 s with the machine overloaded).
Measured by ``test_ps_memory_stays_flat_over_five_trainer_generations`` (a real TF chief puts a 32 MB
table on one PS per generation): with this rule the PS stayed at 725-742 MB RSS over five generations;
without it (``peers.restart_ps: false``) it grew from 725 to 968 MB.
Before the first start the chief's agent waits (same timeout) until every peer is ready.

The agent never imports TensorFlow (``python -X importtime -m psguard.cli agent --help``): its RSS stays
around 60-90 MB plus the memory tier on the chief. ``import grpc`` happens only for the RPC probe.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psguard.agent.httpd import AgentHTTPServer, Request, RequestError, Response, is_loopback
from psguard.agent.metrics import AgentMetrics
from psguard.agent.prober import (
    GrpcStatusProbe,
    Health,
    HealthMonitor,
    HealthReport,
    HttpProbe,
    MonitorConfig,
    Probe,
    ProcessProbe,
    TcpProbe,
)
from psguard.agent.supervisor import EventKind, Supervisor, SupervisorConfig, SupervisorEvent
from psguard.config import Duration, load_yaml
from psguard.errors import ConfigError
from psguard.handoff.client import http_json, read_token
from psguard.handoff.contract import ENV_AGENT_TOKEN_FILE, ENV_AGENT_URL, ENV_SPOOL, ENV_TASK, EXIT_RESTART

if TYPE_CHECKING:  # the chief's parts import numpy and storage clients: only the chief's agent loads them
    from psguard.agent.memory_tier import MemoryTier
    from psguard.agent.persister import Persister, PersistEvent
    from psguard.agent.spool_server import SpoolEvent, SpoolServer
    from psguard.store.log import Store

__all__ = [
    "ROLES",
    "Agent",
    "AgentConfig",
    "HttpConfig",
    "PeersConfig",
    "PersistConfig",
    "load_cluster",
    "main",
    "register",
    "validate_cluster",
]

log = logging.getLogger(__name__)

ROLES = ("chief", "ps", "worker")
"""Roles an agent runs; ``cluster.json`` may also list ``evaluator`` tasks (TensorFlow knows them)."""
_CLUSTER_KEYS = (*ROLES, "evaluator")
_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)$")
_QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}


# ------------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class HttpConfig:
    """``http:``: where the agent serves. CLI flags override these."""

    bind: str = "127.0.0.1"
    port: int = 0
    token_file: str | None = None


@dataclass(frozen=True)
class PersistConfig:
    """``persister:``: the durable log writer (chief only)."""

    max_chain: int | None = 16
    max_delta_percent: float | None = 100.0
    retry_after: Duration | None = 5.0
    drain_timeout: Duration = 120.0  # at a stop: the longest wait for the last save


@dataclass(frozen=True)
class PeersConfig:
    """``peers:``: the chief's agent watches the other agents and restarts the PS servers per generation."""

    restart_ps: bool = True  # on every new trainer generation (see the module docstring)
    ready_timeout: Duration = 180.0  # for all PS agents to report a restarted, healthy server
    request_timeout: Duration = 10.0
    probe: MonitorConfig = field(default_factory=lambda: MonitorConfig(interval=2.0, deadline=2.0))


@dataclass(frozen=True)
class AgentConfig:
    """The agent's YAML file (``--config``); every key is optional, unknown keys are rejected."""

    job: str = "default"  # names the default spool folder
    store: str | None = None
    storage_options: Mapping[str, str] = field(default_factory=dict)
    spool: str | None = None
    task_log: str | None = None  # append the task's output here (default: the agent's own stdout/stderr)
    # Where the agent records its task's process tree, so that its successor kills what survives a SIGKILL of
    # this agent (default: /dev/shm/psguard-<job>-agents, a tmpfs cleared at boot like the processes).
    state_dir: str | None = None
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    probe: MonitorConfig = field(default_factory=MonitorConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)
    persister: PersistConfig = field(default_factory=PersistConfig)
    http: HttpConfig = field(default_factory=HttpConfig)


# ------------------------------------------------------------------------------------------------ cluster
def _check_address(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a 'host:port' string, got {value!r}")
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not _HOST_RE.match(host):
        raise ConfigError(f"{key}: expected 'host:port' (e.g. '10.0.0.5:2222'), got {value!r}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ConfigError(f"{key}: the port must be a number from 1 to 65535, got {value!r}")
    return value


def validate_cluster(data: object, *, source: str = "cluster.json") -> dict[str, list[str]]:
    """Check a cluster spec (``{"chief": ["host:port"], "ps": [...], "worker": [...]}``); return a clean copy.

    :class:`ConfigError` names the file and the key: unknown roles, lists that are not lists of ``host:port``
    strings, more than one chief, the same address twice.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a JSON object mapping roles to address lists, got {type(data).__name__}")
    out: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for role, addresses in data.items():
        if role not in _CLUSTER_KEYS:
            raise ConfigError(f"{source}: {role!r}: unknown role (known roles: {', '.join(_CLUSTER_KEYS)})")
        if not isinstance(addresses, list) or not addresses:
            raise ConfigError(f"{source}: {role}: expected a non-empty list of 'host:port' strings, got {addresses!r}")
        if role == "chief" and len(addresses) != 1:
            raise ConfigError(f"{source}: chief: a job has exactly one chief, got {len(addresses)} addresses")
        for i, address in enumerate(addresses):
            key = f"{role}[{i}]"
            _check_address(address, f"{source}: {key}")
            if address in seen:
                raise ConfigError(f"{source}: {key}: address {address} is already used by {seen[address]}")
            seen[address] = key
        out[role] = list(addresses)
    if not out:
        raise ConfigError(f"{source}: the cluster lists no tasks")
    return out


def load_cluster(path: str | os.PathLike[str], role: str, index: int) -> dict[str, list[str]]:
    """Read and validate ``cluster.json``, and check that it has task ``role:index``."""
    source = os.fspath(path)
    try:
        data = json.loads(Path(source).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file (--cluster)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{source}: cannot read: {e}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON: {e}") from None
    cluster = validate_cluster(data, source=source)
    if role not in ROLES:
        raise ConfigError(f"--role: expected one of {', '.join(ROLES)}, got {role!r}")
    if role not in cluster:
        raise ConfigError(f"{source}: {role}: no such role in the cluster, but the agent runs {role}:{index}")
    if not 0 <= index < len(cluster[role]):
        raise ConfigError(
            f"{source}: {role}: --index {index} is out of range (the cluster has {len(cluster[role])} {role} tasks)"
        )
    return cluster


# ------------------------------------------------------------------------------------------------ helpers
def _rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ------------------------------------------------------------------------------------------------ agent
class Agent:
    """One sidecar: supervise ``role:index``'s task, probe it, serve HTTP; on the chief, the memory tier too.

    :meth:`start`, then :meth:`wait` (returns the exit code for the CLI, or raises ``CrashLoopError``), then
    :meth:`stop` (idempotent, from ``finally``). :meth:`request_stop` is safe from a signal handler.
    """

    def __init__(
        self,
        role: str,
        index: int,
        cluster: Mapping[str, Sequence[str]],
        *,
        command: Sequence[str] = (),
        config: AgentConfig | None = None,
        peers: Sequence[str] = (),
        token: str | None = None,
        token_file: str | None = None,
        peer_token: str | None = None,
    ) -> None:
        self.config = config or AgentConfig()
        self.role = role
        self.index = index
        self.cluster = {k: list(v) for k, v in cluster.items()}
        self.task = f"{role}:{index}"
        if role not in ROLES or not 0 <= index < len(self.cluster.get(role, ())):
            raise ConfigError(f"task {self.task} is not in the cluster (roles: {', '.join(self.cluster)})")
        self.address = self.cluster[role][index]
        if role == "chief" and not command:
            raise ConfigError(
                "the chief role runs the user's trainer: give its command after '--' "
                "(psguard agent --role chief ... -- python train.py)"
            )
        if role != "chief" and peers:
            raise ConfigError("--peer: only the chief's agent probes and restarts other agents")
        self.command = list(command) if command else self._server_command()
        self._builtin_server = not command  # it honours psguard.agent.standby, so a warm standby can replace it
        self.peers = [p.rstrip("/") for p in peers]
        for p in self.peers:
            parts = urllib.parse.urlsplit(p)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"--peer: expected an agent's base URL like http://10.0.0.5:8470, got {p!r}")
        self._token = token
        self._token_file = str(Path(token_file).resolve()) if token_file is not None else None
        self._peer_token = peer_token if peer_token is not None else token
        self.metrics = AgentMetrics.create()
        self._stop_requested = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._started_at = time.time()
        self._failure_at: float | None = None  # monotonic: when the current outage began
        self._generation = 0
        self._generation_log: dict[str, Any] | None = None
        self._generation_lock = threading.Lock()
        self._reported_failure: float | None = None  # POST /failure: when the trainer saw it (Unix time)
        self._reported_step: int | None = None  # ... and the last step it trained
        self._last_lost_steps: int | None = None
        self._resumed_step: int | None = None
        self._resume_seconds: float | None = None
        self._durable_id: str | None = None
        self._durable_step: int | None = None
        # parts, made in start()
        self.http: AgentHTTPServer | None = None
        self.supervisor: Supervisor | None = None
        self.monitor: HealthMonitor | None = None
        self.peer_monitors: list[HealthMonitor] = []
        self.store: Store | None = None
        self.tier: MemoryTier | None = None
        self.persister: Persister | None = None
        self.spool: SpoolServer | None = None
        self.spool_dir: Path | None = None

    # ------------------------------------------------------------------------------------------ commands
    def _server_command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "psguard.agent.tf_server",
            "--cluster-spec",
            json.dumps(self.cluster, sort_keys=True),
            "--job",
            self.role,
            "--index",
            str(self.index),
            "--parent-pid",
            str(os.getpid()),
        ]

    def _task_env(self, url: str) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in _QUIET.items():
            env.setdefault(key, value)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": self.cluster, "task": {"type": self.role, "index": self.index}, "rpc_layer": "grpc"}
        )
        env[ENV_TASK] = self.task
        env[ENV_AGENT_URL] = url
        if self._token_file is not None:
            env[ENV_AGENT_TOKEN_FILE] = self._token_file  # the path, never the token itself
        if self.spool_dir is not None:
            env[ENV_SPOOL] = str(self.spool_dir)
        return env

    def _task_record(self) -> Path:
        """The file in which the supervisor records the task's process tree (one per task on a host)."""
        # lazy: as in _start_memory_tier, the spool module (and numpy) only when the agent starts
        from psguard.handoff.spool import default_spool_dir

        cfg = self.config
        folder = (
            Path(cfg.state_dir) if cfg.state_dir else default_spool_dir(cfg.job).with_name(f"psguard-{cfg.job}-agents")
        )
        return folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', self.task)}.task.json"

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> Agent:
        """Start every part; the task last (after the PS peers when this chief resumes a job)."""
        try:
            if self.role == "chief":
                self._start_memory_tier()
            self._start_http()
            assert self.http is not None
            cfg = self.config
            self.supervisor = Supervisor.from_config(
                self.command,
                cfg.supervisor,
                standby_capable=self._builtin_server,
                env=self._task_env(self.http.url),
                name=self.task,
                on_event=self._on_supervisor_event,
                log_path=cfg.task_log,
                record=self._task_record(),
                subreaper=True,
            )
            self.monitor = HealthMonitor.from_config(
                self.task,
                self._task_probes(),
                cfg.probe,
                on_unhealthy=self._on_unhealthy,
                on_result=self.metrics.on_probe_result,
                on_health=self._on_health,
            )
            for url in self.peers:
                probe = HttpProbe(f"{url}/readyz", name="readyz")
                monitor = HealthMonitor.from_config(
                    f"peer {urllib.parse.urlsplit(url).netloc}",
                    [probe],
                    cfg.peers.probe,
                    on_result=self.metrics.on_probe_result,
                    on_health=self.metrics.on_health,
                )
                self.peer_monitors.append(monitor.start())
            if self.role == "chief" and self._resumed_step is not None and cfg.peers.restart_ps:
                # An earlier chief ran this job: the PS servers may hold its context. Start from clean ones.
                self._new_generation(f"the agent resumed a job (durable step {self._resumed_step})")
            elif self.peers:
                outcome = self._sync_peers(restart_ps=False)
                (log.info if all(o == "ready" for o in outcome.values()) else log.error)(
                    "event=peers_checked task=%s outcome=%s", self.task, json.dumps(outcome)
                )
            if self._stop_requested.is_set():
                return self
            self.supervisor.start()
            self.monitor.start()
            log.info("event=agent_started task=%s address=%s http=%s", self.task, self.address, self.http.url)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_http(self) -> None:
        cfg = self.config.http
        self.http = AgentHTTPServer(
            host=cfg.bind,
            port=cfg.port,
            token=self._token,
            registry=self.metrics.registry,
            status=self.status,
            readiness=self.readiness,
        )
        self.http.add_post("/restart", self._handle_restart)
        self.http.add_post("/recovery", self._handle_recovery)
        if self.role == "chief":
            self.http.add_post("/new-generation", self._handle_new_generation)
            self.http.add_post("/failure", self._handle_failure)
        self.http.start()

    def _start_memory_tier(self) -> None:
        from psguard.agent.memory_tier import MemoryTier
        from psguard.agent.persister import Persister, resume
        from psguard.agent.spool_server import SpoolServer
        from psguard.handoff.spool import default_spool_dir
        from psguard.store.log import Store

        cfg = self.config
        tier = self.tier = MemoryTier()
        persister: Persister | None = None
        if cfg.store is not None:
            store = self.store = Store.open(cfg.store, dict(cfg.storage_options))
            t0 = time.perf_counter()
            last = resume(store, tier)
            self._resume_seconds = time.perf_counter() - t0
            if last is not None:
                self._resumed_step = last.step
                self._durable_id, self._durable_step = last.id, last.step
                self.metrics.record_checkpoint("durable", last.step, last.committed_at)
                self.metrics.record_checkpoint("memory", last.step, last.committed_at)
                log.info(
                    "event=resumed task=%s checkpoint=%s step=%d seconds=%.3f",
                    self.task,
                    last.id,
                    last.step,
                    self._resume_seconds,
                )
            p = cfg.persister
            persister = self.persister = Persister(
                store,
                tier,
                last=last,
                max_chain=p.max_chain,
                max_delta_percent=p.max_delta_percent,
                retry_after=p.retry_after,
                on_event=self._on_persist_event,
            ).start()
            self.metrics.persist_lag_steps.set_function(self._lag_steps)
            self.metrics.persist_queue_depth.set_function(lambda: float(persister.status().pending_requests))
        self.spool_dir = Path(cfg.spool) if cfg.spool else default_spool_dir(cfg.job)
        self.spool = SpoolServer(self.spool_dir, tier, persister, on_event=self._on_spool_event).start()
        log.info("event=spool_serving task=%s spool=%s store=%s", self.task, self.spool_dir, cfg.store or "-")

    def _task_probes(self) -> list[Probe]:
        assert self.supervisor is not None
        sup = self.supervisor
        probes: list[Probe] = [ProcessProbe(lambda: sup.pid)]
        if self.role != "chief":
            host, _, port = self.address.rpartition(":")
            host = host.strip("[]")
            if host in ("0.0.0.0", "::", ""):
                host = "127.0.0.1"
            probes.append(TcpProbe(host, int(port)))
            probes.append(GrpcStatusProbe(self.address))
        return probes

    def request_stop(self, *_: object) -> None:
        """Ask for a graceful stop (signal-handler safe: only sets events)."""
        self._stop_requested.set()
        self._wake.set()

    def wait(self) -> int:
        """Block until the task completes (0), a stop is requested (0), or supervision fails (raises)."""
        assert self.supervisor is not None
        while not self._stop_requested.is_set() and not self.supervisor.done():
            self._wake.wait(1.0)  # woken by events; the timeout is only a safety net
            self._wake.clear()
        if self.supervisor.done():
            code = self.supervisor.result()  # raises CrashLoopError
            log.info("event=task_done task=%s exit_code=%s", self.task, code)
        return 0

    def stop(self) -> None:
        """Stop the task gracefully, drain the persister, release everything. Idempotent."""
        self._stop_requested.set()
        self._wake.set()
        errors: list[BaseException] = []

        def attempt(fn: Any, *args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, **kwargs)
            except Exception as e:
                log.exception("event=stop_step_failed task=%s step=%s", self.task, getattr(fn, "__qualname__", fn))
                errors.append(e)

        if self.monitor is not None:
            attempt(self.monitor.stop)
        for monitor in self.peer_monitors:
            attempt(monitor.stop)
        if self.supervisor is not None:
            attempt(self.supervisor.stop)
        if self.spool is not None:
            if self.spool.status().running:
                attempt(self.spool.process_once)  # the trainer's last captures, handed off before it stopped
            attempt(self.spool.stop)
        if self.persister is not None:
            timeout = self.config.persister.drain_timeout
            drained = True
            try:
                drained = self.persister.stop(drain=True, timeout=timeout)
            except Exception as e:
                log.exception("event=stop_step_failed task=%s step=persister", self.task)
                errors.append(e)
            if not drained:
                log.error("event=persist_not_drained task=%s timeout=%.0fs", self.task, timeout)
        if self.tier is not None:
            with self._lock:
                durable = self._durable_step
            log.info(
                "event=agent_stopped task=%s memory_step=%s durable_step=%s",
                self.task,
                self.tier.step,
                durable,
            )
        if self.store is not None:
            attempt(self.store.close)
        if self.http is not None:
            attempt(self.http.stop)
        self.monitor = self.supervisor = self.spool = self.persister = self.store = self.http = None
        self.peer_monitors = []

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ callbacks
    def _on_supervisor_event(self, event: SupervisorEvent) -> None:
        self.metrics.on_supervisor_event(event)
        if event.kind in (EventKind.STARTED, EventKind.RESTARTED):
            if self.monitor is not None:
                self.monitor.reset()
        elif event.kind is EventKind.EXITED:
            # No process until the next start (backoff, PS restarts): the monitor must not count that gap as
            # a hang and cut the backoff short or kill the next run; STARTING ignores failures until it answers.
            if self.monitor is not None:
                self.monitor.reset()
            restart_follows = event.backoff_seconds is not None
            if restart_follows:
                with self._lock:
                    if self._failure_at is None:
                        self._failure_at = time.monotonic()
            if restart_follows and self.role == "chief" and self.config.peers.restart_ps:
                # Runs on the supervisor's thread: the trainer is not started again until this returns.
                with self._lock:
                    failed_at, self._reported_failure = self._reported_failure, None
                run_start = event.time - (event.run_seconds or 0.0)
                if event.exit_code != EXIT_RESTART or failed_at is None or failed_at < run_start:
                    failed_at = None  # only a report from the run that just asked for a restart counts
                self._new_generation(f"the trainer {event.reason}", failed_at)
        elif event.kind in (EventKind.COMPLETED, EventKind.GAVE_UP, EventKind.STOPPED):
            self._wake.set()

    def _on_unhealthy(self, report: HealthReport) -> None:
        sup, monitor = self.supervisor, self.monitor
        if sup is None or sup.pid is None:
            return  # between runs: the supervisor is already on it (backoff, or PS restarts for a generation)
        if monitor is not None and monitor.health is Health.STARTING:
            return  # the task was (re)started after this verdict was reached: it is about an earlier run
        with self._lock:
            if self._failure_at is None:
                self._failure_at = time.monotonic()
        sup.restart(f"unhealthy: {report.reason}")

    def _on_health(self, task: str, health: Health) -> None:
        self.metrics.on_health(task, health)
        if health is Health.HEALTHY and self.role != "chief":
            if self.supervisor is not None:
                self.supervisor.mark_healthy()  # it serves: its end will not count towards a crash loop
            self._recovered()

    def _recovered(self) -> None:
        with self._lock:
            began, self._failure_at = self._failure_at, None
        if began is not None:
            seconds = time.monotonic() - began
            self.metrics.recovery_seconds.set(seconds)
            self.metrics.recoveries.inc()
            log.info("event=recovered task=%s seconds=%.2f", self.task, seconds)

    def _on_spool_event(self, event: SpoolEvent) -> None:
        if event.kind == "capture" and event.stall_seconds is not None:
            self.metrics.checkpoint_stall.observe(event.stall_seconds)
        if event.kind == "capture" and event.status == "ok" and event.step is not None:
            self.metrics.record_checkpoint("memory", event.step, time.time())
            if self.supervisor is not None:
                self.supervisor.mark_healthy()  # the trainer trains: a later death is no crash loop
            if self.role == "chief":
                self._recovered()  # the new generation's first capture: training runs again

    def _on_persist_event(self, event: PersistEvent) -> None:
        if event.kind == "committed" and event.step is not None:
            self.metrics.bytes_persisted.inc(event.bytes_written)
            self.metrics.record_checkpoint("durable", event.step, time.time())
            with self._lock:
                self._durable_id, self._durable_step = event.checkpoint, event.step

    def _lag_steps(self) -> float:
        lag = self.persister.status().lag_steps if self.persister is not None else None
        return float(lag) if lag is not None else 0.0

    # ------------------------------------------------------------------------------------------ generations
    def _sync_peers(self, *, restart_ps: bool, why: str = "", failed_at: float | None = None) -> dict[str, str]:
        """Bring the peers to a known state before the trainer starts; the outcome per peer URL.

        ``restart_ps``: every peer whose ``/status`` says ``role: ps`` restarts its task (``POST /restart``) and
        is waited for until its restart count went up and it is ready; other peers are skipped. Otherwise every
        peer is only waited for until ready. Peers that do not answer yet (their agent is still starting) are
        retried until ``peers.ready_timeout``; an HTTP error (a wrong token) ends the wait for that peer.
        ``failed_at`` (Unix time, this host's clock): when the trainer saw the failure. A PS whose current run
        started after it is left alone (only waited for): no chief has connected to it since, so it holds no
        old context; typically the PS that died, already restarted by its own agent. Its start is judged by its
        uptime, so the PS host's clock does not matter.
        """
        cfg = self.config.peers
        deadline = time.monotonic() + cfg.ready_timeout
        outcome: dict[str, str] = {}
        pending: dict[str, int | None] = dict.fromkeys(self.peers)  # None: not asked yet; int: restarts before
        fresh: set[str] = set()
        last_error: dict[str, str] = {}
        while pending and not self._stop_requested.is_set() and time.monotonic() < deadline:
            for url, before in list(pending.items()):
                asked_at = time.time()  # the answer's uptime is measured later: the PS started after asked - uptime
                try:
                    code, doc = http_json("GET", f"{url}/status", token=self._peer_token, timeout=cfg.request_timeout)
                except OSError as e:
                    last_error[url] = str(e)
                    continue  # not serving yet: retried until the deadline
                if code != 200 or not isinstance(doc, dict):
                    outcome[url] = f"error: GET /status answered HTTP {code}"
                    del pending[url]
                    continue
                restarts, ready = int(doc.get("restarts") or 0), doc.get("ready") is True
                uptime = (doc.get("supervisor") or {}).get("uptime_seconds")
                if (
                    before is None
                    and restart_ps
                    and failed_at is not None
                    and doc.get("role") == "ps"
                    and isinstance(uptime, int | float)
                    and asked_at - uptime > failed_at  # a lower bound of its start: no margin needed
                ):
                    fresh.add(url)  # started after the failure: wait for it, do not restart it again
                    pending[url] = restarts
                    before = restarts
                if url in fresh:
                    if ready:
                        outcome[url] = "fresh (started after the failure)"
                        del pending[url]
                elif before is None and restart_ps and doc.get("role") == "ps":
                    try:
                        code, answer = http_json(
                            "POST",
                            f"{url}/restart",
                            body={"reason": why},
                            token=self._peer_token,
                            timeout=cfg.request_timeout,
                        )
                    except OSError as e:
                        last_error[url] = str(e)
                        continue
                    if not 200 <= code < 300:
                        message = answer.get("error", "") if isinstance(answer, dict) else ""
                        outcome[url] = f"error: POST /restart answered HTTP {code}: {message}"
                        del pending[url]
                        continue
                    pending[url] = restarts
                elif before is None and restart_ps:
                    outcome[url] = f"skipped ({doc.get('role')})"
                    del pending[url]
                elif ready and (before is None or restarts > before):
                    outcome[url] = "restarted" if before is not None else "ready"
                    del pending[url]
            if pending:
                self._stop_requested.wait(0.1)  # polling the peers' state, bounded by the deadline
        for url in pending:
            detail = f" (last error: {last_error[url]})" if url in last_error else ""
            outcome[url] = (
                f"error: not {'restarted and ' if restart_ps else ''}ready within {cfg.ready_timeout:g}s{detail}"
            )
        return outcome

    def _new_generation(self, reason: str, failed_at: float | None = None) -> dict[str, Any]:
        """Restart every PS peer and wait until all serve again (see the module docstring); the outcome.

        One at a time: the supervisor's exit callback and ``POST /new-generation`` may both ask.
        """
        with self._generation_lock:
            return self._restart_ps_peers(reason, failed_at)

    def _restart_ps_peers(self, reason: str, failed_at: float | None) -> dict[str, Any]:
        with self._lock:
            self._generation += 1
            generation = self._generation
        t0 = time.monotonic()
        log.info(
            "event=generation task=%s generation=%d reason=%r peers=%d", self.task, generation, reason, len(self.peers)
        )
        why = f"new trainer generation {generation}: {reason}"
        outcome = self._sync_peers(restart_ps=True, why=why, failed_at=failed_at)
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
            self._generation_log = result
        return result

    # ------------------------------------------------------------------------------------------ HTTP
    def _handle_restart(self, request: Request) -> Response:
        body = request.json()
        if body is not None and not isinstance(body, dict):
            raise RequestError(400, 'the body must be a JSON object, e.g. {"reason": "..."}')
        reason = str((body or {}).get("reason") or "POST /restart")[:300]
        sup = self.supervisor
        if sup is None:
            raise RequestError(503, "the task is not supervised yet")
        before = sup.status().restarts
        if not sup.restart(f"requested over HTTP: {reason}", crash=False):
            raise RequestError(409, f"task {self.task} is not running under supervision ({sup.status().state.value})")
        log.info("event=restart_requested task=%s reason=%r", self.task, reason)
        return Response(202, {"ok": True, "task": self.task, "restarts_before": before})

    def _handle_new_generation(self, request: Request) -> Response:
        """The trainer rejoins in-process after a PS failure: restart every PS peer first, answer when done."""
        body = request.json()
        if body is not None and not isinstance(body, dict):
            raise RequestError(400, 'the body must be a JSON object, e.g. {"reason": "..."}')
        reason = "in-process rejoin: " + str((body or {}).get("reason") or "POST /new-generation")[:300]
        failed_at = (body or {}).get("failed_at")
        if failed_at is not None and (not isinstance(failed_at, int | float) or failed_at > time.time() + 5):
            raise RequestError(400, "failed_at: expected the Unix time at which the trainer saw the failure")
        result = self._new_generation(reason, None if failed_at is None else float(failed_at))
        failed = any(str(o).startswith("error") for o in result["peers"].values())
        return Response(503 if failed else 200, {"ok": not failed, **result})

    def _handle_failure(self, request: Request) -> Response:
        """The trainer saw a cluster failure and is about to exit 75: when, so that the next generation leaves
        alone a PS that was started since (see :func:`report_failure`)."""
        body = request.json()
        failed_at = body.get("failed_at") if isinstance(body, dict) else None
        if not isinstance(failed_at, int | float) or failed_at > time.time() + 5:
            raise RequestError(400, 'expected {"failed_at": <Unix time at which the trainer saw the failure>}')
        step = body.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise RequestError(400, '"step": expected the last step trained, an integer >= 0')
        with self._lock:
            self._reported_failure = float(failed_at)
            if step is not None:
                self._reported_step = step
        log.info("event=failure_reported task=%s age=%.2fs", self.task, time.time() - failed_at)
        return Response(200, {"ok": True})

    def _handle_recovery(self, request: Request) -> Response:
        """A trainer restored: count the steps lost, from its own figure or from the steps it reports."""
        body = request.json()
        if not isinstance(body, dict):
            raise RequestError(400, 'expected a JSON object: {"lost_steps": N} or {"restored_step": N}')

        def count(key: str) -> int | None:
            value = body.get(key)
            if value is None:
                return None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RequestError(400, f'"{key}": expected an integer >= 0, got {value!r}')
            return value

        lost, restored, seen = count("lost_steps"), count("restored_step"), count("seen_step")
        if lost is None and restored is None:
            raise RequestError(400, 'expected {"lost_steps": N} or {"restored_step": N, "seen_step": M}')
        if lost is None:
            with self._lock:
                reported, self._reported_step = self._reported_step, None
            seen = seen if seen is not None else reported
            if seen is None:  # a first start, or a trainer that died without a word: nothing to compare with
                return Response(200, {"ok": True, "lost_steps": None})
            assert restored is not None
            lost = max(0, seen - restored)
        self.metrics.lost_steps.inc(lost)
        with self._lock:
            self._last_lost_steps = lost
        log.info("event=recovery_reported task=%s lost_steps=%d restored_step=%s", self.task, lost, restored)
        seconds = body.get("seconds")
        if isinstance(seconds, int | float) and seconds >= 0:
            self.metrics.recovery_seconds.set(float(seconds))
        return Response(200, {"ok": True})

    def readiness(self) -> dict[str, bool]:
        sup, monitor = self.supervisor, self.monitor
        checks = {
            "task": sup is not None and sup.pid is not None,
            "healthy": monitor is not None and monitor.healthy,
        }
        if self.role == "chief":
            checks["spool"] = self.spool is not None and self.spool.status().running
            if self.config.store is not None:
                checks["persister"] = self.persister is not None and self.persister.status().running
        return checks

    def status(self) -> dict[str, Any]:
        sup, monitor = self.supervisor, self.monitor
        sup_status = sup.status().to_dict() if sup is not None else {}
        mon = monitor.status().to_dict() if monitor is not None else {}
        ready = self.readiness()
        doc: dict[str, Any] = {
            "role": self.role,
            "index": self.index,
            "task": self.task,
            "address": self.address,
            "agent_pid": os.getpid(),
            "agent_rss_bytes": _rss_bytes(),
            "started_at": self._started_at,
            "state": sup_status.get("state"),
            "pid": sup_status.get("pid"),
            "restarts": sup_status.get("restarts", 0),
            "supervisor": sup_status,
            "health": mon.get("health"),
            "probes": mon.get("probes", []),
            "ready": all(ready.values()),
            "checks": ready,
            "peers": [
                {"url": url, **m.status().to_dict()} for url, m in zip(self.peers, self.peer_monitors, strict=False)
            ],
        }
        with self._lock:
            doc["generation"] = self._generation
            doc["last_generation"] = self._generation_log
            doc["last_lost_steps"] = self._last_lost_steps
            durable_id, durable_step = self._durable_id, self._durable_step
        if self.role == "chief":
            tier = self.tier.status() if self.tier is not None else None
            persister = self.persister.status() if self.persister is not None else None
            spool = self.spool.status() if self.spool is not None else None
            doc.update(
                {
                    "spool": str(self.spool_dir) if self.spool_dir else None,
                    "store": self.config.store,
                    "resumed_step": self._resumed_step,
                    "resume_seconds": self._resume_seconds,
                    "memory_step": tier.step if tier else None,
                    "memory_token": tier.token if tier else None,
                    "memory_bytes": tier.nbytes if tier else None,
                    "durable_step": durable_step,
                    "durable_checkpoint": durable_id,
                    "persist_lag_steps": persister.lag_steps if persister else None,
                    "persister": (
                        {
                            "pending_requests": persister.pending_requests,
                            "in_flight": persister.in_flight,
                            "checkpoints_written": persister.checkpoints_written,
                            "bytes_persisted": persister.bytes_persisted,
                            "failures": persister.failures,
                            "last_error": persister.last_error,
                        }
                        if persister
                        else None
                    ),
                    "captures": dict(spool.captures) if spool else None,
                }
            )
        return doc


# ------------------------------------------------------------------------------------------------ CLI
def register(sub: Any) -> None:
    p = sub.add_parser(
        "agent",
        help="run the sidecar beside one task: supervise, probe, memory tier and durable log (chief), HTTP",
        description=(
            "Supervise one task of a parameter-server job (a PS or worker server, or the chief's trainer given "
            "after '--'), probe it, serve /healthz /readyz /metrics /status and POST /restart. The chief's agent "
            "also holds the memory tier, persists it to --store, and restarts the PS servers (--peer agents) "
            "before every new trainer generation."
        ),
    )
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--index", required=True, type=int)
    p.add_argument("--cluster", required=True, metavar="cluster.json", help='{"chief": ["host:port"], "ps": [...]}')
    p.add_argument("--store", metavar="URL", help="durable log (chief): a path, file://, s3://, hdfs://")
    p.add_argument("--spool", metavar="DIR", help="spool folder shared with the trainer (default /dev/shm/psguard-JOB)")
    p.add_argument("--http-port", type=int, help="HTTP port (default: config http.port, 0 = any free port)")
    p.add_argument("--bind", help="HTTP address (default 127.0.0.1; any other needs --token-file)")
    p.add_argument("--token-file", help="bearer token for HTTP, also sent to --peer agents")
    p.add_argument("--config", metavar="agent.yaml", help="agent settings (supervisor, probe, peers, persister, http)")
    p.add_argument("--peer", action="append", default=[], metavar="URL", help="another agent (chief only); repeatable")
    p.add_argument("--ready-file", help="write this agent's HTTP URL here once it serves (for scripts and tests)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD...: the task (required for the chief)")
    p.set_defaults(func=main)


def _merge(config: AgentConfig, args: argparse.Namespace) -> AgentConfig:
    http_cfg = config.http
    http_cfg = HttpConfig(
        bind=args.bind if args.bind is not None else http_cfg.bind,
        port=args.http_port if args.http_port is not None else http_cfg.port,
        token_file=args.token_file if args.token_file is not None else http_cfg.token_file,
    )
    return AgentConfig(
        job=config.job,
        store=args.store if args.store is not None else config.store,
        storage_options=config.storage_options,
        spool=args.spool if args.spool is not None else config.spool,
        task_log=config.task_log,
        state_dir=config.state_dir,
        supervisor=config.supervisor,
        probe=config.probe,
        peers=config.peers,
        persister=config.persister,
        http=http_cfg,
    )


def main(args: argparse.Namespace) -> int:
    """``psguard agent``: returns 0 when the task completed or the agent was stopped; raises on a crash loop."""
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    config = load_yaml(AgentConfig, args.config) if args.config else AgentConfig()
    config = _merge(config, args)
    cluster = load_cluster(args.cluster, args.role, args.index)
    if args.role != "chief" and (args.store or args.spool):
        raise ConfigError("--store and --spool belong to the chief's agent (it holds the memory tier and the log)")
    token = read_token(config.http.token_file)
    if token is None and not is_loopback(config.http.bind):
        raise ConfigError(
            f"--bind {config.http.bind}: serving on a non-loopback address needs --token-file "
            "(POST /restart kills the task)"
        )
    agent = Agent(
        args.role,
        args.index,
        cluster,
        command=command,
        config=config,
        peers=args.peer,
        token=token,
        token_file=config.http.token_file,
    )
    previous: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, agent.request_stop)
    try:
        agent.start()
        if args.ready_file and agent.http is not None:
            tmp = Path(f"{args.ready_file}.tmp")
            tmp.write_text(agent.http.url + "\n")
            tmp.rename(args.ready_file)
        return agent.wait()  # a crash loop raises CrashLoopError: psguard prints it and exits 1
    finally:
        agent.stop()
        for signum, handler in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


if __name__ == "__main__":  # pragma: no cover - use `psguard agent`
    from psguard.cli import main as _cli_main

    sys.exit(_cli_main(["agent", *sys.argv[1:]]))
