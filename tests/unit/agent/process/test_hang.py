"""The hang watch reads the trainer's heartbeat without ever waiting on it (the watch runs on real time: its
judgement is tested with a real trainer in tests/cluster/test_hang.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from psguard.agent.process.hang import Hang, HangWatch
from tests.support.fifos import Fifos


def test_a_fifo_as_the_heartbeat_is_not_waited_on(tmp_path: Path, fifos: Fifos) -> None:
    """It kept the watch's thread, and the agent's stop that joins it, blocked for good (SIGTERM ignored)."""
    heartbeat = tmp_path / "heartbeat.json"
    fifos.put(heartbeat)
    hangs: list[Hang] = []
    watch = HangWatch(heartbeat, task_pid=os.getpid, uptime=lambda: 60.0, on_hang=hangs.append)
    assert fifos.within(lambda: watch.check(time.monotonic())) is None
    heartbeat.unlink()
    fd = os.open(heartbeat, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # as the trainer writes it
    os.write(fd, json.dumps({"step": 7, "at": time.time(), "pid": os.getpid(), "hang_after": None}).encode())
    os.close(fd)
    assert watch.check(time.monotonic()) is None and watch.last_step == 7
    assert not hangs
