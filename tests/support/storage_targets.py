"""The storage backends every store test runs against (fsspec's abstract-suite pattern: one set of tests,
each backend only supplies where its store lives)."""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from psguard.storage.base import Backend
from psguard.storage.metered import MeteredBackend

BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("memory", id="memory"),
    pytest.param("seaweed", id="s3-seaweedfs", marks=pytest.mark.slow),
    pytest.param("moto", id="s3-moto", marks=pytest.mark.slow),
    pytest.param("gcs", id="gcs-fake-gcs-server", marks=pytest.mark.slow),
    pytest.param("hdfs", id="hdfs-native", marks=pytest.mark.slow),
    pytest.param("webhdfs", id="webhdfs", marks=pytest.mark.slow),
]


@dataclass
class Target:
    name: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)
    server: Any = None


def make_target(name: str, request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Target:
    if name == "local":
        return Target(name, str(tmp_path / "store"))
    if name == "memory":
        return Target(name, f"memory://{unique}")
    if name in ("seaweed", "moto", "gcs"):
        server = request.getfixturevalue(name)
        return Target(name, server.url(unique), dict(server.storage_options), server)
    if name == "hdfs":
        cluster = request.getfixturevalue("hdfs")
        return Target(name, cluster.url(f"/{unique}"), {}, cluster)
    if name == "webhdfs":
        cluster = request.getfixturevalue("hdfs")
        return Target(name, cluster.webhdfs_url(f"/{unique}"), {"user": cluster.user}, cluster)
    raise AssertionError(name)


class Delegating(MeteredBackend):
    """Every call passed to ``inner`` (a metered backend with no meter): subclass it and override the calls a
    test makes fail."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner, on_read=lambda nbytes: None)


class UnreadableKeys(Delegating):
    """Reads of the keys in ``unreadable`` fail as a failing disk's do (``EIO``); everything else works. Wrap it
    in a :class:`~psguard.storage.retry.RetryingBackend`: EIO is retried until the deadline, as in production."""

    def __init__(self, inner: Backend, unreadable: set[str] | None = None) -> None:
        super().__init__(inner)
        self.unreadable = set(unreadable or ())
        self.failed_reads = 0

    def _check(self, key: str) -> None:
        if key in self.unreadable:
            self.failed_reads += 1
            raise OSError(errno.EIO, "Input/output error (injected)", key)

    def get(self, key: str) -> bytes:
        self._check(key)
        return super().get(key)

    def get_into(self, key: str, out: memoryview) -> int:
        self._check(key)
        return super().get_into(key, out)
