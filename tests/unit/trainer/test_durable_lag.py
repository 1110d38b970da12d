"""The trainer holds while the durable log trails past the bound, and only then (real save handles, real threads)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import cast

import pytest

from psguard.errors import SaveError
from psguard.handoff.contract import Tier
from psguard.policy.lag import LagBound
from psguard.store import CheckpointInfo
from psguard.trainer.durable_lag import LagGuard
from psguard.trainer.sinks import BOTH, _StoreSaveHandle


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _HoldSeen(logging.Handler):
    """Sets an event when the guard logs that it started to hold (what a test awaits instead of sleeping)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.holding = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "event=durable_hold " in record.getMessage():
            self.holding.set()


@pytest.fixture
def hold_seen() -> Iterator[_HoldSeen]:
    handler = _HoldSeen()
    logger = logging.getLogger("psguard.trainer.durable_lag")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def _committed(step: int) -> CheckpointInfo:
    """What a commit resolves a handle to; the guard reads only whether the save failed."""
    return cast(CheckpointInfo, f"checkpoint of step {step}")


def _hold_in_thread(guard: LagGuard, step: int) -> tuple[threading.Thread, list[float]]:
    held: list[float] = []
    thread = threading.Thread(target=lambda: held.append(guard.check(step)), daemon=True)
    thread.start()
    return thread, held


def test_by_default_training_waits_at_the_save_until_it_is_committed(hold_seen: _HoldSeen) -> None:
    guard = LagGuard(LagBound)
    handle = _StoreSaveHandle(100, 0.0, BOTH)
    guard.submitted(handle)
    thread, held = _hold_in_thread(guard, 100)
    assert hold_seen.holding.wait(10), "the guard did not hold at the save"
    assert thread.is_alive() and not held  # still waiting: the commit has not come
    assert guard.status().pending == 1
    handle.future.set_result(_committed(100))
    thread.join(10)
    assert not thread.is_alive() and held[0] > 0
    status = guard.status()
    assert status.pending == 0 and status.holds == 1 and status.last_durable_step == 100 and not status.failing


def test_a_memory_only_save_never_holds() -> None:
    guard = LagGuard(LagBound)
    guard.submitted(_StoreSaveHandle(100, 0.0, frozenset({Tier.MEMORY})))
    assert guard.check(100) == 0.0 and guard.status().pending == 0


def test_a_step_bound_lets_training_run_ahead_then_holds(hold_seen: _HoldSeen) -> None:
    guard = LagGuard(lambda: LagBound(max_steps=2))
    handle = _StoreSaveHandle(100, 0.0, BOTH)
    guard.submitted(handle)
    assert guard.check(100) == 0.0 and guard.check(101) == 0.0  # 2 steps past after the next: within
    assert guard.status().steps == 1
    thread, held = _hold_in_thread(guard, 102)  # the next step would be 3 past
    assert hold_seen.holding.wait(10)
    handle.future.set_result(_committed(100))
    thread.join(10)
    assert held and held[0] > 0


def test_a_failed_durable_save_ends_the_hold_and_holding_stays_off_until_one_succeeds(hold_seen: _HoldSeen) -> None:
    guard = LagGuard(LagBound)
    failed = _StoreSaveHandle(100, 0.0, BOTH)
    guard.submitted(failed)
    thread, held = _hold_in_thread(guard, 100)
    assert hold_seen.holding.wait(10)
    failed.future.set_exception(SaveError("store unreachable"))
    thread.join(10)
    assert held and guard.status().failing
    waiting = _StoreSaveHandle(200, 0.0, BOTH)
    guard.submitted(waiting)
    assert guard.check(200) == 0.0  # an outage does not stop training: the memory tier keeps saves restorable
    assert guard.status().pending == 1 and guard.status().steps == 0
    waiting.future.set_result(_committed(200))
    later = _StoreSaveHandle(300, 0.0, BOTH)
    guard.submitted(later)
    hold_seen.holding.clear()
    thread, held = _hold_in_thread(guard, 300)  # the store took a commit again: holding is back
    assert hold_seen.holding.wait(10)
    later.future.set_result(_committed(300))
    thread.join(10)
    assert held and not guard.status().failing and guard.status().last_durable_step == 300


def test_report_never_waits_and_measures_the_lag_in_steps_and_seconds() -> None:
    clock = _Clock()
    guard = LagGuard(lambda: LagBound(max_steps=10, on_exceed="report"), clock=clock)
    handle = _StoreSaveHandle(100, 0.0, BOTH)
    guard.submitted(handle)
    clock.now += 58.0
    assert guard.check(245) == 0.0
    status = guard.status()
    assert (status.steps, status.seconds, status.holds) == (145, 58.0, 0)
    handle.future.set_result(_committed(100))
    assert guard.status().steps == 0 and guard.status().seconds == 0.0


def test_a_hold_ends_when_no_agent_can_answer_any_more() -> None:
    alive = threading.Event()  # never set: the agent is gone
    guard = LagGuard(LagBound, agent_alive=alive.is_set, progress_every=0.05)
    guard.submitted(_StoreSaveHandle(100, 0.0, BOTH))
    held = guard.check(100)
    assert held > 0 and guard.status().pending == 0


def test_a_preemption_ends_the_hold_so_its_grace_goes_to_the_preemption_save() -> None:
    preempted = threading.Event()
    guard = LagGuard(LagBound, cancel=preempted.is_set)
    handle = _StoreSaveHandle(100, 0.0, BOTH)
    guard.submitted(handle)
    thread, held = _hold_in_thread(guard, 100)
    preempted.set()
    thread.join(10)
    assert not thread.is_alive() and held and not handle.done()
