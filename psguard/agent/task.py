"""What an agent gives its task: its command (the built-in server), its environment, its probes, its record; all
decided before the task starts. The environment is the contract with the trainer (:mod:`psguard.handoff.contract`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from psguard.agent.config import AgentConfig
from psguard.agent.process.prober import GrpcStatusProbe, Probe, ProcessProbe, TcpProbe
from psguard.handoff.contract import (
    ENV_AGENT_CA,
    ENV_AGENT_CLIENT_CERT,
    ENV_AGENT_CLIENT_KEY,
    ENV_AGENT_TOKEN_FILE,
    ENV_AGENT_URL,
    ENV_SPOOL,
    ENV_STORE,
    ENV_TASK,
    QUIET_TENSORFLOW,
    default_spool_dir,
)


def server_command(cluster: Mapping[str, Sequence[str]], role: str, index: int) -> list[str]:
    """The built-in PS / worker task: a ``tf.distribute.Server`` that dies with this agent."""
    spec = json.dumps(cluster, sort_keys=True)
    flags = ["--cluster-spec", spec, "--job", role, "--index", str(index), "--parent-pid", str(os.getpid())]
    return [sys.executable, "-m", "psguard.agent.process.tf_server", *flags]


#: glibc's tunable for malloc to ask the kernel for transparent huge pages (``supervisor.huge_pages``).
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
#: glibc's tunable that fixes the size from which malloc maps a block of its own (``supervisor.ps_mmap_threshold_mb``).
MMAP_THRESHOLD_TUNABLE = "glibc.malloc.mmap_threshold"
#: TensorFlow's variable with gRPC arguments for every channel it makes (``name=value,...``), and the argument
#: ``supervisor.reconnect_backoff`` sets in it: gRPC's default 1 s wait was the longest part of a recovery, the PS
#: being back in 0.2-0.4 s.
TF_GRPC_OPTIONS = "TF_GRPC_DEFAULT_OPTIONS"
RECONNECT_BACKOFF_ARG = "grpc.initial_reconnect_backoff_ms"


def _add_setting(env: dict[str, str], variable: str, separator: str, setting: str) -> None:
    """Add ``setting`` (``name=value``) to the list in ``env[variable]``, unless it sets that name already (the
    user's choice stands; an older glibc ignores names it does not know)."""
    current = env.get(variable, "")
    if f"{setting.partition('=')[0]}=" not in current:
        env[variable] = f"{current}{separator}{setting}" if current else setting


def task_env(
    cluster: Mapping[str, Sequence[str]],
    role: str,
    index: int,
    *,
    url: str,
    token_file: str | None,
    config: AgentConfig,
    spool_dir: Path | None,
) -> dict[str, str]:
    """The task's environment: ``TF_CONFIG`` for its role and index, the variables of
    :mod:`psguard.handoff.contract`, and ``config``'s for malloc and gRPC (``supervisor:``; 0 / false: the
    defaults of glibc and TensorFlow)."""
    env = {**QUIET_TENSORFLOW, **os.environ}
    sup, http = config.supervisor, config.http
    if sup.huge_pages and role == "ps":
        _add_setting(env, "GLIBC_TUNABLES", ":", HUGE_PAGES_TUNABLE)
    if sup.ps_mmap_threshold_mb > 0 and role == "ps":
        mmap_threshold = round(sup.ps_mmap_threshold_mb * (1 << 20))
        _add_setting(env, "GLIBC_TUNABLES", ":", f"{MMAP_THRESHOLD_TUNABLE}={mmap_threshold}")
    if sup.reconnect_backoff > 0:
        backoff_ms = max(1, round(sup.reconnect_backoff * 1000))
        _add_setting(env, TF_GRPC_OPTIONS, ",", f"{RECONNECT_BACKOFF_ARG}={backoff_ms}")
    env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": role, "index": index}, "rpc_layer": "grpc"})
    env[ENV_TASK] = f"{role}:{index}"
    env[ENV_AGENT_URL] = url
    if token_file is not None:
        env[ENV_AGENT_TOKEN_FILE] = token_file  # the path, never the token itself
    for name in (ENV_AGENT_CA, ENV_AGENT_CLIENT_CERT, ENV_AGENT_CLIENT_KEY):
        env.pop(name, None)  # only this agent's TLS settings, not a parent's
    if http.tls_ca is not None and http.tls_cert is not None and http.tls_key is not None:
        # Mutual TLS: the task verifies its agent against the CA and presents the agent's certificate (the
        # task runs as the agent's user and already holds its token: no new trust).
        env[ENV_AGENT_CA] = str(Path(http.tls_ca).resolve())
        env[ENV_AGENT_CLIENT_CERT] = str(Path(http.tls_cert).resolve())
        env[ENV_AGENT_CLIENT_KEY] = str(Path(http.tls_key).resolve())
    if spool_dir is not None:
        env[ENV_SPOOL] = str(spool_dir)
        env[ENV_STORE] = config.store or ""  # the trainer's manager checks its directory against it
    return env


def task_record(config: AgentConfig, task: str) -> Path:
    """The file in which the supervisor records the task's process tree (one per task on a host)."""
    folder = Path(config.state_dir or default_spool_dir(config.job).with_name(f"psguard-{config.job}-agents"))
    return folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', task)}.task.json"


def task_probes(role: str, address: str, pid: Callable[[], int | None], *, builtin_server: bool) -> list[Probe]:
    """What judges the task's health: its process (``pid``: the running one's); a PS or worker's port and
    ``GetStatus`` RPC too (a frozen server keeps its port: only the RPC's deadline notices)."""
    probes: list[Probe] = [ProcessProbe(pid)]
    if role != "chief":
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        target = address
        if builtin_server or host in ("0.0.0.0", "::", ""):
            # The built-in tf.distribute.Server listens on every interface (*:port): probe it on loopback, so
            # its name need not resolve first. A TFJob operator's Service publishes a pod's name only once the
            # pod is Ready, and Ready waits for these probes.
            host = "127.0.0.1"
            target = f"{host}:{port}" if builtin_server else address
        probes.append(TcpProbe(host, int(port)))
        probes.append(GrpcStatusProbe(target))
    return probes
