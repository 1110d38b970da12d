"""Resources of a run's processes and folders over time, and whether their growth would exhaust a node in a week.

What a week of training does that minutes of chaos cannot show: memory, threads, open files or child processes
that creep up per capture or per restart, files left on tmpfs, a store that outgrows its retention. A
:class:`ResourceSampler` samples, every few seconds, each process of the run by its role (``agent:chief``,
``server:ps:0``, ``trainer``; pids change across restarts, roles do not) and each folder that must stay bounded
(spool, tiers, store, logs). :func:`slope_per_hour` fits a least-squares line after a warm-up, and
:func:`week_projection` says what that slope makes of the resource in a week, for the soak checkers' bounds;
:func:`resource_lives` reads the samples back from a history, split at restarts, and :func:`series_bound` says
which bound judges each series (``resources-bounded`` in :mod:`psguard.chaos.checkers`).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psguard.chaos.history import Op, Record
from psguard.testbed.procs import descendants

__all__ = [
    "STORE_SETTLE",
    "THREADS_PER_RECOVERY",
    "ProcessUsage",
    "ResourceSampler",
    "folder_bytes",
    "less_recovery_threads",
    "process_usage",
    "recovery_times",
    "resource_lives",
    "resource_series",
    "series_bound",
    "slope_fit",
    "slope_per_hour",
    "week_projection",
]

WEEK_HOURS = 168.0


@dataclass(frozen=True)
class ProcessUsage:
    """One process at one moment: resident memory, threads, open file descriptors, live child processes."""

    rss_bytes: int
    threads: int
    fds: int
    children: int


def process_usage(pid: int) -> ProcessUsage | None:
    """``pid``'s usage from /proc, ``None`` when it is gone (or not ours to read)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        rss = int(fields["VmRSS"].split()[0]) * 1024
        threads = int(fields["Threads"].strip())
    except (KeyError, ValueError, IndexError):
        return None  # a zombie has no VmRSS
    return ProcessUsage(rss, threads, fds, len(descendants(pid)))


def folder_bytes(path: Path) -> tuple[int, int]:
    """Bytes and files under ``path`` (0, 0 when it does not exist); files that vanish meanwhile are skipped."""
    total = files = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
            files += 1
    return total, files


class ResourceSampler:
    """Samples ``processes()`` (role -> pid, asked anew each time) and ``folders`` every ``every`` seconds into
    ``record(time, series, value)``: series ``<role>/rss_bytes``, ``<role>/threads``, ``<role>/fds``,
    ``<role>/children``, ``folder:<name>/bytes`` and ``folder:<name>/files``."""

    def __init__(
        self,
        processes: Callable[[], Mapping[str, int]],
        folders: Mapping[str, Path],
        record: Callable[[float, str, float], None],
        *,
        every: float = 5.0,
    ) -> None:
        self._processes = processes
        self._folders = dict(folders)
        self._record = record
        self.every = every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, int]:
        """One sample of everything; returns role -> pid of the processes sampled (a new pid is a restart)."""
        now = time.time()
        sampled: dict[str, int] = {}
        for role, pid in sorted(self._processes().items()):
            usage = process_usage(pid)
            if usage is None:
                continue
            sampled[role] = pid
            for key in ("rss_bytes", "threads", "fds", "children"):
                self._record(now, f"{role}/{key}", float(getattr(usage, key)))
        for name, path in sorted(self._folders.items()):
            size, files = folder_bytes(path)
            self._record(now, f"folder:{name}/bytes", float(size))
            self._record(now, f"folder:{name}/files", float(files))
        return sampled

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="chaos-resources", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every):
                return

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=30.0)


def slope_per_hour(points: Sequence[tuple[float, float]], *, warmup: float = 0.0) -> float | None:
    """Least-squares slope (units per hour) of ``(time, value)`` after ``warmup`` seconds from the first point;
    ``None`` with fewer than 3 points left or no spread in time."""
    fit = slope_fit(points, warmup=warmup)
    return None if fit is None else fit[0]


def slope_fit(points: Sequence[tuple[float, float]], *, warmup: float = 0.0) -> tuple[float, float] | None:
    """The least-squares slope per hour after ``warmup`` and its standard error (per hour): a slope within two
    standard errors of a bound is not evidence of crossing it (a restart's step, a burst of threads, noise)."""
    if not points:
        return None
    start = min(t for t, _ in points)
    kept = [(t, v) for t, v in points if t - start >= warmup]
    if len(kept) < 3:
        return None
    mean_t = sum(t for t, _ in kept) / len(kept)
    mean_v = sum(v for _, v in kept) / len(kept)
    spread = sum((t - mean_t) ** 2 for t, _ in kept)
    if spread <= 0:
        return None
    slope = sum((t - mean_t) * (v - mean_v) for t, v in kept) / spread
    residual = sum((v - mean_v - slope * (t - mean_t)) ** 2 for t, v in kept)
    stderr = (residual / (len(kept) - 2) / spread) ** 0.5
    return slope * 3600.0, stderr * 3600.0


def week_projection(points: Sequence[tuple[float, float]], *, warmup: float = 0.0) -> float | None:
    """The value a week after the last point if the fitted slope held (never below the last value)."""
    slope = slope_per_hour(points, warmup=warmup)
    if slope is None:
        return None
    last = max(points)[1]
    return last + max(0.0, slope) * WEEK_HOURS


# ------------------------------------------------------------------------------------- judging a soak's samples
def resource_series(records: Iterable[Record]) -> dict[str, list[tuple[float, float]]]:
    """A soak's resource samples (``resources`` of the harness) as series name -> [(time, value)]."""
    return {name: [p for _, life in lives for p in life] for name, lives in resource_lives(records).items()}


def resource_lives(records: Iterable[Record]) -> dict[str, list[tuple[Any, list[tuple[float, float]]]]]:
    """The samples of each series split at its process's restarts (a new pid for its role; the samples say
    which since ``pids`` was recorded, a history without it is one life per series): series -> [(pid, life)].
    A restart resets what a process kept per recovery (:func:`less_recovery_threads`)."""
    out: dict[str, list[tuple[Any, list[tuple[float, float]]]]] = {}
    for r in records:
        if r.process == "harness" and r.f == "resources" and r.type == "ok":
            pids = r.value.get("pids") or {}
            for name, v in (r.value.get("values") or {}).items():
                pid = pids.get(name.rpartition("/")[0])
                lives = out.setdefault(name, [])
                if not lives or lives[-1][0] != pid:
                    lives.append((pid, []))
                lives[-1][1].append((r.time, float(v)))
    return out


def recovery_times(restores: Iterable[Op]) -> list[float]:
    """When each in-process recovery began, from the trainers' ``restore`` ops: a restore of a trainer process
    after its first (its start)."""
    by_process: dict[str, list[float]] = {}
    for o in restores:
        if o.process.startswith("trainer-"):
            by_process.setdefault(o.process, []).append(o.invoke.time)
    return sorted(t for times in by_process.values() for t in sorted(times)[1:])


def less_recovery_threads(
    recoveries: Sequence[float], life: list[tuple[float, float]], each: float
) -> list[tuple[float, float]]:
    """A life's thread counts without ``each`` per recovery since the life began: TensorFlow keeps threads
    behind at every ``update_server_def`` in the trainer and in every worker it reaches (4 on TF 2.21, whatever
    the cluster's size; PS servers restart at each recovery), a cost per fault, not per hour, that psguard
    cannot free (tests/cluster/test_recovery.py measures it)."""
    if not life:
        return life
    first = bisect.bisect_left(recoveries, life[0][0])
    return [(t, v - each * (bisect.bisect_right(recoveries, t) - first)) for t, v in life]


#: :attr:`psguard.chaos.scenario.SoakBounds.store_settle`'s default (the checkers read records, not scenarios).
STORE_SETTLE = 660.0
#: :attr:`psguard.chaos.scenario.SoakBounds.threads_per_recovery`'s default.
THREADS_PER_RECOVERY = 4.0


def series_bound(name: str, bounds: Mapping[str, Any], state_bytes: float) -> tuple[float, str] | None:
    """The per-hour slope a series may have, with the unit it is judged in; ``None``: not judged by slope."""
    role, _, key = name.rpartition("/")
    mb = float(1 << 20)
    if role.startswith("folder:"):
        folder = role.removeprefix("folder:")
        if key != "bytes":
            return None
        which = "logs_mb" if folder == "logs" else "store_mb" if folder == "store" else "tmpfs_mb"
        return float(bounds[which]) * mb, "bytes"
    if key == "rss_bytes":
        if role.startswith("agent:"):
            share = float(bounds["agent_rss_pct_of_state"]) / 100.0 * state_bytes
            return max(share, float(bounds.get("agent_rss_floor_mb", 0.0)) * mb), "bytes"
        return float(bounds["process_rss_mb"]) * mb, "bytes"
    if key in ("fds", "threads"):
        return float(bounds[key]), key
    return None  # children: a count that steps with every restart and standby, judged by its maximum
