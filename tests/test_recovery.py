"""A PS killed with SIGKILL during real training: the trainer rejoins in process and finishes.

The chief runs in a subprocess (one TF context per process) that owns its cluster and sidecar; the test
delivers the fault with a real signal when the chief says a durable checkpoint exists.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kill_ps_recovers_in_process_from_the_memory_tier(tmp_path: Path) -> None:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.recovery_chief", str(tmp_path), "60"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    try:
        first = json.loads(proc.stdout.readline())
        assert "kill" in first, first
        os.kill(int(first["kill"]), signal.SIGKILL)
        summary = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert summary["final"] >= 60
    assert len(summary["recoveries"]) == 1
    restored = summary["restored"][-1]
    assert restored["source"] == "memory"
    # lost work is bounded by the memory tier's cadence (5 steps) plus the steps scheduled in one batch (5)
    assert 0 <= summary["seen_at_failure"] - restored["step"] <= 10
    assert restored["step"] >= first["step"]
