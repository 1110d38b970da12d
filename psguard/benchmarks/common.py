"""Timing and memory helpers shared by the benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any


def progress(msg: str) -> None:
    """Progress goes to stderr so ``--json`` output on stdout stays parseable."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(runs: int, a: Callable[[int], float], b: Callable[[int], float]) -> tuple[list[float], list[float]]:
    """Run ``a`` and ``b`` alternately ``runs`` times each, so drift in machine load hits both alike."""
    xs: list[float] = []
    ys: list[float] = []
    for i in range(runs):
        if i % 2 == 0:
            xs.append(a(i))
            ys.append(b(i))
        else:
            ys.append(b(i))
            xs.append(a(i))
    return xs, ys


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


#: Training is back at normal speed when a stretch of steps runs at most this many times slower per step than
#: the median stretch before the fault. The benchmark, the demo and the chaos report all use this definition.
NORMAL_FACTOR = 3.0

#: A stretch of training: (start time, end time, steps done). Anything between the end of one stretch and the
#: end of the next (a capture, a stall) counts in the next one.
Stretch = tuple[float, float, int]


def seconds_per_step(
    stretches: Iterable[Stretch], *, excluded: Callable[[float, float], float] | None = None
) -> float | None:
    """The median seconds per step over ``stretches``, each measured from the end of the one before
    (``excluded`` as in :func:`back_to_normal`)."""
    rates: list[float] = []
    prev_end: float | None = None
    for start, end, steps in stretches:
        begin = start if prev_end is None else prev_end
        if steps > 0:
            rates.append((end - begin - (excluded(begin, end) if excluded is not None else 0.0)) / steps)
        prev_end = end
    return median(rates) if rates else None


def back_to_normal(
    stretches: Iterable[Stretch],
    normal: float | None,
    *,
    not_before: float,
    factor: float = NORMAL_FACTOR,
    excluded: Callable[[float, float], float] | None = None,
) -> float | None:
    """When training ran at normal speed again after a fault: the end of the first stretch that ends after
    ``not_before`` and ran no slower than ``factor`` x ``normal`` seconds per step, counting the time since
    the previous stretch ended (so a slow capture between two stretches delays it).

    ``stretches``: those after the fault, in order. ``not_before``: e.g. the end of the first capture after the
    restore (a recovery is not over while the first capture is still tracing or reading the whole model).
    ``None`` when it never happened (or no ``normal`` speed is known). ``excluded(begin, end)``: seconds of that
    span that are not the job's (the chaos harness's own digests), left out of its pace.
    """
    if normal is None:
        return None
    prev_end: float | None = None
    for start, end, steps in stretches:
        begin = start if prev_end is None else prev_end
        prev_end = end
        spent = end - begin - (excluded(begin, end) if excluded is not None else 0.0)
        if end >= not_before and steps > 0 and spent / steps <= factor * normal:
            return end
    return None


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def settle_rss() -> None:
    """Hand the memory freed so far back to the kernel (a collection, then glibc's ``malloc_trim``), so that an RSS
    read next counts live memory only.

    Why: building the 1 GB testbed model peaks at ~0.8x the table and frees most of it again, and glibc returns
    that to the kernel when it happens to trim. An RSS read right after the build was 605 MB in one run and
    649 MB in the next with the same code, and psguard's growth counted from there 45 MB against 5 MB at the same
    absolute peak (~650 MB): the 0.047-0.067 spread of ``chief_peak_rss_growth_ratio`` came from this, not from
    psguard. Both sides of a benchmark call it before reading their start.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the read stays as it was
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss_bytes(field: str = "VmRSS", pid: int | str = "self") -> int:
    """``field`` (``VmRSS``, ``VmHWM``: the kernel's peak) of process ``pid`` from ``/proc/<pid>/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


class RssWatch:
    """Peak RSS growth of other processes, sampled from ``/proc/<pid>/status`` while they run.

    ``start(name, pid)`` takes the process's RSS now as its start (call it before the process holds the data
    being measured) and resets its kernel peak mark when allowed (same user), so ``VmHWM`` then counts from
    there; ``sample()`` (call it often) keeps the largest ``VmHWM``/``VmRSS`` seen, so a peak between two
    samples is not missed and a process that has exited keeps its last figures.
    """

    def __init__(self) -> None:
        self.start_rss: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._pids: dict[str, int] = {}

    def start(self, name: str, pid: int, rss: int | None = None) -> None:
        """Watch ``pid`` as ``name``; ``rss``: its start-up RSS when the process measured it itself."""
        try:
            if rss is None:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
            self.start_rss[name] = rss if rss is not None else rss_bytes("VmRSS", pid)
        except (OSError, RuntimeError):
            return  # gone already: nothing to watch
        self._pids[name] = pid
        self.sample()

    def sample(self) -> None:
        for name, pid in list(self._pids.items()):
            try:
                now = max(rss_bytes("VmHWM", pid), rss_bytes("VmRSS", pid))
            except (OSError, RuntimeError):
                continue  # exited: its peak so far stays
            self.peak[name] = max(self.peak.get(name, 0), now)

    def growth(self, name: str) -> int:
        """Peak minus start-up RSS of ``name`` (0 if never seen)."""
        return max(0, self.peak.get(name, 0) - self.start_rss.get(name, 0))

    def growth_now(self, name: str) -> int | None:
        """RSS now minus start-up RSS of ``name``: what it holds at a quiet moment, apart from the transients of
        its peak (None when not watched or gone)."""
        pid = self._pids.get(name)
        if pid is None or name not in self.start_rss:
            return None
        try:
            return rss_bytes("VmRSS", pid) - self.start_rss[name]
        except (OSError, RuntimeError):
            return None


def parse_size(text: str) -> int:
    """``64M``, ``1.5G``, ``512MiB``, ``2gb`` or a plain byte count -> bytes (binary units: 1G = 2**30)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in "KMGT" and t[-1:] else t
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 64M, 1G, 2G)") from None
    if value <= 0:
        raise ValueError(f"not a positive size: {text!r}")
    return int(value * scale)


def print_results(results: Mapping[str, Any], *, as_json: bool, keys: Iterable[str] | None = None) -> None:
    """One JSON object (``--json``), or one aligned ``key value`` line per result (``keys``: which, in order)."""
    if as_json:
        print(json.dumps(results, indent=2))
        return
    names = list(keys) if keys is not None else list(results)
    width = max((len(k) for k in names), default=0) + 2
    for k in names:
        v = results.get(k)
        print(f"{k:{width}} {v:.4g}" if isinstance(v, float) else f"{k:{width}} {v}")
