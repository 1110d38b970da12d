"""The task log stays under its bound while a real process writes to it, and keeps its newest copies."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from psguard.agent.process.task_log import TaskLog
from tests.support.processes import wait_until

# Writes numbered lines to its stdout (the log's fd) until its stdin closes.
WRITER = """
import sys, select
n = 0
while not select.select([sys.stdin], [], [], 0)[0]:
    sys.stdout.write(f"line {n:08d} " + "x" * 80 + "\\n"); sys.stdout.flush(); n += 1
"""


def test_a_full_log_is_copied_and_truncated_keeping_the_newest_copies(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "task.log"
    tl = TaskLog(path, max_bytes=100, keep=2)
    for run in range(4):  # each run starts with a fresh file when the last one passed the bound
        fd = tl.open()
        os.write(fd, f"run {run}\n".encode() * 20)
        os.close(fd)
    assert path.read_bytes() == b"run 3\n" * 20
    assert path.with_name("task.log.1").read_bytes() == b"run 2\n" * 20
    assert path.with_name("task.log.2").read_bytes() == b"run 1\n" * 20  # run 0's copy was dropped
    assert not path.with_name("task.log.3").exists()
    for p in path.parent.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p  # task output is the owner's alone


def test_keep_zero_truncates_without_a_copy(tmp_path: Path) -> None:
    path = tmp_path / "task.log"
    path.write_bytes(b"y" * 50)
    tl = TaskLog(path, max_bytes=10, keep=0)
    assert tl.rotate_if_full() and path.read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task.log"]
    assert not tl.rotate_if_full()  # under the bound now


def test_a_running_writer_is_bounded_and_its_lines_go_on_at_the_start_of_the_file(tmp_path: Path) -> None:
    """copytruncate under a live O_APPEND writer: after the truncation its next line lands at offset 0 (no hole
    of NULs where the old end was), and the copies hold the same stream, in order."""
    path = tmp_path / "task.log"
    tl = TaskLog(path, max_bytes=20_000, keep=1, check_every=0.05)
    fd = tl.open()
    writer = subprocess.Popen([sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=fd)
    os.close(fd)
    tl.start()
    try:
        copy = path.with_name("task.log.1")
        wait_until(lambda: copy.exists() and copy.stat().st_size >= 20_000, timeout=30, what="a first rotation")
        first = copy.read_bytes()
        wait_until(lambda: copy.read_bytes() != first, timeout=30, what="a second rotation")
    finally:
        assert writer.stdin is not None
        writer.stdin.close()
        writer.wait(timeout=30)
        tl.stop()
    data = path.read_bytes()
    assert b"\0" not in data and b"\0" not in copy.read_bytes()
    assert data == b"" or data.startswith(b"line ")  # the writer's lines, from the file's first byte
    numbers = [int(line.split()[1]) for line in copy.read_bytes().splitlines() if line.startswith(b"line ")]
    assert numbers == sorted(numbers) and numbers[0] > 0  # a later stretch of the same stream, in order
