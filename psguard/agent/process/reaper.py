"""Killing a task's whole process tree: while its agent runs, after the agent was SIGKILLed, and at a new start.

The parent-death signal reaches only the agent's direct child, nobody signals the group once the agent is gone,
and a process that calls ``setsid`` leaves it anyway. So:

* **Marked tree.** Every process a supervisor starts carries ``PSGUARD_TREE_<token>=1`` (random per supervisor;
  inherited), so ``/proc/<pid>/environ`` tells the task's processes whatever their group or parent, and a reused
  pid never matches. :func:`kill_tree` kills them until none is left.
* **Guard.** This file run as a script (the standard library only: it starts in milliseconds) holds the read end
  of a pipe only the agent writes; when the agent dies the guard reads EOF and kills the marked tree.
* **Subreaper.** The agent adopts its task's orphans (``PR_SET_CHILD_SUBREAPER``) and reaps them.
* **Record.** The token and the agent's identity (pid, start time, boot id) go to a file; a new agent kills what
  a dead predecessor's tree left if the guard could not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator

ENV_PREFIX = "PSGUARD_TREE_"
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def tree_env_var(token: str) -> str:
    """The environment variable marking the processes of one supervisor's tree."""
    if not token.isalnum():
        raise ValueError(f"tree token must be alphanumeric, got {token!r}")
    return f"{ENV_PREFIX}{token}"


def stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (which may contain spaces and parentheses); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if gone.

    With the boot id it names a process for good: a pid is reused, a (pid, start time) pair is not.
    """
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pids() -> Iterator[int]:
    return (int(entry) for entry in os.listdir("/proc") if entry.isdigit())


def _stats() -> Iterator[tuple[int, list[str]]]:
    """Each process's pid and its ``/proc/PID/stat`` fields after the command name: state, ppid, pgrp, session..."""
    return ((pid, fields) for pid in _pids() if (fields := stat_fields(pid)) is not None and len(fields) > 3)


def descendants(root: int) -> set[int]:
    """Every live descendant of ``root`` (zombies excluded: they hold nothing but a pid)."""
    parent_of = {pid: int(fields[1]) for pid, fields in _stats() if fields[0] != "Z"}
    out: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {p for p, pp in parent_of.items() if pp in frontier and p not in out}
        out |= frontier
    return out


def adopted_zombies(sessions: frozenset[int], *, spare: frozenset[int] = frozenset()) -> list[int]:
    """Exited children of this process that were in one of ``sessions`` (a task's runs): orphans a subreaper
    adopted. Only those: reaping a child some ``Popen`` owns would steal its exit status."""
    me = os.getpid()
    return [
        pid
        for pid, fields in _stats()
        if pid not in spare and fields[0] == "Z" and int(fields[1]) == me and int(fields[3]) in sessions
    ]


def reap(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def marked(token: str, *, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Live processes of this user whose environment carries the tree's mark (never this process)."""
    needle = tree_env_var(token).encode() + b"="
    me = os.getpid()
    out = []
    for pid in _pids():
        if pid == me or pid in exclude:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone, or another user's (which we could not signal anyway)
            continue
        alive = (fields := stat_fields(pid)) and fields[0] not in ("Z", "X")
        if (env.startswith(needle) or b"\0" + needle in env) and alive:
            out.append(pid)
    return sorted(out)


def kill_tree(token: str, *, exclude: frozenset[int] = frozenset(), timeout: float = 10.0) -> list[int]:
    """SIGKILL every marked process, again and again until none is left (a dying shell may still fork).

    Reaps those that are this process's children (a subreaper adopts orphans), except ``exclude``d ones,
    whose owners reap them. Returns the pids killed.
    """
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        pids = marked(token, exclude=exclude)
        if not pids:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                if pid not in killed:
                    killed.append(pid)
        reap(pids)  # ours only when adopted (subreaper) or started by us
        if time.monotonic() > deadline:
            return killed
        time.sleep(delay)  # SIGKILL is delivered asynchronously: look again until the kernel is done
        delay = min(delay * 2, 0.05)


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` (Linux); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def set_child_subreaper(enabled: bool = True) -> bool:
    """Make this process adopt its descendants' orphans (Linux), or stop (``enabled=False``: a process that
    ran a supervisor for a while, such as a test's); False where that is not possible."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, int(enabled))


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies: in a session of its own nothing else stops it
    when a SIGKILLed parent cannot clean up. A parent that died before the call never sends it: then exit now."""
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) and os.getppid() != parent_pid:
        os._exit(1)


def guard_main(token: str) -> int:
    """The guard: wait for EOF on stdin (the agent is gone or done), then kill the tree."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C in the agent's terminal must not disarm the guard
    with contextlib.suppress(OSError):
        while os.read(0, 4096):  # retried after a signal (PEP 475)
            pass
    killed = kill_tree(token)
    if killed:
        print(f"psguard reaper: killed {len(killed)} process(es) left by a dead agent: {killed}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "guard":
        raise SystemExit("usage: reaper.py guard TOKEN")
    raise SystemExit(guard_main(sys.argv[2]))
