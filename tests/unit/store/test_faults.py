"""Faults during saves, with real processes, real signals and real S3 and GCS servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.errors import StorageUnavailableError
from psguard.storage import RetryConfig, open_backend
from psguard.storage.base import Backend, Buffer
from psguard.storage.retry import RetryingBackend
from psguard.store import Store
from psguard.store.manifest import CHUNK_PREFIX
from tests.support.paths import ROOT
from tests.support.processes import allow_new_children
from tests.support.storage_targets import Target, make_target


def start_writer(target: Target, point: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.writer_proc", target.url, json.dumps(target.options), point],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the writer says when it reached the point: no sleeping
    assert line.strip() == "ready", f"writer did not reach {point}: {line!r}, exit {proc.poll()}"
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    for f in (proc.stdin, proc.stdout):
        if f:
            f.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend_name", "point"),
    [("local", "before-manifest"), ("local", "mid-manifest"), ("seaweed", "before-manifest")],
)
def test_writer_killed_before_commit_leaves_no_checkpoint(
    backend_name: str, point: str, request: pytest.FixtureRequest, tmp_path: Path, unique: str
) -> None:
    target = make_target(backend_name, request, tmp_path, unique)
    with Store.open(target.url, target.options) as store:
        first = store.save(1, {"w": np.ones(10, np.float32)})
    proc = start_writer(target, point)
    kill(proc)
    with Store.open(target.url, target.options) as store:
        assert store.checkpoint_ids() == [first.id]  # nothing of the killed save is visible
        assert len(store.backend.keys(CHUNK_PREFIX)) > 1  # its chunks are there, orphaned
        if point == "mid-manifest":
            assert any("manifests" in k for k in store.backend.leftovers())
        # the next writer works; gc sees the dead writer's lock is stale, but its chunks are younger than a
        # lease: gc leaves them (it cannot tell a dead save from one whose lease it could not see)
        nxt = store.save(2, {"w": np.full(10, 2, np.float32)})
        report = store.gc(keep_last=2)
        assert not report.chunks_deferred
        assert report.deleted_chunks == 0 and report.young_chunks > 0
    # a lease later (chunk_grace=0 stands for the wait), gc cleans up
    with Store.open(target.url, target.options, chunk_grace=0) as store:
        report = store.gc(keep_last=2)
        assert not report.chunks_deferred
        assert report.deleted_chunks > 0
        assert store.backend.leftovers() == []
        assert store.backend.keys("locks/") == []
        assert store.checkpoint_ids() == [first.id, nxt.id]
        assert all(store.verify(cid).ok for cid in store.checkpoint_ids())


class StopServerAfterFirstChunk(RetryingBackend):
    """Stops the real storage server once the first chunk is stored: an outage in the middle of a save."""

    def __init__(self, inner: Backend, server: object, config: RetryConfig) -> None:
        super().__init__(inner, config)
        self.server = server
        self.stopped = threading.Event()
        self._lock = threading.Lock()

    def put(self, key: str, data: Buffer) -> None:
        super().put(key, data)
        with self._lock:
            if key.startswith(CHUNK_PREFIX) and not self.stopped.is_set():
                # set first: under load the other I/O thread's retries can give up while stop() still waits for the
                # server to exit, and the save's error then reaches the test before a flag set after stop() would
                self.stopped.set()
                self.server.stop()  # type: ignore[attr-defined]


@pytest.fixture(params=[pytest.param("seaweed", id="s3-seaweedfs"), pytest.param("gcs", id="gcs-fake-gcs-server")])
def server(request: pytest.FixtureRequest) -> Any:
    """A real storage server of the session that a test may stop, freeze and start again."""
    return request.getfixturevalue(request.param)


@pytest.mark.slow
def test_store_outage_during_save_fails_clearly_then_recovers(server: Any, unique: str) -> None:
    url = server.url(unique)
    options = dict(server.storage_options)
    config = RetryConfig(deadline=3.0, initial_backoff=0.05, max_backoff=0.5)
    backend = StopServerAfterFirstChunk(open_backend(url, options, retry=RetryConfig(deadline=0)), server, config)
    store = Store(backend, chunk_bytes=4096, io_threads=2)
    value = np.arange(50_000, dtype=np.float32)
    try:
        with pytest.raises(StorageUnavailableError) as e:
            store.save(5, {"w": value})
        assert backend.stopped.is_set()
        assert "storage unavailable" in str(e.value) and url in str(e.value)
    finally:
        store._pool.shutdown()
        with allow_new_children():  # the session's server, back on the same ports and data
            server.restart()
    with Store.open(url, options) as again:
        assert again.checkpoint_ids() == []  # the failed save left nothing committed
        info = again.save(5, {"w": value})
        assert np.array_equal(again.load_latest().tensors["w"], value)
        assert again.checkpoint_ids() == [info.id]


#: Client timeouts short enough for a test: botocore's for S3, the GCS backend's own (gcsfs has none by default).
SHORT_TIMEOUTS: dict[str, dict[str, Any]] = {
    "seaweedfs": {"config_kwargs": {"read_timeout": 2, "connect_timeout": 2, "retries": {"max_attempts": 1}}},
    "gcs": {"read_timeout": 2, "connect_timeout": 2},
}


@pytest.mark.slow
def test_a_frozen_server_fails_the_save_instead_of_hanging(server: Any, unique: str) -> None:
    """A SIGSTOPped server accepts connections and never answers: the save must still end, clearly."""
    url = server.url(unique)
    options = {**server.storage_options, **SHORT_TIMEOUTS[server.kind]}
    store = Store.open(url, options, retry=RetryConfig(deadline=3.0, initial_backoff=0.1), chunk_bytes=1 << 16)
    server.freeze()
    try:
        with pytest.raises(StorageUnavailableError, match="storage unavailable"):
            store.save(1, {"w": np.arange(100_000, dtype=np.float32)})
    finally:
        server.thaw()
        store.close()
    with Store.open(url, server.storage_options) as again:
        assert again.checkpoint_ids() == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("server_name", "status", "code"),
    [
        ("seaweed", 503, "SlowDown"),
        ("seaweed", 503, "ServiceUnavailable"),
        ("seaweed", 500, "InternalError"),
        ("gcs", 429, "rateLimitExceeded"),
        ("gcs", 503, "backendError"),
        ("gcs", 500, "internalError"),
    ],
)
def test_error_responses_are_retried(
    server_name: str, request: pytest.FixtureRequest, unique: str, status: int, code: str
) -> None:
    """A store answering 429/500/503 for a while (as SeaweedFS does right after a restart, GCS under load) costs
    retries, not a save."""
    from psguard.chaos.http_faults import HttpErrorProxy

    server = request.getfixturevalue(server_name)
    dialect = "gcs" if server_name == "gcs" else "s3"
    with HttpErrorProxy(server.endpoint_url, dialect=dialect) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.endpoint_url}
        with Store.open(server.url(unique), options, retry=RetryConfig(deadline=30, initial_backoff=0.01)) as store:
            table = np.arange(4000, dtype=np.float32).reshape(500, 8)
            proxy.fail_next(3, status=status, code=code)
            info = store.save(1, {"t": table})
            assert proxy.failed == 3 and proxy.forwarded > 0
            proxy.fail_next(3, status=status, code=code)
            loaded = store.load(info.id)
            assert proxy.failed == 6
            assert np.array_equal(loaded["t"], table)
