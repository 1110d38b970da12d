"""SIGTERM handling: the handler asks for a save now, the trainer saves, waits for the memory tier and exits."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from psguard.errors import PsguardError
from psguard.handoff.contract import Tier
from psguard.policy.engine import EveryInterval, SaveContext, Schedule, TierState
from psguard.trainer.preemption import PreemptionHandler
from tests.support.paths import ROOT

T0 = 1_767_225_600.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_sigterm_requests_an_urgent_memory_save_in_process() -> None:
    clock = Clock(T0 + 100)
    schedule = Schedule(memory=EveryInterval(30.0), durable=EveryInterval(600.0))
    ctx = SaveContext(started_at=T0, memory=TierState(90, T0 + 95), in_flight=frozenset({Tier.DURABLE}))
    previous = signal.getsignal(signal.SIGTERM)
    with PreemptionHandler(grace=20.0, clock=clock) as handler:
        assert handler.apply(ctx) is ctx and handler.requested_at is None
        assert not schedule.decide(100, clock.now, handler.apply(ctx))  # durable in flight: no
        signal.raise_signal(signal.SIGTERM)  # a real signal, delivered to this (main) thread
        assert handler.requested_at == T0 + 100
        clock.now += 1
        preempted = handler.apply(ctx)
        assert preempted.preempted_at == T0 + 100
        decision = schedule.decide(101, clock.now, preempted)
        assert decision.urgent and decision.tiers == {Tier.MEMORY}
        assert "preemption signal 1s ago" in decision.reason and "overriding the durable save" in decision.reason
        assert handler.remaining() == pytest.approx(19.0)
        assert handler.exit_code == 128 + signal.SIGTERM
        after = preempted.with_save(decision.tiers, step=101, at=clock.now)
        assert not schedule.decide(102, clock.now, after).urgent  # one preemption save, not one per step
        clock.now += 60
        assert handler.remaining() == 0.0
    assert signal.getsignal(signal.SIGTERM) == previous


def test_install_outside_the_main_thread_is_refused() -> None:
    errors: list[BaseException] = []

    def install() -> None:
        try:
            PreemptionHandler().install()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=install)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], PsguardError) and "main thread" in str(errors[0])
    with pytest.raises(ValueError):
        PreemptionHandler(grace=0)


TRAINER = textwrap.dedent(
    """
    import json, sys, threading, time
    from pathlib import Path
    from psguard.trainer.preemption import PreemptionHandler
    from psguard.policy.engine import SaveContext
    from psguard.policy.files import load_policy

    out, save_seconds = Path(sys.argv[1]), float(sys.argv[2])
    spec = load_policy("default")
    context = SaveContext(started_at=time.time())
    with PreemptionHandler(grace=spec.preemption.grace) as preemption:
        print("ready", flush=True)
        step = 0
        while step < 100_000:
            step += 1
            time.sleep(0.005)                      # a training step
            decision = spec.schedule.decide(step, time.time(), preemption.apply(context))
            if decision.urgent:
                # The memory-tier write runs elsewhere (the sidecar); wait for it within the grace period.
                writer = threading.Thread(target=lambda: (time.sleep(save_seconds), out.write_text(str(step))))
                writer.start()
                writer.join(timeout=preemption.remaining())
                if out.exists():
                    preemption.done()
                print(json.dumps(decision.to_dict() | {"saved": out.exists()}), flush=True)
                sys.exit(preemption.exit_code)
            if decision:
                context = context.with_save(decision.tiers, step=step, at=time.time())
    sys.exit(3)
    """
)


def start_trainer(tmp_path: Path, save_seconds: float) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    out = tmp_path / "memory-tier.txt"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out), str(save_seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the handler is installed (pytest-timeout guards it)
    assert line.strip() == "ready", line + proc.stderr.read() if proc.stderr else ""
    return proc, out


@pytest.mark.slow
def test_sigterm_in_a_real_process_saves_memory_then_exits(tmp_path: Path) -> None:
    proc, out = start_trainer(tmp_path, save_seconds=0.3)
    try:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, stderr
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["urgent"] is True and report["tiers"] == ["memory"] and report["saved"] is True
    assert "preemption signal" in report["reason"]
    assert int(out.read_text()) == report["step"] >= 1  # the memory tier holds the step saved at preemption
    assert "event=preemption_saved" in stderr


@pytest.mark.slow
def test_a_second_sigterm_gives_up_waiting(tmp_path: Path) -> None:
    proc, out = start_trainer(tmp_path, save_seconds=30.0)  # a save that would take too long
    try:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=1.0)  # still waiting for the memory tier
            pytest.fail("the trainer exited before the second signal")
        except subprocess.TimeoutExpired:
            pass
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM  # killed by the default action
    assert not out.exists()
