"""The enumeration: a path's run recorded once, then crashed at each of its points, each crash checked.

Processes. The enumerating process imports everything and starts no thread, so it can :func:`os.fork` a child per
crash point in milliseconds (a fresh interpreter with numpy and the store takes 0.5 s, with s3fs 1.2 s: longer
than most points take). Each point's child forks the run, waits for it to die (a real process death: its
threads, descriptors and locks go with it), puts the LazyFS image in place of a local store when asked, and
then checks what is left as a fresh process would, writing its verdict to a file. ``jobs`` points run at once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import select
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psguard.testbed.crash.lazyfs import restore_image
from psguard.testbed.crash.recorder import CRASHED, CrashPlan
from psguard.testbed.crash.session import Run, Session

__all__ = ["CrashPath", "PathReport", "PointResult", "Target", "enumerate_path"]

#: A run or a check taking longer than this has hung (a point takes well under a second).
RUN_TIMEOUT = 120.0


@dataclass(frozen=True)
class CrashPath:
    """One path of the product, as the enumeration runs it.

    ``roots(run)``: the folders whose file-system calls are its crash points (none: a store's requests are).
    ``setup(run)``: in the checking process before the run is forked, without starting a thread (what another
    process holds while the run runs, such as a live trainer's lock); its value goes to ``check(run, value)``.
    """

    name: str
    workload: Callable[[Session], None]
    check: Callable[[Run, Any], list[str]]
    roots: Callable[[Run], Sequence[Path]]
    setup: Callable[[Run], Any] | None = None
    seed: int = 0


@dataclass(frozen=True)
class Target:
    """Where the runs of a path happen: a store backend (``local``, ``s3``) or ``tmpfs`` (the hand-off paths)."""

    backend: str
    workdir: Path  # one folder per run under it
    lazyfs: bool = False
    s3_url: str = ""  # s3: the prefix under which each run gets its own
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.backend}+lazyfs" if self.lazyfs else self.backend

    def run(self, path: str, point: int | None, seed: int = 0) -> Run:
        name = f"{path}-{'record' if point is None else point}"
        folder = self.workdir / self.label / name
        folder.mkdir(parents=True)
        if self.backend == "s3":
            url = f"{self.s3_url.rstrip('/')}/{self.label}-{name}-{uuid.uuid4().hex[:8]}"
        else:
            url = str(folder / "store")
            if self.backend == "local":
                os.mkdir(url)  # the folder a user points psguard at: there before the run, durable
        return Run(folder, url, self.backend, self.lazyfs and point is not None, seed, self.options)


@dataclass(frozen=True)
class PointResult:
    point: int  # 0: the recorded run, which is not crashed
    call: str  # the call the point follows
    problems: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"point": self.point, "call": self.call, "problems": list(self.problems)}


@dataclass(frozen=True)
class PathReport:
    path: str
    backend: str
    calls: tuple[str, ...]  # the recorded run's mutating calls: point k follows calls[k - 1]
    failures: tuple[PointResult, ...]
    seconds: float

    @property
    def points(self) -> int:
        return len(self.calls)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "backend": self.backend,
            "points": self.points,
            "passed": self.passed,
            "seconds": round(self.seconds, 2),
            "calls": list(self.calls),
            "failures": [f.to_json() for f in self.failures],
        }


def normalized(call: str) -> str:
    """A call with its random parts (hashes, ids, temporary names) blanked, to compare two runs' calls."""
    return re.sub(r"[0-9a-f]{8,}", "#", call)


# ------------------------------------------------------------------------------------------------ the children
def _quiet(run: Run, name: str) -> None:
    """The child's output and log go to a file in its run folder, not the enumeration's report."""
    fd = os.open(run.dir / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)


def _child(body: Callable[[], None]) -> int:
    """Fork a child that runs ``body`` and exits 0 (1 with the traceback on stderr): it never returns here."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def _wait(pid: int, timeout: float) -> int | None:
    """The child's wait status, or None once ``timeout`` passed (it is then killed and reaped)."""
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    return os.waitpid(pid, 0)[1]


def _run(path: CrashPath, run: Run, point: int | None) -> None:
    """The run itself, in its own process: recorders on, the workload, the end (or the crash before it)."""
    _quiet(run, "run.log")
    plan = CrashPlan(point, run.crash_record)
    session = Session(run, plan, path.roots(run))
    path.workload(session)
    plan.finish()
    (run.dir / "trace.json").write_text(json.dumps(plan.calls))


def _point(path: CrashPath, run: Run, point: int | None, calls: Sequence[str]) -> None:
    """One crash point, in its own process: the run forked and waited for, the crash's image, the check."""
    _quiet(run, "check.log")
    context = path.setup(run) if path.setup is not None else None
    status = _wait(_child(functools.partial(_run, path, run, point)), RUN_TIMEOUT)
    problems: list[str] = []
    follows = ""
    if status is None:
        problems.append(f"the run did not end within {RUN_TIMEOUT:.0f}s")
    elif point is None:
        if os.waitstatus_to_exitcode(status) != 0:
            problems.append(f"the run failed (exit {os.waitstatus_to_exitcode(status)}): see {run.dir / 'run.log'}")
    elif os.waitstatus_to_exitcode(status) != CRASHED:
        problems.append(f"the run did not crash at point {point} (exit {os.waitstatus_to_exitcode(status)})")
    else:
        record = json.loads(run.crash_record.read_text())
        follows = str(record["after"])
        if record["point"] != point or normalized(follows) != normalized(calls[point - 1]):
            problems.append(f"the run diverged from the recorded one: point {point} followed {follows!r}")
        if run.lazyfs:
            restore_image(json.loads(run.image.read_text()), run.store_root)
    if not problems:
        problems += path.check(run, context)
    doc = {"call": follows, "problems": problems}
    (run.dir / "result.json").write_text(json.dumps(doc))


# ------------------------------------------------------------------------------------------------ the enumeration
def enumerate_path(path: CrashPath, target: Target, *, jobs: int = 2) -> PathReport:
    """Record ``path``'s run on ``target``, crash it at each of its points, check each: the report."""
    started = time.monotonic()
    record = target.run(path.name, None, path.seed)
    recorded = _collect(path, {0: (record, None)}, (), jobs)
    calls: tuple[str, ...] = ()
    trace = record.dir / "trace.json"
    if trace.exists():
        calls = tuple(json.loads(trace.read_text()))
    failures = [r for r in recorded if r.problems]
    if not failures:
        runs = {k: (target.run(path.name, k, path.seed), k) for k in range(1, len(calls) + 1)}
        failures = [r for r in _collect(path, runs, calls, jobs) if r.problems]
    return PathReport(path.name, target.label, calls, tuple(failures), time.monotonic() - started)


def _collect(
    path: CrashPath, runs: Mapping[int, tuple[Run, int | None]], calls: Sequence[str], jobs: int
) -> list[PointResult]:
    """Run the points ``jobs`` at a time, each in a child; their results in point order."""
    pending = sorted(runs)
    running: dict[int, tuple[int, int, float]] = {}  # pidfd -> (pid, point, deadline)
    results: list[PointResult] = []

    def finished(point: int, problems: list[str]) -> None:
        run = runs[point][0]
        result = run.dir / "result.json"
        call = calls[point - 1] if point else "(none: the recorded run)"
        if not problems and not result.exists():
            problems = [f"the check ended without a verdict: see {run.dir / 'check.log'}"]
        elif not problems:
            problems = json.loads(result.read_text())["problems"]
        results.append(PointResult(point, call, tuple(problems)))

    while pending or running:
        while pending and len(running) < jobs:
            point = pending.pop(0)
            run, crash_at = runs[point]
            pid = _child(functools.partial(_point, path, run, crash_at, calls))
            running[os.pidfd_open(pid)] = (pid, point, time.monotonic() + 2 * RUN_TIMEOUT)
        soonest = min(deadline for _, _, deadline in running.values())
        ready, _, _ = select.select(list(running), [], [], max(0.0, soonest - time.monotonic()))
        for fd in list(running):
            pid, point, deadline = running[fd]
            if fd in ready:
                os.waitpid(pid, 0)
                finished(point, [])
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                finished(point, [f"the check did not end within {2 * RUN_TIMEOUT:.0f}s"])
            else:
                continue
            os.close(fd)
            del running[fd]
    return sorted(results, key=lambda r: r.point)
