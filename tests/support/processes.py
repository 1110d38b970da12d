"""Processes as tests see them: waiting on observable conditions, /proc read one way, and the leak checks'
record of the processes a test may leave running (session servers).

Linux only, as psguard's process handling is: everything here reads ``/proc``, never guesses at timing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from psguard.testbed.procs import descendants


def wait_until(
    condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition", every: float = 0.02
) -> Any:
    """Poll ``condition`` (an observable state, not a guess at timing) until truthy, and return its value; fail
    the test with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout}s")
        time.sleep(every)


# ----------------------------------------------------------------------------------------------- /proc
def stat_fields(pid: int | str) -> list[str]:
    """``/proc/PID/stat`` after the command name (which may hold spaces and parentheses): state, ppid, pgrp, ...
    Raises OSError once the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def proc_state(pid: int) -> str:
    """The one-letter state (R, S, T, Z, ...); OSError once the process is gone."""
    return stat_fields(pid)[0]


def parent_pid(pid: int) -> int | None:
    """The parent's pid, or None once the process is gone."""
    try:
        return int(stat_fields(pid)[1])
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """The process exists and is neither a zombie nor dead (a zombie holds nothing but its pid)."""
    try:
        return proc_state(pid) not in ("Z", "X")
    except OSError:
        return False


def cmdline(pid: int) -> str:
    """The command line, arguments joined by spaces; "" once the process is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def all_pids() -> Iterator[int]:
    """Every pid in /proc at this moment (some may be gone by the time they are read)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def pids_mentioning(text: str) -> list[int]:
    """Pids whose command line mentions ``text`` (a cluster's work folder is on every daemon's command line)."""
    found = []
    for pid in all_pids():
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in line:
            found.append(pid)
    return found


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid``."""
    pids = []
    for pid in all_pids():
        try:
            fields = stat_fields(pid)
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pids.append(pid)
    return pids


# ----------------------------------------------------------------------------------------------- leak checks
#: Processes the leak checks ignore: long-lived servers started inside :func:`allow_new_children`.
ALLOWED_PIDS: set[int] = set()


def children(pid: int | None = None) -> set[int]:
    """Every live descendant of ``pid`` (this process by default)."""
    return descendants(os.getpid() if pid is None else pid)


@contextlib.contextmanager
def allow_new_children() -> Iterator[None]:
    """Exempt from leak checks the processes started inside this block (long-lived servers)."""
    before = children()
    try:
        yield
    finally:
        ALLOWED_PIDS.update(children() - before)
