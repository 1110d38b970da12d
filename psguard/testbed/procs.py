"""Processes as /proc shows them: what a harness needs to prove that nothing it started outlived it."""

from __future__ import annotations

import os


def _stat_fields(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (which may contain spaces and parentheses); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(root: int) -> set[int]:
    """Every live descendant of ``root`` (zombies excluded: they hold nothing but a pid)."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None and fields[0] != "Z":
            parent_of[int(entry)] = int(fields[1])
    out: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {p for p, pp in parent_of.items() if pp in frontier and p not in out}
        out |= frontier
    return out


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"
