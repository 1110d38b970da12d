"""The /proc walks the agent (and the test bed, through it) relies on, on real processes."""

from __future__ import annotations

import os
import subprocess
import sys

from psguard.agent.process.reaper import descendants, start_ticks, stat_fields
from psguard.testbed.procs import alive


def test_descendants_are_every_live_generation_below_a_process_and_no_zombie() -> None:
    # A child that starts a grandchild, prints its pid, and waits: two generations below this process.
    script = "import subprocess, sys; g = subprocess.Popen(['sleep', '60']); print(g.pid, flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", script + "; g.kill(); g.wait()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert {child.pid, grandchild} <= descendants(os.getpid())
        assert descendants(child.pid) == {grandchild}
        assert alive(grandchild) and start_ticks(grandchild) is not None
        assert (stat_fields(child.pid) or [""])[1] == str(os.getpid())  # the parent pid, after a name with spaces
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
    assert not alive(child.pid) and stat_fields(child.pid) is None  # reaped: gone
    zombie = subprocess.Popen(["true"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet: a zombie
    assert (stat_fields(zombie.pid) or [""])[0] == "Z"
    assert not alive(zombie.pid) and zombie.pid not in descendants(os.getpid())
    zombie.wait()
