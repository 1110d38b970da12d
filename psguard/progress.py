"""Progress of long CLI work (verify, export, compact, copy) on stderr: bytes done, bytes/s and ETA.

On a terminal it is a tqdm bar; otherwise (a log file, a CI job, a pod's log) a plain line at most every
``interval`` seconds with the same figures, and one at the end when any was printed, so logs stay short.
``quiet`` prints nothing. Updates may come from I/O threads; the results a command prints go through
:meth:`Progress.write` so they do not tear the bar.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

#: Seconds between two plain progress lines.
PLAIN_INTERVAL = 5.0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """Silent progress (``--quiet``); the base of the two that show something."""

    def update(self, nbytes: int) -> None:
        """``nbytes`` more are done (thread-safe)."""

    def write(self, line: str) -> None:
        """Print a result line on stdout, now."""
        print(line, flush=True)

    def close(self) -> None:
        """The work is over (or failed): finish the bar or the lines."""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PlainProgress(Progress):
    """A line such as ``verify: 12.0 MiB of 40.0 MiB (30%), 5.1 MiB/s, ETA 6s`` at most every ``interval``."""

    def __init__(
        self,
        what: str,
        total: int,
        stream: TextIO,
        *,
        interval: float = PLAIN_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.stream, self.interval, self.clock = what, total, stream, interval, clock
        self.done = 0
        self.started = clock()
        self.last_line = self.started
        self.lines = 0
        self._lock = threading.Lock()

    def _line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        head = f"{self.what}: {human_bytes(self.done)}"
        if self.total > 0:
            pct = min(100.0, 100.0 * self.done / self.total)
            left = max(self.total - self.done, 0)
            eta = _duration(left / rate) if rate > 0 else "?"
            return f"{head} of {human_bytes(self.total)} ({pct:.0f}%), {human_bytes(rate)}/s, ETA {eta}"
        return f"{head}, {human_bytes(rate)}/s"

    def update(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = self.clock()
            if now - self.last_line < self.interval:
                return
            self.last_line = now
            self.lines += 1
            line = self._line(now)
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        with self._lock:
            if not self.lines:
                return
            line = f"{self.what}: done, {human_bytes(self.done)} in {_duration(self.clock() - self.started)}"
            self.lines = 0
        print(line, file=self.stream, flush=True)


class BarProgress(Progress):
    """A tqdm bar on a terminal."""

    def __init__(self, what: str, total: int, stream: TextIO) -> None:
        from tqdm import tqdm

        try:  # a terminal of size 0x0 (a fresh pty) would get an empty bar
            ncols = None if os.get_terminal_size(stream.fileno()).columns else 80
        except (OSError, ValueError):
            ncols = 80
        self._bar = tqdm(
            total=total or None,
            desc=what,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=stream,
            leave=False,
            ncols=ncols,
        )
        self._lock = threading.Lock()

    def update(self, nbytes: int) -> None:
        with self._lock:
            self._bar.update(nbytes)

    def write(self, line: str) -> None:
        with self._lock:
            self._bar.write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        with self._lock:
            self._bar.close()


def open_progress(what: str, total: int, *, quiet: bool = False, stream: TextIO | None = None) -> Progress:
    """The progress display that suits ``stream`` (stderr by default): nothing, a bar, or plain lines."""
    stream = stream if stream is not None else sys.stderr
    if quiet:
        return Progress()
    if stream.isatty():
        return BarProgress(what, total, stream)
    return PlainProgress(what, total, stream, interval=PLAIN_INTERVAL)
