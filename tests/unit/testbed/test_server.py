"""The life cycle every test-bed server shares (psguard.testbed.server), on the smallest real server: Python's
own HTTP server as a child process. S3 and GCS specifics are in test_s3.py and test_gcs.py."""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from typing import ClassVar

import pytest

from psguard.ports import free_port, port_open
from psguard.testbed.server import LoopbackServer, ServerError

pytestmark = pytest.mark.slow


class HttpServer(LoopbackServer):
    """``python -m http.server`` serving its working folder, which holds the environment it was started with."""

    kind: ClassVar[str] = "http-test"
    drop_env: ClassVar[tuple[str, ...]] = ("PSGUARD_TEST_DROPPED",)

    def _choose_ports(self) -> None:
        self._port = free_port(self.host)

    def _command(self) -> list[str]:
        code = (
            "import http.server, os, sys; open('env.txt', 'w').write(' '.join(sorted(os.environ)));"
            "http.server.test(http.server.SimpleHTTPRequestHandler, port=int(sys.argv[1]), bind=sys.argv[2])"
        )
        return [sys.executable, "-c", code, str(self._port), self.host]

    def _await_ready(self, deadline: float) -> None:
        while not port_open(self.host, self._port, timeout=0.2):
            self._check_alive()
            if time.monotonic() > deadline:
                raise self._failure("did not listen")
            time.sleep(0.05)

    def get(self, name: str) -> bytes:
        with urllib.request.urlopen(f"{self.endpoint_url}/{name}", timeout=5) as resp:
            data: bytes = resp.read()
            return data


def test_a_server_comes_back_on_its_port_and_goes_without_a_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSGUARD_TEST_DROPPED", "1")
    monkeypatch.setenv("PSGUARD_TEST_KEPT", "1")
    with HttpServer() as server:
        port, workdir, first = server.port, server.workdir, server.pid
        env = server.get("env.txt").decode().split()
        assert "PSGUARD_TEST_KEPT" in env and "PSGUARD_TEST_DROPPED" not in env
        server.restart()
        assert server.port == port and server.pid != first and server.get("env.txt")
        server.stop()
        assert not server.running and not port_open(server.host, port, timeout=0.5)
        server.start()
        assert server.get("env.txt")
        last = server.pid
    assert last is not None and not workdir.exists() and not port_open("127.0.0.1", port, timeout=0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(last, 0)
    with pytest.raises(ServerError, match="was closed"):
        server.start()
