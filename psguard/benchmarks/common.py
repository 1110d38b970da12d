"""Timing and memory helpers shared by the benchmarks."""

from __future__ import annotations

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


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


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
