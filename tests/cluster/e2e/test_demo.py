"""``psguard demo``: the full story on a local cluster, every task under ``psguard agent``, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import QUIET, ROOT


@pytest.mark.slow
def test_demo_kills_a_ps_recovers_from_a_checkpoint_and_reports(tmp_path: Path) -> None:
    demo = tmp_path / "demo"
    memory_every, chunk = 5, 5  # chunk: the trainer's steps per coordinator join (demo_trainer's default)
    argv = [sys.executable, "-m", "psguard.cli", "demo", "--dir", str(demo), "--steps", "200", "--kill-at", "60"]
    argv += ["--workers", "1", "--memory-every", str(memory_every), "--durable-every", "25", "--timeout", "400"]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=480, env=dict(os.environ, PYTHONPATH=str(ROOT), **QUIET)
    )
    print(out.stdout)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert "psguard demo: OK" in out.stdout and "kill -9 ps:0" in out.stdout and "steps/s" in out.stdout

    report = json.loads((demo / "report.json").read_text())
    assert report["ok"] and report["reached_target"] and report["final_step"] >= 200
    assert report["policy"] == {"memory_every": memory_every, "durable_every": 25, "chunk": chunk}
    assert report["checkpoints"]["memory"] > 0 and report["checkpoints"]["durable"] > 0
    rec = report["recovery"]
    assert rec["source"] in ("memory", "durable")
    assert rec["killed_at_step"] >= 60
    assert rec["restored_step"] <= rec["failure_seen_at_step"]
    assert 0 <= rec["lost_steps"] <= memory_every + chunk
    assert rec["recovery_seconds"] > 0 and rec["kill_to_training_seconds"] > 0
    # Normal speed comes after the first steps, and after the first capture following the restore.
    assert rec["kill_to_normal_speed_seconds"] >= rec["kill_to_training_seconds"]
    assert json.loads((demo / "cluster.json").read_text()).keys() == {"chief", "ps", "worker"}

    png = (demo / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    # Every agent stopped its task and itself (the autouse leak check covers the processes).
    assert "event=agent_stopped" in (demo / "agents" / "chief" / "agent.log").read_text()
    for name in ("ps0", "ps1", "worker0"):
        assert "reason='stopped'" in (demo / "agents" / name / "agent.log").read_text(), name
