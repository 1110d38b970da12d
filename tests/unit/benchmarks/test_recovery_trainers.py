"""The trainers of ``psguard bench recovery``: which generation a trainer process starts at (the rest runs in the
cluster tests, as child processes)."""

from __future__ import annotations

from pathlib import Path

from psguard.benchmarks.recovery_trainers import restarted_generation
from psguard.demo_trainer import Progress


def test_a_trainer_started_after_the_kill_is_the_next_generation(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    assert restarted_generation(path) == 0  # the first trainer: no records yet
    rec = Progress(str(path))
    rec.emit("step", gen=0, step=19, cap=False)
    assert restarted_generation(path) == 0  # trained, not killed
    rec.emit("kill", step=19)
    rec.close()
    assert restarted_generation(path) == 1  # the agent's new process after the killed one
