"""How ``psguard bench recovery`` measures one side's recovery from its trainer's records (records of a known run)."""

from __future__ import annotations

import pytest

from psguard.agent.process.standby import warm_trainer_command
from psguard.benchmarks.recovery_job import Params, Records, child, measure
from tests.support.bench_records import job_records

P = Params(memory_every=5, durable_every=10)  # kill step 19, settle 7 steps


def test_recovery_ends_at_the_first_step_at_normal_speed_past_the_settle_steps_and_a_capture() -> None:
    docs = job_records()
    got = measure(Records(docs), 2.5, P, need_capture=True)
    # Restored 15: steps from 22 (15 + 7) at normal speed, after the capture at 20; 22 ends at 5 + 1 + 5 * 0.1 + 0.3.
    end = next(d["t"] for d in docs if d["event"] == "step" and d["gen"] == 1 and d["step"] == 22)
    assert got["recovery_s"] == pytest.approx(end - 2.5)
    assert got["normal_speed_reached"] is True
    assert got["normal_step_s"] == pytest.approx(0.1)
    assert got["first_step_s"] == pytest.approx(6.0 - 2.5)
    assert (got["lost_steps"], got["restored_step"]) == (19 - 15, 15)
    assert got["restore_s"] == pytest.approx(1.0) and got["build_s"] == pytest.approx(1.5)
    assert got["capture_after_restore_stall_s"] == pytest.approx(0.25)
    # Without a capture needed (the baseline's side), the settle steps alone: step 22 still (20 held a capture).
    assert measure(Records(docs), 2.5, P, need_capture=False)["recovery_s"] == pytest.approx(end - 2.5)


def test_a_job_never_back_at_normal_speed_ends_at_its_last_step() -> None:
    docs = [d for d in job_records() if not (d["event"] == "step" and d["gen"] == 1 and d["step"] > 16)]
    got = measure(Records(docs), 2.5, P, need_capture=True)
    assert got["normal_speed_reached"] is False
    assert got["recovery_s"] == pytest.approx(6.0 - 2.5)


def test_only_the_warm_form_of_a_trainers_command_gets_a_standby_from_its_agent() -> None:
    warm = child("agent_trainer", "a", "b", warm=True)
    assert warm_trainer_command(warm) == [
        warm[0], "-m", "psguard.trainer.warm", "-m", "psguard.benchmarks.recovery_trainers", "agent_trainer", "a", "b"
    ]  # fmt: skip
    assert warm_trainer_command(child("agent_trainer", "a", "b")) is None  # python -c: started cold
