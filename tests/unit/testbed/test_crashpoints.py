"""Crash points, enumerated, for every path on every backend (``python -m psguard.testbed.crashpoints``).

Each case runs the command as CI and BENCHMARKS.md do and prints its table: the crash points per path, all
passing. The paths, the recorders and the checks are tested piece by piece in tests/unit/testbed/crash/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from psguard.testbed.crashpoints import main, paths
from tests.support.paths import ROOT

#: Every path has at least this many points on the backend (a recorder that stopped seeing calls would pass).
LEAST = {"local": 20, "s3": 5, "tmpfs": 20}


def enumerate_all(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    report = tmp_path / "report.json"
    ran = subprocess.run(
        [sys.executable, "-m", "psguard.testbed.crashpoints", *args, "--json", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, **(env or {})},
        check=False,
    )
    with capsys.disabled():
        print(f"\n$ python -m psguard.testbed.crashpoints {' '.join(args)}\n{ran.stdout}", end="")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    reports: list[dict[str, Any]] = json.loads(report.read_text())["reports"]
    return reports


def assert_all_pass(reports: list[dict[str, Any]], backend: str) -> None:
    assert [r["path"] for r in reports] == [p.name for p in paths(backend)]
    for r in reports:
        assert r["passed"] and not r["failures"], r
        assert r["points"] >= LEAST[backend], r


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "lazyfs"), [("local", False), ("local", True), ("tmpfs", False)])
def test_every_crash_point_of_every_path_passes(
    backend: str, lazyfs: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--backend", backend, *(["--lazyfs"] if lazyfs else [])]
    assert_all_pass(enumerate_all(args, tmp_path, capsys), backend)


@pytest.mark.slow
def test_every_crash_point_of_every_store_path_passes_on_s3(
    seaweed: Any, unique: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--backend", "s3", "--s3-url", seaweed.url(unique)]
    assert_all_pass(enumerate_all(args, tmp_path, capsys, env=seaweed.env), "s3")


def test_lazyfs_is_for_the_local_backend_and_paths_must_exist(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--backend", "s3", "--lazyfs"])
    assert e.value.code == 2 and "--lazyfs applies to the local backend" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--backend", "tmpfs", "--paths", "spool-writer,gc"])
    assert e.value.code == 2 and "unknown path(s) ['gc'] for tmpfs" in capsys.readouterr().err
