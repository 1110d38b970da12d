"""The Hadoop runtime the HDFS testbed runs from: where it is cached, and that preparing it twice is free."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from psguard.testbed import hadoop_runtime


def test_cache_dir_follows_psguard_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PSGUARD_CACHE", str(tmp_path))
    assert hadoop_runtime.default_cache_dir() == tmp_path / "hadoop"
    monkeypatch.delenv("PSGUARD_CACHE")
    assert hadoop_runtime.default_cache_dir() == Path.home() / ".cache" / "psguard" / "hadoop"


@pytest.mark.slow
def test_prepare_is_idempotent_and_fast() -> None:
    home = hadoop_runtime.prepare()
    t0 = time.monotonic()
    assert hadoop_runtime.prepare() == home
    assert time.monotonic() - t0 < 1.0
    assert (home / "jars" / f"hadoop-hdfs-{hadoop_runtime.HADOOP_VERSION}.jar").is_file()
    assert (home / "jersey1" / "jersey1-server.jar").is_file()
    assert not list(home.rglob("*.tar.gz")), "the pyspark sdist must not stay in the cache"
    assert not list((home / "jars").glob("jersey-*")), "jersey2 next to jersey1 breaks WebHDFS"
