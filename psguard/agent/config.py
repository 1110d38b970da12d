"""The agent's configuration (``agent.yaml``, merged with CLI flags) and the cluster spec it runs in.

Frozen dataclasses loaded with unknown keys rejected (:func:`psguard.config.load_yaml`); the cluster spec
(``cluster.json``, TF's ``cluster`` dict) is validated before any process starts, naming the bad key.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from psguard.agent.control.peers import PeersConfig
from psguard.agent.process.lifecycle import SupervisorConfig
from psguard.agent.process.prober import MonitorConfig
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.config import Duration, read_settings_file
from psguard.errors import ConfigError

ROLES = ("chief", "ps", "worker")

_CLUSTER_KEYS = (*ROLES, "evaluator")
_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)$")


@dataclass(frozen=True)
class HttpConfig:
    """``http:``: where the agent serves and who may call it (docs/security.md). CLI flags override these.

    Without ``token_file`` the agent makes a random token in a private file for this run and gives its path to
    its task; a chief with peers needs the token they share. ``open_read`` serves ``/metrics`` and ``/status``
    without a credential. ``request_timeout`` bounds a whole request (handshake, headers and body).
    """

    bind: str = "127.0.0.1"
    port: int = 0
    token_file: str | None = None
    open_read: bool = False
    request_timeout: Duration = 10.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # with a CA: mutual TLS (clients present a certificate it signed)
    jwt_secret_file: str | None = None  # HS256
    jwt_public_key: str | None = None  # RS256 / ES256
    jwt_audience: str | None = None


@dataclass(frozen=True)
class PersistConfig:
    """``persister:``: the durable log writer (chief only)."""

    max_chain: int | None = 16
    max_delta_percent: float | None = 100.0
    retry_after: Duration | None = 5.0
    drain_timeout: Duration = 120.0  # at a stop: the longest wait for the last save


@dataclass(frozen=True)
class AgentConfig:
    """The agent's YAML file (``--config``); every key is optional, unknown keys are rejected."""

    job: str = "default"  # names the default spool folder
    store: str | None = None
    storage_options: Mapping[str, str] = field(default_factory=dict)
    # How long the chief's agent waits at start for a store that does not answer (None: for ever); then it exits
    # with "storage unavailable".
    store_wait_timeout: Duration | None = None
    spool: str | None = None
    task_log: str | None = None  # append the task's output here (default: the agent's own stdout/stderr)
    # The task log's bound (psguard/agent/process/task_log.py): at most (keep + 1) x max on the node.
    task_log_max_mb: int = 100
    task_log_keep: int = 3
    # Where the agent records its task's process tree for its successor (default: /dev/shm/psguard-<job>-agents).
    state_dir: str | None = None
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    probe: MonitorConfig = field(default_factory=MonitorConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)
    peer_copy: PeerCopyConfig = field(default_factory=PeerCopyConfig)
    # The node this agent runs on, where peer copies are not placed (default: $PSGUARD_NODE, else $NODE_NAME,
    # else the host name).
    node: str | None = None
    persister: PersistConfig = field(default_factory=PersistConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    # The agent's exit code after SIGTERM or SIGINT (143 on Kubernetes Jobs: an evicted pod then counts as failed).
    # A PS or worker agent told the job is done (POST /finish) exits 0 regardless.
    stop_exit_code: int = 0


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
            if not isinstance(address, str):
                raise ConfigError(f"{source}: {key}: expected a 'host:port' string, got {address!r}")
            host, sep, port = address.rpartition(":")
            if not sep or not host or not _HOST_RE.match(host):
                raise ConfigError(f"{source}: {key}: expected 'host:port' (e.g. '10.0.0.5:2222'), got {address!r}")
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ConfigError(f"{source}: {key}: the port must be a number from 1 to 65535, got {address!r}")
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
        data = json.loads(read_settings_file(source))  # a regular file: not a FIFO that would block the start
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON: {e}") from None
    cluster = validate_cluster(data, source=source)
    return check_task(cluster, role, index, source, role_key="--role", index_key="--index")


def check_task(
    cluster: dict[str, list[str]], role: str, index: int, source: str, *, role_key: str, index_key: str
) -> dict[str, list[str]]:
    if role not in ROLES:
        raise ConfigError(f"{role_key}: the agent runs one of {', '.join(ROLES)}, got {role!r}")
    if role not in cluster:
        raise ConfigError(f"{source}: {role}: no such role in the cluster, but the agent runs {role}:{index}")
    if not 0 <= index < len(cluster[role]):
        raise ConfigError(
            f"{source}: {role}: {index_key} {index} is out of range (the cluster has {len(cluster[role])} {role} tasks)"
        )
    return cluster


def task_from_tf_config(text: str) -> tuple[str, int, dict[str, list[str]]]:
    """Role, index and cluster from ``TF_CONFIG`` (``{"cluster": {...}, "task": {"type": "ps", "index": 0}}``, as
    a Kubeflow TFJob pod has it); :class:`ConfigError` names the bad part."""
    source = "TF_CONFIG"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON: {e}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a JSON object with 'cluster' and 'task', got {type(data).__name__}")
    if "cluster" not in data:
        raise ConfigError(f"{source}: no 'cluster' key (the job's address lists)")
    cluster = validate_cluster(data["cluster"], source=f"{source}: cluster")
    task = data.get("task")
    if not isinstance(task, Mapping):
        raise ConfigError(f'{source}: task: expected {{"type": ROLE, "index": N}}, got {task!r}')
    role, index = task.get("type"), task.get("index", 0)
    if not isinstance(index, int) or isinstance(index, bool):
        raise ConfigError(f"{source}: task.index: expected a whole number, got {index!r}")
    if not isinstance(role, str):
        raise ConfigError(f"{source}: task.type: expected one of {', '.join(ROLES)}, got {role!r}")
    cluster = check_task(
        cluster, role, index, f"{source}: cluster", role_key=f"{source}: task.type", index_key="task.index"
    )
    return role, index, cluster
