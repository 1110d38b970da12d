"""Real ``psguard agent`` processes for tests: the agent as a user starts it (``AgentProc``), the fast probe and
restart settings every such test runs with (``FAST``), and cluster specs on free local ports.

The ``agents`` fixture (in tests/cluster/conftest.py) starts them and stops them after the test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from psguard.agent.process.launcher import run_token_file
from psguard.handoff.client import http_json, http_request, read_token
from psguard.handoff.contract import ENV_SPOOL, ENV_STORE
from psguard.handoff.tls import client_context
from psguard.ports import free_ports
from tests.support.paths import QUIET, ROOT
from tests.support.processes import wait_until


def under_agent(monkeypatch: pytest.MonkeyPatch, spool: str | None, store: str | None) -> None:
    """The environment ``psguard agent`` gives the trainer it runs: its spool and its ``--store`` (``None``: the
    variable is absent; both ``None``: no agent, whatever runs the test process)."""
    for name, value in ((ENV_SPOOL, spool), (ENV_STORE, store)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


FAST = """
probe: {interval: 0.5, deadline: 0.5, failure_threshold: 2, startup_timeout: 120, hung_after: 2}
supervisor: {backoff_initial: 0.1, backoff_max: 1, stop_timeout: 5, standby_delay: 1, standby_delay_after_restart: 1}
peers: {ready_timeout: 120, probe: {interval: 0.5, deadline: 0.5}}
persister: {retry_after: 1}
"""
#: FAST for a chief's agent: no warm standby for its trainer (a Python with TensorFlow imported, 10 s of CPU).
#: At FAST's 1 s delay every chief-agent test paid that import for a standby none of them uses, a large share of
#: a 2-core CI; restarts here are cold. The warm trainer is tested where it is the subject (test_supervisor.py)
#: and runs with the default settings in every whole-job test (e2e/: job styles, examples, demo, chaos smoke).
FAST_CHIEF = FAST.replace("standby_delay: 1, standby_delay_after_restart: 1", "standby: false")


class AgentProc:
    """``psguard agent ...`` as a subprocess; its HTTP URL from ``--ready-file``."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        args: Sequence[str],
        command: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ready_file = self.dir / "url"
        self.log_path = self.dir / "agent.log"
        config = self.dir / "agent.yaml"
        role = args[args.index("--role") + 1] if "--role" in args else None
        if not config.exists():
            config.write_text(FAST_CHIEF if role == "chief" else FAST)
        if "state_dir:" not in config.read_text():
            # The test's own state folder: agents of other test runs on this machine (same task names, default
            # job) must not see this one's task records.
            config.write_text(config.read_text() + f"state_dir: {tmp / 'agent-state'}\n")
        argv = [sys.executable, "-m", "psguard.cli", "-v", "agent", *args, "--config", str(config)]
        argv += ["--ready-file", str(self.ready_file)]
        if role == "ps" and "--spool" not in args:
            # A PS agent keeps its shards in the test's folder, not in /dev/shm/psguard-default-ps-N, which
            # other test runs on this machine would share.
            argv += ["--spool", str(self.dir / "shards")]
        self.token: str | None = None
        self.token_file: Path | None = None
        # An agent serving mutual TLS is called with the certificate it serves (usable as a client's too).
        self.tls: ssl.SSLContext | None = None
        if "--tls-cert" in args:
            option = {a: args[args.index(a) + 1] for a in ("--tls-ca", "--tls-cert", "--tls-key") if a in args}
            self.tls = client_context(option.get("--tls-ca"), option["--tls-cert"], option["--tls-key"])
        if "--token-file" not in args:  # one token for the test's agents: the chief's agent calls its peers
            self.token_file = run_token_file(tmp)
            argv += ["--token-file", str(self.token_file)]
            self.token = read_token(str(self.token_file))
        if command:
            argv += ["--", *command]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(ROOT), **QUIET, **(env or {})),
        )

    @property
    def url(self) -> str:
        def read() -> str | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode}:\n{self.log()}")
            return self.ready_file.read_text().strip() if self.ready_file.exists() else None

        return str(wait_until(read, 60, "agent serving HTTP"))

    def log(self) -> str:
        """The whole log: tests search it for events, and a slow run writes more after the one looked for (a
        tail cut off ``peer_copy_not_used`` in a clean-clone CI)."""
        return self.log_path.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        code, doc = http_json("GET", f"{self.url}/status", token=self.token, tls=self.tls)
        assert code == 200, doc
        return dict(doc)

    def metrics(self) -> str:
        if self.tls is not None:
            code, body, _ = http_request("GET", f"{self.url}/metrics", token=self.token, tls=self.tls)
            assert code == 200, body[:500]
            return body.decode()
        host_port = self.url.removeprefix("http://")
        with socket.create_connection(tuple(host_port.rsplit(":", 1)), timeout=5) as s:  # type: ignore[arg-type]
            auth = f"Authorization: Bearer {self.token}\r\n" if self.token else ""
            s.sendall(f"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return data.decode()

    def wait_status(self, cond: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode} waiting for {what}:\n{self.log()}")
            try:
                doc = self.status()
            except OSError:
                return None
            return doc if cond(doc) else None

        try:
            return dict(wait_until(check, timeout, what))
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- agent log:\n{self.log()}") from None

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent still running after {timeout}s:\n{self.log()}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def write_cluster(tmp_path: Path, ps: int = 1, workers: int = 1) -> tuple[Path, dict[str, list[str]]]:
    ports = free_ports(1 + ps + workers)
    spec = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{p}" for p in ports[1 : 1 + ps]],
        "worker": [f"127.0.0.1:{p}" for p in ports[1 + ps :]],
    }
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec))
    return path, spec


def port_accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def lone_chief_agent(tmp_path: Path, store: Path, command: list[str], *extra: str) -> list[str]:
    """argv of a real ``psguard agent --role chief`` with no PS (a cluster of the chief alone), its spool and
    store under ``tmp_path``, running ``command``: for tests of the trainer <-> agent hand-off itself."""
    from psguard.ports import free_ports

    (port,) = free_ports(1)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"chief": [f"127.0.0.1:{port}"]}))
    argv = [sys.executable, "-m", "psguard.cli", "agent", "--role", "chief", "--index", "0", "--cluster", str(cluster)]
    argv += ["--store", str(store), "--spool", str(tmp_path / "spool"), "--http-port", "0", *extra]
    if "--config" not in extra:  # its own state folder: other runs' agents on this machine have the same task names
        config = tmp_path / "lone-agent.yaml"
        config.write_text(f"state_dir: {tmp_path / 'agent-state'}\n")
        argv += ["--config", str(config)]
    return [*argv, "--", *command]
