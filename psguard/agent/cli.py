"""``psguard agent``: its command line, and the process around an :class:`~psguard.agent.daemon.Agent`
(signals, the ready file)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from psguard.agent.config import ROLES, AgentConfig, HttpConfig, load_cluster, task_from_tf_config
from psguard.agent.control.httpd import is_loopback
from psguard.agent.daemon import Agent
from psguard.config import load_yaml
from psguard.errors import ConfigError
from psguard.handoff.client import read_token


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
    p.add_argument("--role", choices=ROLES, help="the task's role (default: TF_CONFIG's task.type)")
    p.add_argument("--index", type=int, help="the task's index in its role (default: TF_CONFIG's task.index)")
    p.add_argument(
        "--cluster",
        metavar="cluster.json",
        help='{"chief": ["host:port"], "ps": [...]} (default: TF_CONFIG\'s cluster, as in a Kubeflow TFJob pod)',
    )
    p.add_argument("--store", metavar="URL", help="durable log (chief and PS agents): a path, file://, s3://, hdfs://")
    p.add_argument(
        "--spool",
        metavar="DIR",
        help="chief: spool folder shared with the trainer (default /dev/shm/psguard-JOB); PS: the folder its "
        "shards pass through (default /dev/shm/psguard-JOB-ps-I)",
    )
    p.add_argument("--http-port", type=int, help="HTTP port (default: config http.port, 0 = any free port)")
    p.add_argument("--bind", help="HTTP address (default 127.0.0.1; any other needs --token-file or JWT settings)")
    p.add_argument(
        "--token-file",
        help="bearer token for HTTP (a 0600 file), also sent to --peer agents; default: a random one for this run",
    )
    p.add_argument("--open-read", action="store_true", default=None, help="serve /metrics and /status without auth")
    p.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM, a 0600 file)")
    p.add_argument(
        "--tls-ca", metavar="FILE", help="mutual TLS: clients must present a certificate this CA signed; peers verified"
    )
    p.add_argument("--jwt-secret-file", metavar="FILE", help="accept bearer JWTs signed HS256 with this secret")
    p.add_argument("--jwt-public-key", metavar="FILE", help="accept bearer JWTs signed RS256/ES256 (PEM public key)")
    p.add_argument("--jwt-audience", metavar="AUD", help="the 'aud' every JWT must carry (required with JWTs)")
    p.add_argument("--config", metavar="agent.yaml", help="agent settings (supervisor, probe, peers, persister, http)")
    p.add_argument("--peer", action="append", default=[], metavar="URL", help="another agent (chief only); repeatable")
    p.add_argument("--ready-file", help="write this agent's HTTP URL here once it serves (for scripts and tests)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD...: the task (required for the chief)")
    p.set_defaults(func=main)


def resolve_task(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, int, dict[str, list[str]]]:
    """Role, index and cluster: from ``--role --index --cluster`` when given (all three), else from ``TF_CONFIG``."""
    flags = {"--role": args.role, "--index": args.index, "--cluster": args.cluster}
    given = [k for k, v in flags.items() if v is not None]
    if len(given) == len(flags):
        return args.role, args.index, load_cluster(args.cluster, args.role, args.index)
    if given:
        missing = ", ".join(k for k in flags if k not in given)
        raise ConfigError(f"{', '.join(given)} also needs {missing}: give --role, --index and --cluster together")
    text = environ.get("TF_CONFIG", "").strip()
    if not text:
        raise ConfigError(
            "which task does this agent run? Give --role, --index and --cluster, or set TF_CONFIG "
            '({"cluster": {...}, "task": {"type": "ps", "index": 0}}; a Kubeflow TFJob pod has it)'
        )
    return task_from_tf_config(text)


def main(args: argparse.Namespace) -> int:
    """``psguard agent``: returns 0 when the task completed or the agent was stopped; raises on a crash loop."""
    command = list(args.command or [])
    command = command[1:] if command[:1] == ["--"] else command
    config = load_yaml(AgentConfig, args.config) if args.config else AgentConfig()
    # The flags over the file: each http: key's flag has its name (but --http-port); a key without a flag is None.
    flags = {f.name: getattr(args, "http_port" if f.name == "port" else f.name, None) for f in fields(HttpConfig)}
    http_cfg = replace(config.http, **{k: v for k, v in flags.items() if v is not None})
    given = {k: v for k in ("store", "spool") if (v := getattr(args, k)) is not None}
    config = replace(config, http=http_cfg, **given)
    role, index, cluster = resolve_task(args, os.environ)
    if role == "worker" and (args.store or args.spool):
        raise ConfigError(
            "--store and --spool belong to the chief's agent and the PS agents (they hold the memory tiers and write "
            "the log); a worker's agent holds no state"
        )
    token = read_token(config.http.token_file)
    jwt_configured = config.http.jwt_secret_file or config.http.jwt_public_key
    if token is None and not jwt_configured and not is_loopback(config.http.bind):
        raise ConfigError(
            f"--bind {config.http.bind}: serving on a non-loopback address needs --token-file "
            "(POST /restart kills the task)"
        )
    agent = Agent(
        role,
        index,
        cluster,
        command=command,
        config=config,
        peers=args.peer,
        token=token,
        token_file=config.http.token_file,
    )
    previous = {sig: signal.signal(sig, agent.request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}

    def serving(url: str) -> None:  # before start() returns: a chief's agent may wait for its store first
        if args.ready_file:
            tmp = Path(f"{args.ready_file}.tmp")
            tmp.write_text(url + "\n")
            tmp.rename(args.ready_file)

    try:
        agent.start(on_serving=serving)
        return agent.wait()  # a crash loop raises CrashLoopError: psguard prints it and exits 1
    finally:
        agent.stop()
        for signum, handler in previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
