"""Hang detection: a trainer that is alive but makes no steps is found, its stacks logged, and it is restarted.

The unit tests drive :class:`HangWatch` with a real heartbeat file and a clock they pass in; the end-to-end
test runs a real ``psguard agent --role chief`` whose trainer blocks forever at step 20 in its first run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psguard.agent.process.hang import Hang, HangWatch
from psguard.handoff.spool import atomic_write_json
from psguard.policy.files import HangSpec
from tests.support.agents import lone_chief_agent


class Trainer:
    """The process the watch judges: a pid that changes on each restart, an uptime."""

    def __init__(self) -> None:
        self.pid: int | None = os.getpid()
        self.started = time.time() - 1.0

    def uptime(self) -> float | None:
        return None if self.pid is None else time.time() - self.started


def beat(path: Path, step: int, hang_after: float | None, pid: int | None = None) -> None:
    atomic_write_json(path, {"step": step, "at": time.time(), "pid": pid or os.getpid(), "hang_after": hang_after})


def make(tmp_path: Path, trainer: Trainer, hangs: list[Hang]) -> HangWatch:
    return HangWatch(
        tmp_path / "heartbeat.json",
        task_pid=lambda: trainer.pid,
        uptime=trainer.uptime,
        on_hang=hangs.append,
        dump_grace=0.0,
    )


def test_a_step_that_does_not_change_within_the_bound_is_a_hang_once_per_run(tmp_path: Path) -> None:
    trainer, hangs = Trainer(), []
    watch = make(tmp_path, trainer, hangs)
    hb = tmp_path / "heartbeat.json"
    beat(hb, 10, 30.0, pid=999_999_999)  # not our process: no stack dump is asked of it
    assert watch.check(100.0) is None
    beat(hb, 11, 30.0, pid=999_999_999)
    assert watch.check(110.0) is None  # progress
    assert watch.check(139.0) is None  # 29 s without a step: within the bound
    hang = watch.check(141.5)
    assert hang is not None and hang.step == 11 and hang.stuck_seconds == pytest.approx(31.5)
    assert not hang.stacks_requested and watch.hung and hangs == [hang]
    assert watch.check(200.0) is None  # declared once per run
    # the agent restarts the trainer: a new process makes steps again and the watch is ready again
    trainer.pid, trainer.started = trainer.pid + 1 if trainer.pid else 1, time.time()
    assert watch.check(201.0) is None and watch.hung  # no heartbeat of the new run yet
    beat(hb, 11, None)
    assert watch.check(202.0) is None and not watch.hung


def test_no_bound_yet_and_old_heartbeats_judge_nothing(tmp_path: Path) -> None:
    trainer, hangs = Trainer(), []
    watch = make(tmp_path, trainer, hangs)
    hb = tmp_path / "heartbeat.json"
    beat(hb, 5, None)  # the trainer has not measured a step time yet
    assert watch.check(0.0) is None and watch.check(10_000.0) is None
    trainer.pid, trainer.started = 4242, time.time() + 5.0  # a run that started after the last heartbeat
    beat(hb, 5, 1.0)
    assert watch.check(10_001.0) is None and watch.check(20_000.0) is None and hangs == []


def test_the_policy_bound_from_median_step_time_with_a_floor() -> None:
    assert HangSpec(after=42.0).bound(None) == 42.0
    assert HangSpec().bound(None) is None
    assert HangSpec(median_steps=50, floor=300).bound(0.1) == 300.0
    assert HangSpec(median_steps=50, floor=300).bound(10.0) == 500.0
    assert HangSpec(enabled=False, after=1.0).bound(1.0) is None


TRAINER = """
import json, os, sys, threading, time
import numpy as np
import tensorflow as tf
import psguard
from psguard.policy import EverySteps, Schedule
from psguard.policy.files import HangSpec

store, marker, out = sys.argv[1:4]
v = tf.Variable(np.zeros((1000, 8), np.float32))
step = tf.Variable(0, dtype=tf.int64)
ckpt = tf.train.Checkpoint(v=v, step=step)
policy = Schedule(memory=EverySteps(5), durable=EverySteps(10))
options = psguard.ManagerOptions(hang=HangSpec(after=3.0))
m = psguard.CheckpointManager(ckpt, store, step_counter=step, policy=policy, options=options)
restored = m.restore_or_initialize()
start = int(step.numpy())


def stuck_in_the_input_pipeline():
    threading.Event().wait()  # never returns: the process lives, no step is made


while int(step.numpy()) < 40:
    if int(step.numpy()) == 20 and not os.path.exists(marker):
        open(marker, "w").close()
        stuck_in_the_input_pipeline()
    v.assign_add(tf.ones_like(v))
    step.assign_add(1)
    m.maybe_save()
    time.sleep(0.05)
m.save().result(timeout=60)
m.close()
json.dump({"restored": restored, "start": start, "end": int(step.numpy()), "v": float(v.numpy()[0, 0])}, open(out, "w"))
"""


@pytest.mark.slow
def test_a_real_agent_restarts_a_hung_trainer_which_restores_from_the_memory_tier(tmp_path: Path) -> None:
    task_log = tmp_path / "task.log"
    config = tmp_path / "agent.yaml"
    config.write_text(f"task_log: {task_log}\nsupervisor: {{backoff_initial: 0.1}}\nstate_dir: {tmp_path / 'state'}\n")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    store, out = tmp_path / "store", tmp_path / "out.json"
    command = [sys.executable, str(script), str(store), str(tmp_path / "hung-once"), str(out)]
    argv = lone_chief_agent(tmp_path, store, command, "--config", str(config))
    t0 = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "event=hang " in done.stderr, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["restored"] is not None and result["restored"].startswith("memory:"), result
    assert 15 <= result["start"] <= 20 and result["end"] == 40 and result["v"] == 40.0, result
    log_text = task_log.read_text()
    assert "stuck_in_the_input_pipeline" in log_text, log_text[-2000:]  # faulthandler's stacks, in the task log
    assert time.monotonic() - t0 < 240
