"""The storage backends every store test runs against (fsspec's abstract-suite pattern: one set of tests,
each backend only supplies where its store lives)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("memory", id="memory"),
    pytest.param("seaweed", id="s3-seaweedfs", marks=pytest.mark.slow),
    pytest.param("moto", id="s3-moto", marks=pytest.mark.slow),
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
    if name in ("seaweed", "moto"):
        server = request.getfixturevalue(name)
        return Target(name, server.url(unique), dict(server.storage_options), server)
    if name == "hdfs":
        cluster = request.getfixturevalue("hdfs")
        return Target(name, cluster.url(f"/{unique}"), {}, cluster)
    if name == "webhdfs":
        cluster = request.getfixturevalue("hdfs")
        return Target(name, cluster.webhdfs_url(f"/{unique}"), {"user": cluster.user}, cluster)
    raise AssertionError(name)
