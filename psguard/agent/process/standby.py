"""Warm standby: a task's next process, started ahead of need, waiting with TensorFlow already imported.

A PS restart is on the critical path of every recovery, and almost all of it is Python plus ``import tensorflow``
(seconds) while starting the server itself takes about 0.1 s. So whoever restarts a server task keeps one more
process of the same command started beforehand: it runs everything up to binding the port (not further: gRPC's
``SO_REUSEPORT`` would let two processes share the address), then waits on stdin for ``go``. The protocol is
:mod:`psguard.handoff.standby`; only commands known to honour it get a standby: the built-in server, and a trainer
run as ``python SCRIPT`` or ``python -m MODULE`` (:func:`warm_trainer_command`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from psguard.handoff.standby import GO, READY_ENV, STANDBY_ENV

log = logging.getLogger(__name__)

Popen = subprocess.Popen[bytes]


@dataclass(eq=False)
class Standby:
    """At most one waiting process of a command; :meth:`take` turns it into the running task.

    ``spawn(env_overrides)`` starts the process the owner would start anyway (same command, log, session and
    parent-death arrangements), with ``stdin=subprocess.PIPE`` and the overrides merged into its environment.
    Not thread-safe: the owner calls it from the one thread that starts its processes (the parent-death signal
    is tied to the thread that forked).
    """

    name: str
    spawn: Callable[[dict[str, str]], Popen]
    _: KW_ONLY
    # For standbys that read their environment after ``go`` (the warm trainer): what the task gets now.
    env_at_go: Callable[[], Mapping[str, str]] | None = None

    def __post_init__(self) -> None:
        self._proc: Popen | None = None
        self._ready_path: Path | None = None

    @property
    def ready(self) -> bool:
        """A standby is waiting and has done its preparation (imported TensorFlow): taking it is quick now."""
        path = self._ready_path
        return self.pid is not None and path is not None and path.exists()

    @property
    def pid(self) -> int | None:
        """The waiting process's pid, ``None`` when there is none (or it died)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def fill(self) -> bool:
        """Start a standby unless one is waiting. False when the spawn failed (the owner starts cold then)."""
        if self.pid is not None:
            return True
        self.discard()  # reap a dead one
        fd, name = tempfile.mkstemp(prefix="psguard-standby-", suffix=".ready")
        os.close(fd)
        self._ready_path = Path(name)
        self._ready_path.unlink()  # the standby creates it when it is ready
        try:
            self._proc = self.spawn({STANDBY_ENV: "1", READY_ENV: name})
        except OSError as e:
            log.warning("event=standby_spawn_failed task=%s error=%r", self.name, str(e))
            self._proc = None
            return False
        log.info("event=standby_started task=%s pid=%d", self.name, self._proc.pid)
        return True

    def take(self) -> Popen | None:
        """Hand the waiting process over as the task, told to go; ``None`` if there is no live standby."""
        proc, self._proc = self._proc, None
        self._forget_ready()
        if proc is None:
            return None
        if proc.poll() is not None:
            log.warning("event=standby_lost task=%s pid=%d exit_code=%s", self.name, proc.pid, proc.returncode)
            return None
        assert proc.stdin is not None
        try:
            env = b"" if self.env_at_go is None else json.dumps(dict(self.env_at_go())).encode() + b"\n"
            proc.stdin.write(GO + env)
            proc.stdin.close()
        except OSError as e:  # it died between poll() and the write
            log.warning("event=standby_lost task=%s pid=%d error=%r", self.name, proc.pid, str(e))
            _kill_and_reap(proc)
            return None
        log.info("event=standby_taken task=%s pid=%d", self.name, proc.pid)
        return proc

    def discard(self) -> None:
        """Kill and reap the waiting process, if any (its whole process group: it runs in its own session)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _kill_and_reap(proc)
        self._forget_ready()  # after the kill: a standby killed while getting ready could still create it

    def _forget_ready(self) -> None:
        path, self._ready_path = self._ready_path, None
        if path is not None:
            path.unlink(missing_ok=True)


_PYTHON = re.compile(r"python(3(\.\d+)?)?")


def warm_trainer_command(cmd: Sequence[str]) -> list[str] | None:
    """The command of a warm standby for trainer command ``cmd``, or ``None`` when ``cmd`` is not a plain
    ``python SCRIPT ARGS...`` or ``python -m MODULE ARGS...`` (then the trainer starts cold). The standby runs the
    same interpreter: where psguard is not importable by it, it dies at once and restarts are cold."""
    plain = len(cmd) >= 2 and _PYTHON.fullmatch(Path(cmd[0]).name) is not None
    if not plain or (cmd[1] == "-m" and len(cmd) < 3) or (cmd[1] != "-m" and cmd[1].startswith("-")):
        return None
    return [cmd[0], "-m", "psguard.trainer.warm", *cmd[1:]]


def _kill_and_reap(proc: Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    proc.wait()
