"""Processes as /proc shows them: what a harness needs to prove that nothing it started outlived it (the walk is
the agent's own, :func:`psguard.agent.process.reaper.descendants`)."""

from __future__ import annotations

from psguard.agent.process.reaper import descendants, stat_fields

__all__ = ["alive", "descendants"]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = stat_fields(pid)
    return fields is not None and bool(fields) and fields[0] != "Z"
