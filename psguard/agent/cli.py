"""``psguard agent``: its command line, and the process around an :class:`~psguard.agent.daemon.Agent`
(signals, the ready file)."""

from __future__ import annotations

import argparse
import contextlib
import signal
from pathlib import Path
from typing import Any

from psguard.agent.config import ROLES, AgentConfig, HttpConfig, load_cluster
from psguard.agent.daemon import Agent
from psguard.agent.httpd import is_loopback
from psguard.config import load_yaml
from psguard.errors import ConfigError
from psguard.handoff.client import read_token

__all__ = ["main", "register"]


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
