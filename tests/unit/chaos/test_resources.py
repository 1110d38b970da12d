"""Resource sampling of real processes and folders, and the fitted growth the soak checkers judge."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from psguard.chaos.resources import (
    ResourceSampler,
    folder_bytes,
    process_usage,
    slope_per_hour,
    week_projection,
)
from tests.support.processes import wait_until

# Opens one more file and starts one more thread each time it reads a line: a leak on demand.
LEAKER = """
import sys, threading, time
held = []
print("ready", flush=True)
for line in sys.stdin:
    held.append(open(sys.executable, "rb"))
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    print("ok", flush=True)
"""


def test_a_leaking_process_shows_one_more_fd_and_thread_per_step() -> None:
    proc = subprocess.Popen([sys.executable, "-c", LEAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        # Sampled once the interpreter is up: during its start-up its fds and threads still move (a CI run saw
        # 4 fds before, 8 after five leaks).
        assert proc.stdout.readline() == "ready\n"
        before = process_usage(proc.pid)
        assert before is not None
        for _ in range(5):
            proc.stdin.write("leak\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "ok\n"
        after = process_usage(proc.pid)
        assert after is not None
        assert after.fds - before.fds == 5 and after.threads - before.threads == 5
        assert after.rss_bytes > 1_000_000 and after.children == 0
    finally:
        proc.kill()
        proc.wait()
    assert process_usage(proc.pid) is None  # gone (reaped): no figures, no error


def test_the_sampler_records_every_role_and_folder_and_skips_the_gone(tmp_path: Path) -> None:
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / "a").write_bytes(b"x" * 1000)
    (tmp_path / "spool" / "b").write_bytes(b"y" * 24)
    seen: dict[str, float] = {}
    sampler = ResourceSampler(
        lambda: {"trainer": os.getpid(), "server:ps:0": 2**22 + 17},  # the second pid does not exist
        {"spool": tmp_path / "spool", "missing": tmp_path / "nope"},
        lambda t, series, value: seen.__setitem__(series, value),
        every=0.05,
    )
    sampler.sample()
    assert seen["folder:spool/bytes"] == 1024 and seen["folder:spool/files"] == 2
    assert seen["folder:missing/bytes"] == 0
    assert seen["trainer/threads"] >= 1 and seen["trainer/fds"] >= 3
    assert not any(k.startswith("server:") for k in seen)
    sampler.start()
    (tmp_path / "spool" / "c").write_bytes(b"z" * 976)
    wait_until(lambda: seen["folder:spool/bytes"] == 2000, what="the next sample")
    sampler.stop()
    assert folder_bytes(tmp_path / "spool") == (2000, 3)


def test_slopes_are_per_hour_after_the_warm_up_and_project_a_week() -> None:
    flat = [(float(t), 100.0 + (5.0 if t < 60 else 0.0)) for t in range(0, 600, 10)]  # a warm-up bump, then flat
    assert slope_per_hour(flat, warmup=60) == pytest.approx(0.0)
    assert slope_per_hour(flat) is not None and slope_per_hour(flat) < 0  # the bump tilts it without a warm-up
    growing = [(float(t), 1000.0 + t) for t in range(0, 600, 10)]  # 1 unit a second
    assert slope_per_hour(growing) == pytest.approx(3600.0)
    assert week_projection(growing) == pytest.approx(1590.0 + 3600.0 * 168)
    assert week_projection(flat, warmup=60) == pytest.approx(100.0)
    assert slope_per_hour(growing[:2]) is None and slope_per_hour([(5.0, 1.0)] * 4) is None
