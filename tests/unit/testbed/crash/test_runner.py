"""The enumeration (psguard.testbed.crash.runner) on small made-up paths: it finds what it must find.

The runner forks a child per point, so each test runs it in a child process of its own (this module, run as a
script) rather than in pytest's, which may hold threads.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from psguard.errors import ObjectNotFoundError
from psguard.storage import open_backend
from psguard.testbed.crash.runner import CrashPath, Target, enumerate_path, normalized
from psguard.testbed.crash.session import Run, Session
from tests.support.paths import ROOT


# ------------------------------------------------------------------------------------------------ made-up paths
def honest(session: Session) -> None:
    """Write an object, then say so."""
    with session.store() as store:
        session.begin()
        session.invoke("write")
        store.backend.put("objects/one", b"written")
        session.ok("write")


def eager(session: Session) -> None:
    """Say so, then write it: an acknowledgement before the commit."""
    with session.store() as store:
        session.begin()
        session.invoke("write")
        session.ok("write")
        store.backend.put("objects/one", b"written")


def wandering(session: Session) -> None:
    """Not the same calls twice."""
    with session.store() as store:
        session.begin()
        store.backend.put(f"objects/{random.choice('ghijklmnopqrstuvwxyz') * 12}", b"x")


def check(run: Run, _: Any) -> list[str]:
    acked = any(line and json.loads(line)["type"] == "ok" for line in run.history.read_text().split("\n"))
    backend = open_backend(run.url, run.options)
    try:
        return [] if not acked or backend.get("objects/one") == b"written" else ["the acknowledged object is wrong"]
    except ObjectNotFoundError:
        return ["the acknowledged object is lost"]


WORKLOADS = {"honest": honest, "eager": eager, "wandering": wandering}


def roots(run: Run) -> list[Path]:
    return [run.store_root]


def main() -> None:
    workload, lazyfs, fsync = sys.argv[1], sys.argv[2] == "lazyfs", sys.argv[3] == "fsync"
    workdir = Path(tempfile.mkdtemp(dir=sys.argv[4]))
    target = Target("local", workdir, lazyfs=lazyfs, options={"fsync": fsync})
    report = enumerate_path(CrashPath(workload, WORKLOADS[workload], check, roots), target, jobs=2)
    print(json.dumps(report.to_json()))


# ------------------------------------------------------------------------------------------------ tests
def enumerate_in_child(tmp_path: Path, workload: str, *, lazyfs: bool = False, fsync: bool = True) -> dict[str, Any]:
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.unit.testbed.crash.test_runner",
            workload,
            "lazyfs" if lazyfs else "crash",
            "fsync" if fsync else "no-fsync",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    report: dict[str, Any] = json.loads(ran.stdout)
    return report


def test_every_call_is_a_point_and_an_honest_write_passes_them_all(tmp_path: Path) -> None:
    report = enumerate_in_child(tmp_path, "honest")
    assert [normalized(c) for c in report["calls"]] == [
        "put objects/one: mkdir store/objects",
        "put objects/one: fsync store",
        "put objects/one: open store/objects/one.tmp.#",
        "put objects/one: write store/objects/one.tmp.#",
        "put objects/one: fsync store/objects/one.tmp.#",
        "put objects/one: rename store/objects/one.tmp.# -> store/objects/one",
        "put objects/one: fsync store/objects",
    ]
    assert report["passed"] and report["points"] == 7


def test_an_acknowledgement_before_its_write_fails_at_the_points_in_between(tmp_path: Path) -> None:
    report = enumerate_in_child(tmp_path, "eager")
    assert not report["passed"]
    assert [f["point"] for f in report["failures"]] == [1, 2, 3, 4, 5]  # until the rename made it visible
    assert all(f["problems"] == ["the acknowledged object is lost"] for f in report["failures"])


def test_a_store_that_does_not_fsync_loses_an_acknowledged_write_in_a_power_cut_only(tmp_path: Path) -> None:
    assert enumerate_in_child(tmp_path, "honest", fsync=False)["passed"]
    report = enumerate_in_child(tmp_path, "honest", lazyfs=True, fsync=False)
    assert [f["point"] for f in report["failures"]] == [report["points"]]  # once acknowledged: at the end
    assert report["failures"][0]["problems"] == ["the acknowledged object is lost"]
    assert enumerate_in_child(tmp_path, "honest", lazyfs=True)["passed"]


def test_a_run_that_makes_other_calls_than_the_recorded_one_fails(tmp_path: Path) -> None:
    report = enumerate_in_child(tmp_path, "wandering")
    problems = [p for f in report["failures"] for p in f["problems"]]
    assert problems and all("diverged from the recorded one" in p for p in problems)


if __name__ == "__main__":
    main()
