"""A localhost parameter-server cluster with every task under its own ``psguard agent`` process: shared by
``psguard demo`` and ``psguard chaos run``, so that the chaos harness proves what the demo shows. An agent
restarted after it was killed keeps its HTTP port, so the chief's agent finds it again."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from psguard.errors import PsguardError
from psguard.handoff.client import http_json, read_token
from psguard.handoff.contract import QUIET_TENSORFLOW
from psguard.handoff.credentials import ensure_private_dir
from psguard.ports import free_ports

AGENT_CONFIG = """\
probe: {interval: 0.5, deadline: 1.0, failure_threshold: 3, startup_timeout: 180}
supervisor: {backoff_initial: 0.1, backoff_max: 1, stop_timeout: 10}
peers: {ready_timeout: 180, probe: {interval: 1.0, deadline: 1.0}}
persister: {retry_after: 1}
"""


def with_peers(config: str, **peers: object) -> str:
    """An agent's settings (YAML) with these ``peers:`` keys set over its own: the chaos runner and the recovery
    benchmark start the chief's agent from the launcher's settings plus a scenario's or a run's (peer copies,
    keep_survivors); unchanged when none is given."""
    if not peers:
        return config
    doc = yaml.safe_load(config) or {}
    doc["peers"] = {**(doc.get("peers") or {}), **peers}
    return str(yaml.safe_dump(doc, sort_keys=False))


def run_token_file(directory: Path) -> Path:
    """The token every agent of the run in ``directory`` shares: ``directory/.token/token``, made on first use.

    Agents authenticate each other (the chief's agent restarts PS servers with ``POST /restart``), so a run
    needs one token for all; a ``0600`` file in a ``0700`` folder, like the one an agent makes for itself.
    """
    path = ensure_private_dir(directory / ".token", "the run's token folder") / "token"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


class LaunchError(PsguardError):
    """The cluster could not go on (an agent died, a deadline passed)."""


class AgentProcess:
    """One ``psguard agent`` subprocess, its log in ``<dir>/agent.log`` at ``-v`` (``terminal=N``: on this process's
    output at ``N`` times ``-v``, as ``psguard wrap``'s chief, whose trainer's output is the user's) and its HTTP URL
    from ``--ready-file``."""

    def __init__(
        self,
        directory: Path,
        name: str,
        args: Sequence[str],
        command: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        config: str = AGENT_CONFIG,
        token_file: Path | None = None,
        terminal: int | None = None,
    ) -> None:
        self.name = name
        self.token_file = token_file if token_file is not None else run_token_file(directory)
        self.dir = directory / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ready_file = self.dir / "url"
        self.log_path = self.dir / "agent.log"
        self._config = self.dir / "agent.yaml"
        settings = yaml.safe_load(config) or {}
        # The run's own task records (unless the settings name theirs): another run on this host (the same default
        # job, the same task names) must neither see them nor refuse to start because of them.
        settings.setdefault("state_dir", str(directory / ".state"))
        self._config.unlink(missing_ok=True)  # owner-only (storage_options may hold secrets), whatever was there
        with os.fdopen(os.open(self._config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(json.dumps(settings, indent=1) + "\n")
        self._args = ["-v"] * (1 if terminal is None else terminal) + ["agent", *args]
        self._command = list(command)
        self._env = {**os.environ, **QUIET_TENSORFLOW, **(env or {})}
        self.url: str | None = None  # known once it serves (wait_url)
        self.starts = 0
        self._log = open(self.log_path, "ab") if terminal is None else None  # noqa: SIM115 - closed in stop()
        self._spawn([])

    def _spawn(self, extra: Sequence[str]) -> None:
        argv = [sys.executable, "-m", "psguard.cli", *self._args, *extra, "--config", str(self._config)]
        argv += ["--token-file", str(self.token_file), "--ready-file", str(self.ready_file)]
        argv += ["--", *self._command] if self._command else []
        self.ready_file.unlink(missing_ok=True)
        # Its own session: Ctrl-C reaches the parent only, which then stops the agents in order.
        stderr = subprocess.STDOUT if self._log else None
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=stderr, env=self._env, start_new_session=True)
        self.starts += 1

    def restart(self) -> None:
        """Start the agent again after it died (it was killed), on the same HTTP port."""
        if self.proc.poll() is None:
            raise LaunchError(f"agent {self.name} is still running (pid {self.proc.pid})")
        port = self.url.rsplit(":", 1)[1] if self.url else None
        self.url = None
        self._spawn(["--http-port", port] if port else [])

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while self.url is None:
            if self.proc.poll() is not None:
                raise LaunchError(f"agent {self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready_file.exists() and (text := self.ready_file.read_text().strip()):
                self.url = text
            elif time.monotonic() > deadline:
                raise LaunchError(f"agent {self.name} did not serve HTTP within {timeout:.0f}s")
            else:
                time.sleep(0.05)
        return self.url

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        token = read_token(str(self.token_file))
        code, doc = http_json("GET", f"{self.wait_url(60)}/status", token=token, timeout=timeout)
        if code != 200 or not isinstance(doc, dict):
            raise LaunchError(f"agent {self.name}: /status answered HTTP {code}")
        return doc

    def stop(self, timeout: float = 60.0, hurry: threading.Event | None = None) -> None:
        """SIGTERM, then SIGKILL to its whole session after ``timeout`` or as soon as ``hurry`` is set."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline and not (hurry and hurry.is_set()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.1)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the agent and whatever it left in its session
            self.proc.wait()
        if self._log is not None and not self._log.closed:
            self._log.close()


def write_cluster(directory: Path, ps: int, workers: int) -> tuple[Path, dict[str, list[str]]]:
    """``cluster.json`` on free loopback ports: one chief, ``ps`` PS tasks, ``workers`` workers."""
    ports = free_ports(1 + ps + workers)
    spec = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{p}" for p in ports[1 : 1 + ps]],
        "worker": [f"127.0.0.1:{p}" for p in ports[1 + ps :]],
    }
    path = directory / "cluster.json"
    path.write_text(json.dumps(spec, indent=2))
    return path, spec


class ProgressReader:
    """Reads the complete lines the trainer appended since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]
