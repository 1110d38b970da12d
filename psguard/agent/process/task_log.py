"""The task's log file (``task_log:``), kept under a size bound for a job that runs for weeks.

The task writes to the file itself (``O_APPEND``), so an agent that dies cannot stall its trainer. The bound is
kept as logrotate's ``copytruncate`` keeps it: past ``max_bytes`` the file is copied to ``<file>.1`` (older copies
shifted up to ``keep``) and truncated in place, losing the lines written in between (milliseconds, once per
``max_bytes``). Checked before each run and every ``check_every`` seconds while it runs.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

log = logging.getLogger(__name__)


class TaskLog:
    """One task's log file with its rotated copies; :meth:`open` for each run, :meth:`start` the periodic check."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int, keep: int, check_every: float = 10.0) -> None:
        if max_bytes < 1 or keep < 0:
            raise ValueError(f"task log: max_bytes must be >= 1 and keep >= 0, got {max_bytes}, {keep}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.check_every = check_every
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self) -> int:
        """A file descriptor for the next run's stdout and stderr (the caller closes its copy after the spawn).

        Owner-only, like every file psguard creates: task output can hold paths, hosts and the user's prints.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rotate_if_full()
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def rotate_if_full(self) -> bool:
        """Copy and truncate when the file has reached ``max_bytes``; True when it did."""
        with self._lock:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                return False
            if size < self.max_bytes:
                return False
            try:
                self._shift()
                if self.keep:
                    shutil.copyfile(self.path, self._copy(1))
                    os.chmod(self._copy(1), 0o600)
                with open(self.path, "r+b") as f:
                    f.truncate(0)
            except OSError as e:  # a full disk is why we rotate; never let the log take the agent down
                log.warning("event=task_log_rotate_failed path=%s error=%r", self.path, str(e))
                return False
            log.info("event=task_log_rotated path=%s bytes=%d keep=%d", self.path, size, self.keep)
            return True

    def _copy(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    def _shift(self) -> None:
        self._copy(max(self.keep, 1)).unlink(missing_ok=True)  # the oldest goes; the others move up one
        for n in range(self.keep - 1, 0, -1):
            if self._copy(n).exists():
                self._copy(n).replace(self._copy(n + 1))

    def start(self) -> None:
        """Check the size every ``check_every`` seconds until :meth:`stop`."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"task-log-{self.path.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.check_every):
            self.rotate_if_full()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5.0)
