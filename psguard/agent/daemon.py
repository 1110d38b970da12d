"""``psguard agent``: the sidecar beside each task process of a parameter-server job (the chief's trainer, each
PS, optionally each worker; the command lines: README.md, "The sidecar").

It wires the parts built elsewhere and adds no mechanism of its own: :mod:`psguard.agent.process` keeps the task
alive, :mod:`psguard.agent.tiers` holds the checkpoint tiers, :mod:`psguard.agent.control` serves HTTP;
:mod:`psguard.agent.task` is what the task is given, and :class:`~psguard.agent.recovery.Recovery` gets every
callback of the supervisor, the monitors and the hang watch. Task exit 0: the agent exits 0; crash loop: exit 1;
SIGTERM / SIGINT: the task stopped gracefully, the persister drained, exit ``stop_exit_code``. The agent never
imports TensorFlow: a PS agent stays small and starts fast. The endpoints: docs/user-guide.md.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psguard.agent.chief_tiers import ChiefTiers
from psguard.agent.config import AgentConfig, check_task
from psguard.agent.control.auth import Authenticator, JwtAuth
from psguard.agent.control.httpd import AgentHTTPServer
from psguard.agent.control.metrics import AgentMetrics
from psguard.agent.control.peers import PeerSync
from psguard.agent.copies import PeerLink, serve_shards
from psguard.agent.process.hang import HangWatch
from psguard.agent.process.lifecycle import SupervisorState
from psguard.agent.process.prober import HealthMonitor, HttpProbe
from psguard.agent.process.reaper import stat_fields
from psguard.agent.process.standby import warm_trainer_command
from psguard.agent.process.supervisor import Supervisor
from psguard.agent.recovery import Recovery
from psguard.agent.routes import Routes
from psguard.agent.task import server_command, task_env, task_probes, task_record
from psguard.errors import ConfigError, PsguardError
from psguard.handoff.credentials import TokenFile, create_token_file
from psguard.handoff.tls import client_context, server_context
from psguard.storage.registry import redact

if TYPE_CHECKING:  # the chief's parts import numpy and storage clients: only the chief's agent loads them
    from psguard.agent.tiers.shards import ShardKeeper
    from psguard.store.opening import StoreOpening

log = logging.getLogger(__name__)

# How long a PS agent holds back its store's open (its imports) for a fetch of its shards from a peer's copy.
_STORE_HOLD_SECONDS = 5.0


# ------------------------------------------------------------------------------------------------ helpers
def _rss_bytes() -> int | None:
    fields = stat_fields("self")  # field 24, rss: pages
    return int(fields[21]) * os.sysconf("SC_PAGE_SIZE") if fields is not None and len(fields) > 21 else None


def _check_task(
    config: AgentConfig,
    cluster: dict[str, list[str]],
    role: str,
    index: int,
    command: Sequence[str],
    peers: Sequence[str],
) -> None:
    """Refuse a task the cluster does not have, and options its role does not take."""
    check_task(cluster, role, index, "the cluster", role_key="role", index_key="index")
    if role == "chief" and not command:
        raise ConfigError(
            "the chief role runs the user's trainer: give its command after '--' "
            "(psguard agent --role chief ... -- python train.py)"
        )
    if role != "chief" and peers:
        raise ConfigError("--peer: only the chief's agent probes and restarts other agents")
    if not 0 <= config.stop_exit_code <= 255:
        raise ConfigError(f"stop_exit_code: an exit status from 0 to 255, got {config.stop_exit_code}")


def _peer_urls(peers: Sequence[str]) -> list[str]:
    """The ``--peer`` agents' base URLs, checked."""
    urls = [p.rstrip("/") for p in peers]
    for p in urls:
        parts = urllib.parse.urlsplit(p)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--peer: expected an agent's base URL like http://10.0.0.5:8470, got {p!r}")
    return urls


def _client_tls(config: AgentConfig) -> ssl.SSLContext | None:
    """Agent-to-agent calls: verify peers against --tls-ca (else the system store), present our certificate."""
    http_cfg = config.http
    if (http_cfg.tls_cert is None) != (http_cfg.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if http_cfg.tls_ca is not None and http_cfg.tls_cert is None:
        raise ConfigError("--tls-ca (mutual TLS) needs the agent's own --tls-cert and --tls-key")
    return client_context(http_cfg.tls_ca, http_cfg.tls_cert, http_cfg.tls_key) if http_cfg.tls_cert else None


# ------------------------------------------------------------------------------------------------ agent
class Agent:
    """One sidecar: supervise ``role:index``'s task, probe it, serve HTTP; on the chief, the memory tier too.

    :meth:`start`, then :meth:`wait` (returns the exit code for the CLI, or raises ``CrashLoopError``), then
    :meth:`stop` (idempotent, from ``finally``). :meth:`request_stop` is safe from a signal handler."""

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
    ) -> None:
        self.config = config or AgentConfig()
        self.role = role
        self.index = index
        self.cluster = {k: list(v) for k, v in cluster.items()}
        self.task = f"{role}:{index}"
        _check_task(self.config, self.cluster, role, index, command, peers)
        self.address = self.cluster[role][index]
        self.node = (
            self.config.node or os.environ.get("PSGUARD_NODE") or os.environ.get("NODE_NAME") or socket.gethostname()
        )
        self.command = list(command) if command else server_command(self.cluster, role, index)
        self._builtin_server = not command  # it honours psguard.agent.process.standby, so a warm standby can replace it
        self.peers = _peer_urls(peers)
        self._token = token
        self._token_file = str(Path(token_file).resolve()) if token_file is not None else None
        if self.peers and token is None:
            raise ConfigError(
                "--peer: the chief's agent calls its peers' /status and POST /restart with the token they share, "
                "and it has none. Give every agent of the job the same --token-file (a 0600 file holding a random "
                "token; on Kubernetes a Secret volume with defaultMode: 0400); psguard wrap makes one per run"
            )
        self._made_token: TokenFile | None = None  # made in start() when no token was given
        self._client_tls = _client_tls(self.config)
        self.metrics = AgentMetrics()
        self._stop_requested = threading.Event()
        self.peer_sync = PeerSync(
            self.task, self.peers, self.config.peers, token, self._stop_requested, tls=self._client_tls
        )
        self.peer_sync.on_fresh = self._fresh_ps
        self._wake = threading.Event()
        self.recovery = Recovery(
            self.task,
            role,
            restart_ps=self.config.peers.restart_ps,
            metrics=self.metrics,
            peer_sync=self.peer_sync,
            supervisor=lambda: self.supervisor,
            monitor=lambda: self.monitor,
            export_ahead=lambda: self.chief.export_ahead() if self.chief is not None else None,
            on_done=self._wake.set,
        )
        self._lock = threading.Lock()
        self._started_at = time.time()
        self._store_error: PsguardError | None = None
        self._finished: str | None = None  # POST /finish: the chief's agent said the job is done (its reason)
        # The chief's agent: its memory tier, persister and spool (made in start(), reported from now on).
        self.chief = (
            ChiefTiers(
                self.task,
                self.config,
                peers=bool(self.peers),
                peer_sync=self.peer_sync,
                metrics=self.metrics,
                recovery=self.recovery,
                stop_requested=self._stop_requested,
            )
            if role == "chief"
            else None
        )
        self._no_parts_yet()

    def _no_parts_yet(self) -> None:
        """The parts, made in :meth:`start` (the task's, the chief's tiers, a PS's shards), not made yet."""
        self.http: AgentHTTPServer | None = None
        self.supervisor: Supervisor | None = None
        self.monitor: HealthMonitor | None = None
        self.peer_monitors: list[HealthMonitor] = []
        self.store: StoreOpening | None = None  # a PS's agent: its store, opened after its start
        self.hang_watch: HangWatch | None = None
        self.shards: ShardKeeper | None = None  # a PS's agent: the memory tier of its PS's shards

    def _task_env(self, url: str) -> dict[str, str]:
        spool = self.chief.spool_dir if self.chief is not None else None
        return task_env(
            self.cluster,
            self.role,
            self.index,
            url=url,
            token_file=self._token_file,
            config=self.config,
            spool_dir=spool,
        )

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self, on_serving: Callable[[str], None] | None = None) -> Agent:
        """Start every part; the task last (after the PS peers when this chief resumes a job), except a PS's: a
        PS agent starts its PS as soon as its HTTP address is bound and makes its tier meanwhile (both are on a
        replaced node's recovery path). A chief's agent serves HTTP before its tiers, which wait for a store that
        does not answer. ``on_serving`` gets the HTTP URL once it serves (the CLI's ``--ready-file``)."""
        try:
            self._start_http()
            assert self.http is not None
            if self.role != "ps":  # a PS's routes for its shards come first
                self._serve(on_serving)
            if self.chief is not None:
                self.chief.start()
            cfg = self.config
            self.supervisor = Supervisor(
                self.command,
                config=cfg.supervisor,
                standby_capable=self._builtin_server,
                # A trainer run as `python SCRIPT` gets a warm standby too (TensorFlow imported): restarts of a
                # trainer without a model factory then skip the interpreter start and the import.
                standby_cmd=warm_trainer_command(self.command) if self.role == "chief" and self.command else None,
                env=self._task_env(self.http.url),
                name=self.task,
                on_event=self.recovery.on_supervisor_event,
                log_path=cfg.task_log,
                log_max_bytes=cfg.task_log_max_mb * 2**20,
                log_keep=cfg.task_log_keep,
                record=task_record(cfg, self.task),
                subreaper=True,
            )
            if self.role == "ps":  # nothing the PS process is given depends on the shards: it starts first
                if not self._stop_requested.is_set():
                    self.supervisor.start()
                self._start_shards()
                if self.shards is not None:
                    serve_shards(self.http, self.shards, cfg.peer_copy)
                self._serve(on_serving)
            sup = self.supervisor
            probes = task_probes(self.role, self.address, lambda: sup.pid, builtin_server=self._builtin_server)
            self.metrics.declare_task(self.task, [p.name for p in probes])
            self.monitor = HealthMonitor(
                self.task,
                probes,
                config=cfg.probe,
                on_unhealthy=self.recovery.on_unhealthy,
                on_result=self.metrics.on_probe_result,
                on_health=self.recovery.on_health,
            )
            resumed = self.chief.resumed_step if self.chief is not None else None
            if resumed is not None and cfg.peers.restart_ps:  # the PS servers may hold an earlier chief's context
                self.peer_sync.new_generation(f"the agent resumed a job (durable step {resumed})")
            elif self.peers:
                outcome = self.peer_sync.sync(restart_ps=False)
                (log.info if all(o == "ready" for o in outcome.values()) else log.error)(
                    "event=peers_checked task=%s outcome=%s", self.task, json.dumps(outcome)
                )
            self._watch_peers()  # after the sync above, which learnt each peer's task name from its /status
            if self.chief is not None:
                self.chief.announce_parts(self.supervisor)
            if self._stop_requested.is_set():
                return self
            if self.role != "ps":
                self.supervisor.start()
            self.monitor.start()
            if self.chief is not None and self.chief.heartbeat is not None:
                self.hang_watch = HangWatch(
                    self.chief.heartbeat,
                    task_pid=lambda: sup.pid,
                    uptime=lambda: sup.status().uptime_seconds,
                    on_hang=self.recovery.on_hang,
                ).start()
            log.info("event=agent_started task=%s address=%s http=%s", self.task, self.address, self.http.url)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_http(self) -> None:
        cfg = self.config.http
        if self._token is None:
            # No token given: control is authenticated anyway, with a token made for this run in a private file
            # whose path the task gets (PSGUARD_AGENT_TOKEN_FILE); removed at stop().
            self._made_token = create_token_file()
            self._token, self._token_file = self._made_token.token, str(self._made_token.path)
        if cfg.jwt_secret_file is not None and cfg.jwt_public_key is not None:
            raise ConfigError("--jwt-secret-file (HS256) and --jwt-public-key (RS256/ES256): give one")
        audience = cfg.jwt_audience or ""  # refused by JwtAuth: tokens for another service must not work here
        auth: list[Authenticator] = []
        if cfg.jwt_secret_file is not None:
            auth.append(JwtAuth.from_secret_file(cfg.jwt_secret_file, audience))
        elif cfg.jwt_public_key is not None:
            auth.append(JwtAuth.from_public_key_file(cfg.jwt_public_key, audience))
        tls = server_context(cfg.tls_cert, cfg.tls_key, cfg.tls_ca) if cfg.tls_cert and cfg.tls_key else None
        self.http = AgentHTTPServer(
            host=cfg.bind,
            port=cfg.port,
            token=self._token,
            auth=auth,
            open_read=cfg.open_read,
            tls=tls,
            request_timeout=cfg.request_timeout,
            registry=self.metrics.registry,
            status=self.status,
            readiness=self.readiness,
        )
        Routes(self.task, self.recovery, lambda: self.supervisor, self._finish).serve_on(
            self.http, chief=self.role == "chief"
        )
        self.http.bind()  # the address the task is given; served once every route is there (start())

    def _serve(self, on_serving: Callable[[str], None] | None) -> None:
        assert self.http is not None
        self.http.start()
        if on_serving is not None:
            on_serving(self.http.url)

    def _start_shards(self) -> None:
        # lazy: numpy and the storage clients load only when the agent keeps shards
        from psguard.agent.tiers.shards import ShardKeeper
        from psguard.handoff.spool import part_dir
        from psguard.store.opening import StoreOpening

        cfg = self.config
        store = self.store = (
            StoreOpening(cfg.store, cfg.storage_options, hold=_STORE_HOLD_SECONDS, on_error=self._store_failed)
            if cfg.store
            else None
        )
        folder = Path(cfg.spool) if cfg.spool else part_dir(cfg.job, self.task)
        link = PeerLink(self._token, self._client_tls)
        try:
            self.shards = ShardKeeper(
                folder,
                self.task,
                store=store,
                copy_config=cfg.peer_copy,
                send_frame=link.send_frame,
                read_copy=link.read_copy,
                read_copy_into=link.read_copy_into,
                read_stripe=link.read_stripe,
            ).start()
        except (PsguardError, OSError) as e:
            # The PS still serves; only its shards go through the chief (as before issue 12). Say so loudly.
            log.error(
                "event=shards_not_kept task=%s folder=%s error=%r: the chief holds this PS's state",
                self.task,
                folder,
                str(e),
            )
            return
        log.info("event=shards_kept task=%s folder=%s store=%s", self.task, folder, redact(cfg.store or "-"))
        keeper = self.shards
        held = self.metrics.peer_copy_held_bytes
        keeper.holder.on_copy = lambda owner, nbytes: held.labels(owner=owner).set(nbytes)
        keeper.parity.on_copy = keeper.holder.on_copy  # a parity block: owner="ps:0,ps:1", its group

        def lag() -> float:
            value = keeper.sender.status()["lag_steps"] if keeper.sender is not None else None
            return float("nan") if value is None else float(value)

        self.metrics.peer_copy_lag_steps.labels(task=self.task).set_function(lag)

    def _store_failed(self, error: BaseException) -> None:
        """The PS agent's store, opened after its start (store/opening.py), did not open: the agent fails."""
        failure = error if isinstance(error, PsguardError) else PsguardError(f"the store did not open: {error!r}")
        log.error("event=store_open_failed task=%s error=%r", self.task, redact(str(failure)))
        self._store_error = failure
        self._wake.set()

    def request_stop(self, *_: object) -> None:
        """Ask for a graceful stop (signal-handler safe: only sets events)."""
        self._stop_requested.set()
        self._wake.set()

    def wait(self) -> int:
        """Block until the task completes (0), a stop is requested (0), or supervision fails (raises)."""
        assert self.supervisor is not None
        while not self._stop_requested.is_set() and not self.supervisor.done() and self._store_error is None:
            self._wake.wait(1.0)  # woken by events; the timeout is only a safety net
            self._wake.clear()
        if self._store_error is not None:  # as a bad store failed the start when it was opened first
            raise self._store_error
        if self.supervisor.done():
            code = self.supervisor.result()  # raises CrashLoopError
            log.info("event=task_done task=%s exit_code=%s", self.task, code)
            if code == 0 and self.peers and self.config.peers.finish_on_success:
                self.peer_sync.finish(f"the job is done: {self.task}'s task exited 0")
            return 0
        with self._lock:
            finished = self._finished
        return 0 if finished is not None else self.config.stop_exit_code

    def stop(self) -> None:
        """Stop the task gracefully, drain the persister, release everything. Idempotent."""
        self._stop_requested.set()
        self._wake.set()

        def attempt(fn: Callable[[], object]) -> None:  # each step, whatever the one before it did
            try:
                fn()
            except Exception:
                log.exception("event=stop_step_failed task=%s step=%s", self.task, getattr(fn, "__qualname__", fn))

        for part in (self.hang_watch, self.monitor, *self.peer_monitors, self.supervisor):
            if part is not None:
                attempt(part.stop)
        if self.chief is not None:
            self.chief.stop(attempt)
        for closing in (self.shards, self.store):
            if closing is not None:
                attempt(closing.close)
        if self.http is not None:
            attempt(self.http.stop)
        if self._made_token is not None:
            self._made_token.remove()
            self._made_token = None
        self._no_parts_yet()

    def _watch_peers(self) -> None:
        """A readiness monitor per peer agent, its metrics labelled by the peer's task name (``ps:0``)."""
        for url in self.peers:
            task = self.peer_sync.names.get(url) or f"peer {urllib.parse.urlsplit(url).netloc}"
            probe = HttpProbe(f"{url}/readyz", name="readyz", tls=self._client_tls)
            self.metrics.declare_task(task, [probe.name])
            monitor = HealthMonitor(
                task,
                [probe],
                config=self.config.peers.probe,
                on_result=self.metrics.on_probe_result,
                on_health=self.metrics.on_health,
            )
            self.peer_monitors.append(monitor.start())

    # ------------------------------------------------------------------------------------------ HTTP
    def _finish(self, reason: str) -> None:
        """POST /finish: the job is done (its reason kept); wait() returns 0, the CLI stops the task gracefully."""
        with self._lock:
            self._finished = reason
        self.request_stop()

    def _fresh_ps(self, task: str, status: Mapping[str, Any]) -> None:
        """A PS agent started after the failure answered (a replacement node's: its tier is empty): it fetches
        its shards from the peer's copy now, or with no copies opens its store (held: store/opening.py) for the
        log, overlapping its PS server's start and the trainer's rebuild."""
        held = (status.get("shards") or {}).get("store_state") == "held"
        if self.chief is not None and (self.config.peers.copies != "none" or held):
            self.chief.export_ahead(only=[task])

    def readiness(self) -> dict[str, bool]:
        sup, monitor = self.supervisor, self.monitor
        checks = {
            "task": sup is not None and sup.pid is not None,
            "healthy": monitor is not None and monitor.healthy,
        }
        if self.chief is not None:
            checks.update(self.chief.readiness())  # the spool's, and the persister's with a store
            checks["progress"] = self.hang_watch is None or not self.hang_watch.hung
        return checks

    def status(self) -> dict[str, Any]:
        sup, monitor = self.supervisor, self.monitor
        # Before the supervisor exists (the chief's agent serves while it waits for its store) its task is idle.
        sup_status = asdict(sup.status()) if sup is not None else {"state": SupervisorState.IDLE.value}
        mon = asdict(monitor.status()) if monitor is not None else {}
        ready = self.readiness()
        doc: dict[str, Any] = {
            "role": self.role,
            "index": self.index,
            "task": self.task,
            "address": self.address,
            "node": self.node,
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
                {"url": url, **asdict(m.status())} for url, m in zip(self.peers, self.peer_monitors, strict=False)
            ],
            "generation": self.peer_sync.generation,
            "last_generation": self.peer_sync.last,
        }
        doc.update(self.recovery.status())
        if self.shards is not None:
            doc["shards"] = self.shards.status()
        if self.chief is not None:
            doc.update(self.chief.status())
        return doc
