"""The supervisor with real processes: restarts, backoff, crash loops, graceful and forced stops, dying with the agent.

Tasks are tiny ``sh`` scripts, so these tests take seconds. Waiting is on the supervisor's events or on real
external conditions (a file written, a process gone) with deadlines, never on fixed sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import psguard.agent.process.supervisor as supervisor_module
from psguard.agent.process.lifecycle import (
    EventKind,
    SpawnError,
    SupervisorConfig,
    SupervisorEvent,
    SupervisorState,
)
from psguard.agent.process.standby import warm_trainer_command
from psguard.agent.process.supervisor import Supervisor
from psguard.config import loads_yaml
from psguard.errors import ConfigError, CrashLoopError
from psguard.handoff.contract import EXIT_RESTART
from psguard.testbed.procs import descendants
from tests.support.paths import ROOT
from tests.support.processes import alive, cmdline, parent_pid, proc_state, wait_until


class Events:
    """Collects a supervisor's events and lets a test wait for one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.items: list[SupervisorEvent] = []

    def __call__(self, event: SupervisorEvent) -> None:
        with self._cond:
            self.items.append(event)
            self._cond.notify_all()

    def kinds(self) -> list[str]:
        with self._cond:
            return [e.kind.value for e in self.items]

    def of(self, kind: EventKind) -> list[SupervisorEvent]:
        with self._cond:
            return [e for e in self.items if e.kind is kind]

    def wait(self, kind: EventKind, count: int = 1, timeout: float = 10.0) -> SupervisorEvent:
        with self._cond:
            ok = self._cond.wait_for(lambda: len([e for e in self.items if e.kind is kind]) >= count, timeout)
            if not ok:
                raise AssertionError(f"no {count} x {kind.value} within {timeout}s; got {self.kinds()}")
            return [e for e in self.items if e.kind is kind][count - 1]


def sh(script: str) -> list[str]:
    return ["sh", "-c", textwrap.dedent(script)]


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    """Every supervisor a test makes is stopped even when the test fails."""
    made: list[Supervisor] = []
    yield made
    for s in made:
        s.stop()


def make(supervisors: list[Supervisor], cmd: list[str], **kwargs: object) -> Supervisor:
    s = Supervisor(cmd, **kwargs)  # type: ignore[arg-type]
    supervisors.append(s)
    return s


def test_exit_zero_means_done(supervisors: list[Supervisor], events: Events) -> None:
    s = make(supervisors, ["true"], on_event=events)
    s.start()
    assert s.result(timeout=10) == 0
    assert events.kinds() == ["started", "exited", "completed"]
    status = s.status()
    assert status.state is SupervisorState.COMPLETED and status.restarts == 0 and status.pid is None
    assert s.restart("too late") is False


def test_backoff_doubles_then_crash_loop_names_command_codes_and_window(
    supervisors: list[Supervisor], events: Events
) -> None:
    s = make(
        supervisors,
        sh("exit 3"),
        name="ps:0",
        backoff_initial=0.05,
        backoff_max=0.15,
        crash_loop_limit=4,
        crash_loop_window=60,
        on_event=events,
    )
    s.start()
    with pytest.raises(CrashLoopError) as info:
        s.result(timeout=20)
    message = str(info.value)
    assert "ps:0" in message and "sh -c 'exit 3'" in message
    assert "4 times within 60s" in message and "exit codes: 3, 3, 3, 3" in message
    exits = events.of(EventKind.EXITED)
    assert [e.exit_code for e in exits] == [3, 3, 3, 3]
    assert [e.backoff_seconds for e in exits] == [0.05, 0.1, 0.15, None]  # capped at backoff_max; none after
    assert events.kinds()[-1] == "gave_up" and events.of(EventKind.GAVE_UP)[0].reason == message
    # Each restart waited at least its backoff.
    starts = [e.time for e in events.items if e.kind in (EventKind.STARTED, EventKind.RESTARTED)]
    ends = [e.time for e in exits]
    for end, start, backoff in zip(ends[:3], starts[1:], [0.05, 0.1, 0.15], strict=True):
        assert start - end >= backoff * 0.9
    assert s.status().state is SupervisorState.GAVE_UP and s.status().restarts == 3


def test_exit_restart_code_restarts_at_once_without_counting_a_crash(
    supervisors: list[Supervisor], events: Events, tmp_path: Path
) -> None:
    counter = tmp_path / "runs"
    script = f"""
        n=$(cat {counter} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {counter}
        [ $n -lt 4 ] && exit {EXIT_RESTART}
        exit 0
    """
    s = make(supervisors, sh(script), backoff_initial=30, crash_loop_limit=2, on_event=events)
    s.start()
    assert s.result(timeout=10) == 0
    exits = events.of(EventKind.EXITED)
    assert [e.exit_code for e in exits] == [EXIT_RESTART] * 3 + [0]
    assert all(e.backoff_seconds == 0.0 for e in exits[:3])
    assert s.status().restarts == 3 and s.status().crashes_in_window == 0


def test_a_long_run_resets_the_backoff(supervisors: list[Supervisor], events: Events, tmp_path: Path) -> None:
    counter = tmp_path / "runs"
    script = f"""
        n=$(cat {counter} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {counter}
        [ $n -eq 3 ] && sleep 0.5
        [ $n -eq 5 ] && exit 0
        exit 1
    """
    s = make(
        supervisors,
        sh(script),
        backoff_initial=0.05,
        backoff_max=10,
        backoff_reset_after=0.4,
        crash_loop_limit=10,
        on_event=events,
    )
    s.start()
    assert s.result(timeout=20) == 0
    backoffs = [e.backoff_seconds for e in events.of(EventKind.EXITED)]
    assert backoffs == [0.05, 0.1, 0.05, 0.1, None]  # run 3 lasted long enough to start over


def test_stop_sends_sigterm_to_the_whole_group(supervisors: list[Supervisor], events: Events, tmp_path: Path) -> None:
    child_pid, graceful = tmp_path / "child.pid", tmp_path / "graceful"
    script = f"""
        trap 'echo yes > {graceful}; exit 0' TERM
        sleep 300 & echo $! > {child_pid}
        wait
    """
    s = make(supervisors, sh(script), stop_timeout=10, on_event=events)
    s.start()
    wait_until(lambda: child_pid.exists() and child_pid.read_text().strip() != "", what="grandchild started")
    grandchild = int(child_pid.read_text())
    assert alive(grandchild)
    started = time.monotonic()
    status = s.stop()
    assert time.monotonic() - started < 5
    assert graceful.read_text().strip() == "yes"
    wait_until(lambda: not alive(grandchild), what="the group SIGKILL reaching the grandchild")
    assert status.state is SupervisorState.STOPPED and status.pid is None
    assert events.kinds()[-2:] == ["exited", "stopped"]
    assert s.result(timeout=1) == 0


def test_stop_escalates_to_sigkill_after_the_timeout(
    supervisors: list[Supervisor], events: Events, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    s = make(supervisors, sh(f"trap '' TERM; echo > {ready}; while :; do sleep 0.05; done"), stop_timeout=0.5)
    s.start()
    wait_until(ready.exists, what="task ready")
    started = time.monotonic()
    s.stop()
    took = time.monotonic() - started
    assert 0.45 <= took < 5
    assert s.status().last_exit_code == -signal.SIGKILL


def test_stop_reaches_a_frozen_task(supervisors: list[Supervisor]) -> None:
    s = make(supervisors, ["sleep", "300"], stop_timeout=5)
    s.start()
    pid = s.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: proc_state(pid) == "T", what="stopped")
    started = time.monotonic()
    s.stop()
    assert time.monotonic() - started < 2  # SIGCONT after SIGTERM: no wait for the SIGKILL escalation
    assert s.status().last_exit_code == -signal.SIGTERM


def test_restart_kills_the_group_and_starts_the_same_command(
    supervisors: list[Supervisor], events: Events, tmp_path: Path
) -> None:
    child_pid = tmp_path / "child.pid"
    s = make(supervisors, sh(f"sleep 300 & echo $! > {child_pid}; wait"), on_event=events)
    s.start()
    wait_until(lambda: child_pid.exists() and child_pid.read_text().strip() != "", what="grandchild started")
    first_pid, grandchild = s.pid, int(child_pid.read_text())
    child_pid.unlink()
    assert s.restart("rpc probe: DEADLINE_EXCEEDED")
    restarted = events.wait(EventKind.RESTARTED)
    assert restarted.reason == "rpc probe: DEADLINE_EXCEEDED" and restarted.pid != first_pid
    exited = events.of(EventKind.EXITED)[0]
    assert exited.exit_code == -signal.SIGKILL and exited.pid == first_pid and exited.backoff_seconds == 0.0
    wait_until(lambda: not alive(grandchild), what="the group SIGKILL reaching the grandchild")
    assert first_pid is not None and not alive(first_pid)
    status = s.status()
    assert status.restarts == 1 and status.crashes_in_window == 1 and status.state is SupervisorState.RUNNING
    wait_until(child_pid.exists, what="new run started its grandchild")


def test_restart_during_backoff_starts_now_and_stop_during_backoff_is_prompt(
    supervisors: list[Supervisor], events: Events
) -> None:
    s = make(supervisors, sh("exit 1"), backoff_initial=60, backoff_max=60, on_event=events)
    s.start()
    events.wait(EventKind.EXITED)
    assert s.status().state is SupervisorState.BACKOFF
    started = time.monotonic()
    assert s.restart("operator asked")
    events.wait(EventKind.RESTARTED)
    assert time.monotonic() - started < 5
    events.wait(EventKind.EXITED, count=2)
    started = time.monotonic()
    s.stop()
    assert time.monotonic() - started < 5
    assert s.status().state is SupervisorState.STOPPED


def test_supervision_holds_with_descriptors_past_1024(
    supervisors: list[Supervisor], events: Events, tmp_path: Path
) -> None:
    """Was: an agent flooded on its control port held over 1024 descriptors, the supervisor's ``select()``
    refused its pidfd and the agent exited 1. Its waits, the task's exit and a stop, work past 1024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.fail(f"this machine allows {hard} descriptors: the test needs 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        ran = tmp_path / "ran"
        s = make(supervisors, sh(f"[ -e {ran} ] && exec sleep 300; touch {ran}; exit 3"), on_event=events)
        s.start()
        assert events.wait(EventKind.EXITED).exit_code == 3
        events.wait(EventKind.RESTARTED)
        started = time.monotonic()
        status = s.stop()
        assert status.state is SupervisorState.STOPPED and time.monotonic() - started < 5
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_command_that_cannot_start_is_a_spawn_error(tmp_path: Path) -> None:
    with pytest.raises(SpawnError, match="no-such-program-psguard"):
        Supervisor(["no-such-program-psguard", "--flag"]).start()
    with pytest.raises(SpawnError, match="working directory"):
        Supervisor(["true"], cwd=tmp_path / "missing").start()
    not_executable = tmp_path / "task.sh"
    not_executable.write_text("#!/bin/sh\n")
    with pytest.raises(SpawnError, match="Not executable"):
        Supervisor([str(not_executable)]).start()


def test_callback_errors_do_not_stop_supervision(supervisors: list[Supervisor], events: Events) -> None:
    def broken(event: SupervisorEvent) -> None:
        events(event)
        raise RuntimeError("metrics bug")

    s = make(supervisors, sh("exit 1"), backoff_initial=0.01, crash_loop_limit=3, on_event=broken)
    s.start()
    with pytest.raises(CrashLoopError):
        s.result(timeout=10)
    assert events.kinds().count("restarted") == 2


def test_task_output_goes_to_the_log_file(supervisors: list[Supervisor], tmp_path: Path) -> None:
    log = tmp_path / "logs" / "task.log"
    s = make(supervisors, sh("echo out; echo err >&2"), log_path=log, env={"PATH": os.environ["PATH"]})
    s.start()
    assert s.result(timeout=10) == 0
    assert log.read_text().split() == ["out", "err"]


def test_status_is_consistent_under_concurrent_readers(supervisors: list[Supervisor], events: Events) -> None:
    s = make(supervisors, ["sleep", "300"], on_event=events)
    s.start()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(200):
                st = s.status()
                assert st.state in (SupervisorState.RUNNING, SupervisorState.STOPPING, SupervisorState.STOPPED)
                assert (st.pid is None) == (st.uptime_seconds is None)
        except BaseException as e:
            errors.append(e)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    for i in range(3):
        s.restart(f"test {i}")
        events.wait(EventKind.RESTARTED, count=i + 1)
    for t in readers:
        t.join()
    assert not errors


def test_restart_policy_loads_from_yaml() -> None:
    config = loads_yaml(SupervisorConfig, "backoff_initial: 250ms\nbackoff_max: 1m\ncrash_loop_limit: 3\n")
    assert (config.backoff_initial, config.backoff_max, config.crash_loop_limit) == (0.25, 60.0, 3)
    with pytest.raises(ConfigError, match=r"crash_loop_limt: unknown key.*did you mean 'crash_loop_limit'"):
        loads_yaml(SupervisorConfig, "crash_loop_limt: 3\n")
    with pytest.raises(ConfigError, match="backoff_max"):
        loads_yaml(SupervisorConfig, "backoff_initial: 10s\nbackoff_max: 1s\n")
    s = Supervisor(["true"], config=config, name="x", standby_capable=True)
    assert s.config == config and s.name == "x"
    # The config says whether to keep a standby where one can be used; an arbitrary command cannot use one.
    assert not Supervisor(["true"], config=config).config.standby


_AGENT = """
import sys, threading
from psguard.agent.process.supervisor import Supervisor

def start_from_a_short_lived_thread():
    sup.start()

sup = Supervisor(["sleep", "300"], name="victim")
t = threading.Thread(target=start_from_a_short_lived_thread)
t.start()
t.join()
print(sup.pid, flush=True)
sys.stdin.read()  # until the test kills us
"""


def test_the_task_dies_when_the_agent_is_killed_with_sigkill() -> None:
    """No clean-up runs on SIGKILL: only the kernel's parent-death signal can take the task down."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert agent.stdout is not None
        task_pid = int(agent.stdout.readline())
        # Started from a thread that has exited: the task must not have died with that thread.
        assert alive(task_pid)
        agent.kill()
        agent.wait(timeout=10)
        wait_until(lambda: not alive(task_pid), timeout=5, what="task killed with its agent")
    finally:
        agent.kill()
        agent.wait(timeout=10)
        if agent.stdin is not None:
            agent.stdin.close()
        if agent.stdout is not None:
            agent.stdout.close()


def test_stop_before_start_and_twice_is_harmless() -> None:
    s = Supervisor(["true"])
    assert s.stop().state is SupervisorState.STOPPED
    assert s.stop().state is SupervisorState.STOPPED
    with pytest.raises(RuntimeError, match="already started or stopped"):
        s.start()


def test_stop_from_an_event_callback(supervisors: list[Supervisor], events: Events) -> None:
    def stop_on_exit(event: SupervisorEvent) -> None:
        events(event)
        if event.kind is EventKind.EXITED:
            s.stop()

    s = make(supervisors, sh("exit 1"), backoff_initial=60, backoff_max=60, on_event=stop_on_exit)
    s.start()
    events.wait(EventKind.STOPPED)
    assert s.result(timeout=5) == 1 and s.status().state is SupervisorState.STOPPED
    assert events.kinds() == ["started", "exited", "stopped"]


# A task that honours psguard.agent.process.standby: as a standby it waits for "go" on stdin; every run that serves
# writes its pid to serving.<pid>, so a test can tell which process took over.
STANDBY_TASK = """
import os, pathlib, signal, sys
from psguard.handoff.standby import is_standby, wait_for_go
if is_standby() and not wait_for_go():
    sys.exit(0)
pathlib.Path(sys.argv[1], f"serving.{os.getpid()}").write_text("")
signal.pause()
"""


def standby_cmd(tmp_path: Path) -> list[str]:
    return [sys.executable, "-c", STANDBY_TASK, str(tmp_path)]


def serving(tmp_path: Path) -> set[int]:
    return {int(p.name.split(".")[1]) for p in tmp_path.glob("serving.*")}


def test_a_restart_swaps_in_the_warm_standby_and_a_new_one_follows(
    supervisors: list[Supervisor], events: Events, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    s = make(supervisors, standby_cmd(tmp_path), env=env, standby=True, standby_capable=True, standby_delay=0.2,
             standby_delay_after_restart=1.5, on_event=events)  # fmt: skip
    s.start()
    first = s.pid
    assert first is not None
    wait_until(lambda: first in serving(tmp_path), what="the first run serving")
    # No standby while the run is not declared healthy: it would compete with the run's own start. Counted from
    # the spawn, it would have been started 0.2 s in.
    time.sleep(0.5)
    assert s.status().standby_pid is None
    s.mark_healthy()  # what the agent does once the RPC probe passes
    wait_until(lambda: s.status().standby_ready, what="standby started and ready")
    standby = s.status().standby_pid
    assert standby is not None and standby != first
    assert serving(tmp_path) == {first}  # the ready standby waits: it must not serve (bind) before it is told to
    os.kill(first, signal.SIGKILL)
    restarted = events.wait(EventKind.RESTARTED)
    assert restarted.pid == standby and s.pid == standby
    wait_until(lambda: standby in serving(tmp_path), what="the standby serving after go")
    declared = time.time()
    s.mark_healthy()
    wait_until(lambda: s.status().standby_pid not in (None, standby), what="a new standby for the next restart")
    # ... started only once the recovery that restart belongs to had time to use the node.
    assert time.time() - declared >= 1.5
    second_standby = s.status().standby_pid
    assert second_standby is not None
    s.stop()
    assert not alive(standby) and not alive(second_standby)
    assert s.status().standby_pid is None


def test_a_dead_standby_means_a_cold_start_not_a_failure(
    supervisors: list[Supervisor], events: Events, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    s = make(supervisors, standby_cmd(tmp_path), env=env, standby=True, standby_capable=True, standby_delay=0.2,
             on_event=events)  # fmt: skip
    s.start()
    s.mark_healthy()
    wait_until(lambda: s.status().standby_pid is not None, what="standby started")
    standby = s.status().standby_pid
    assert standby is not None
    os.kill(standby, signal.SIGKILL)
    wait_until(lambda: not alive(standby), what="standby gone")
    assert s.restart("probe deadline")
    restarted = events.wait(EventKind.RESTARTED)
    assert restarted.pid not in (None, standby)
    wait_until(lambda: restarted.pid in serving(tmp_path), what="the cold-started run serving")


def test_a_run_nobody_declares_healthy_still_gets_its_standby(
    supervisors: list[Supervisor], events: Events, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's script that never delivers a checkpoint is never declared healthy: its standby comes
    ``STANDBY_UNDECLARED_AFTER`` after the start (shortened here), then ``standby_delay``."""
    monkeypatch.setattr(supervisor_module, "STANDBY_UNDECLARED_AFTER", 1.0)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    s = make(supervisors, standby_cmd(tmp_path), env=env, standby=True, standby_capable=True, standby_delay=0.2,
             on_event=events)  # fmt: skip
    s.start()
    started = time.monotonic()
    wait_until(lambda: s.status().standby_pid is not None, what="standby started")
    assert time.monotonic() - started >= 1.0


def test_no_standby_for_commands_not_known_to_honour_it() -> None:
    config = SupervisorConfig(standby=True)
    assert Supervisor(["true"], config=config)._standby is None
    assert Supervisor(["true"], config=config, standby_capable=True)._standby is not None
    assert Supervisor(["true"], config=SupervisorConfig(standby=False), standby_capable=True)._standby is None


# A user's trainer script, unmodified: it records what a warm start must give it exactly as a cold one does.
TRAINER_SCRIPT = """
import json, os, sys, time
record = {
    "pid": os.getpid(), "argv": sys.argv, "name": __name__, "path0": sys.path[0],
    "tf_preloaded": "tensorflow" in sys.modules, "late": os.environ.get("LATE"),
    "standby_env": sorted(k for k in os.environ if k.startswith("PSGUARD_STANDBY")),
}
with open(os.path.join(sys.argv[1], f"run.{os.getpid()}"), "w") as f:
    json.dump(record, f)
time.sleep(300)
"""


def test_warm_trainer_commands_only_for_plain_python_scripts_and_modules() -> None:
    warm = ["-m", "psguard.trainer.warm"]
    assert warm_trainer_command(["python3", "train.py", "--x"]) == ["python3", *warm, "train.py", "--x"]
    assert warm_trainer_command(["/v/bin/python", "-m", "pkg.train", "1"]) == [
        "/v/bin/python",
        *warm,
        "-m",
        "pkg.train",
        "1",
    ]
    for cmd in (["python"], ["python", "-u", "t.py"], ["python", "-c", "pass"], ["bash", "t.sh"], ["python", "-m"]):
        assert warm_trainer_command(cmd) is None, cmd


@pytest.mark.slow
def test_a_trainer_restart_runs_the_script_in_the_warm_standby_with_the_environment_of_now(
    supervisors: list[Supervisor], events: Events, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINER_SCRIPT)
    cmd = [sys.executable, str(script), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    s = make(supervisors, cmd, env=env, standby=True, standby_delay=0.2, standby_cmd=warm_trainer_command(cmd),
             on_event=events)  # fmt: skip
    s.start()
    first = s.pid
    assert first is not None
    s.mark_healthy()  # what the chief's agent does at the trainer's first checkpoint
    wait_until(lambda: s.status().standby_ready, timeout=120, what="the warm trainer imported TensorFlow")
    standby = s.status().standby_pid
    assert not (tmp_path / f"run.{standby}").exists()  # it waits: the script has not run
    s.set_env("LATE", "learnt after the standby started")
    os.kill(first, signal.SIGKILL)
    restarted = events.wait(EventKind.RESTARTED)
    assert restarted.pid == standby
    wait_until(lambda: (tmp_path / f"run.{standby}").exists(), what="the script running in the standby")
    wait_until(lambda: (tmp_path / f"run.{standby}").read_text().endswith("}"), what="its record")
    cold = json.loads((tmp_path / f"run.{first}").read_text())
    warm = json.loads((tmp_path / f"run.{standby}").read_text())
    assert warm["tf_preloaded"] and not cold["tf_preloaded"]
    assert warm["late"] == "learnt after the standby started" and cold["late"] is None
    for key in ("argv", "name", "path0", "standby_env"):
        assert warm[key] == cold[key], key
    assert cold["name"] == "__main__" and cold["standby_env"] == []


def test_runs_declared_healthy_and_requested_restarts_do_not_make_a_crash_loop(
    supervisors: list[Supervisor], events: Events
) -> None:
    """A PS killed again and again after serving each time, or replaced on request, is no crash loop."""
    s = make(supervisors, sh("sleep 300"), crash_loop_limit=2, backoff_initial=0.05, on_event=events)
    s.start()
    for kill in range(1, 4):
        pid = s.pid
        assert pid is not None
        s.mark_healthy()  # what the agent does once the RPC probe passes
        os.kill(pid, signal.SIGKILL)
        events.wait(EventKind.RESTARTED, count=kill)
    assert s.status().crashes_in_window == 0 and s.status().state is SupervisorState.RUNNING
    for n in range(4, 6):
        assert s.restart("a new trainer generation", crash=False)
        events.wait(EventKind.RESTARTED, count=n)
    assert s.status().crashes_in_window == 0
    # the control: two deaths of runs nobody declared healthy are a crash loop at crash_loop_limit=2
    for kill in (1, 2):
        wait_until(lambda: s.pid is not None, what="a run")
        pid = s.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        if kill == 1:
            events.wait(EventKind.RESTARTED, count=6)
    events.wait(EventKind.GAVE_UP)
    with pytest.raises(CrashLoopError, match="crashed 2 times"):
        s.result(timeout=10)


# ----------------------------------------------------------------------------------------------- orphans
_TREE = "sleep 600 & sleep 601; wait"

_TREE_AGENT = """
import sys
from psguard.agent.process.supervisor import Supervisor

sup = Supervisor(["sh", "-c", sys.argv[2]], name="victim", record=sys.argv[1], subreaper=True).start()
print(sup.pid, flush=True)
sys.stdin.read()  # until the test kills us, or closes stdin for a clean stop
sup.stop()
"""


def sleeps_of(root: int, *names: str) -> dict[str, int]:
    """The ``sleep N`` processes below ``root``, once all of ``names`` run (waited for, with a deadline)."""
    found: dict[str, int] = {}

    def all_running() -> bool:
        found.clear()
        for pid in descendants(root):
            if cmdline(pid) in names and alive(pid):
                found[cmdline(pid)] = pid
        return len(found) == len(names)

    wait_until(all_running, timeout=10, what=f"{names} running under {root}")
    return dict(found)


class TreeAgent:
    """A real agent process supervising ``sh -c 'sleep 600 & sleep 601; wait'`` with a task record."""

    def __init__(self, record: Path, script: str = _TREE) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TREE_AGENT, str(record), script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip().isdigit(), f"agent did not start its task: {line!r}"
        self.task_pid = int(line)

    def guard_pid(self) -> int:
        (pid,) = [p for p in descendants(self.proc.pid) if "reaper.py guard" in cmdline(p)]
        return pid

    def sigkill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # a clean stop
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f and not f.closed:
                f.close()


def kill_leftovers(pids: Iterator[int] | list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_no_process_of_the_task_survives_a_sigkilled_agent(tmp_path: Path) -> None:
    """The parent-death signal takes only the shell; the agent's guard takes the sleeps, at once."""
    agent = TreeAgent(tmp_path / "victim.task.json")
    sleeps: dict[str, int] = {}
    try:
        sleeps = sleeps_of(agent.proc.pid, "sleep 600", "sleep 601")
        agent.sigkill()
        for name, pid in sleeps.items():
            wait_until(lambda pid=pid: not alive(pid), timeout=10, what=f"{name} killed with its agent")
        assert not alive(agent.task_pid)
    finally:
        agent.close()
        kill_leftovers(list(sleeps.values()))


@pytest.mark.slow
def test_a_new_agent_kills_what_its_sigkilled_predecessor_left(tmp_path: Path) -> None:
    """Agent and guard both SIGKILLed (an OOM kill of both, say): the sleeps survive, and the next agent,
    reading the task record, kills them before it starts its own task."""
    record = tmp_path / "victim.task.json"
    first = TreeAgent(record)
    second: TreeAgent | None = None
    old: dict[str, int] = {}
    try:
        old = sleeps_of(first.proc.pid, "sleep 600", "sleep 601")
        guard = first.guard_pid()
        os.kill(guard, signal.SIGKILL)
        wait_until(lambda: not alive(guard), what="guard killed")
        first.sigkill()
        wait_until(lambda: not alive(first.task_pid), what="the shell killed by its parent-death signal")
        assert all(alive(pid) for pid in old.values())  # the fault is real: orphans, not in any agent's group
        second = TreeAgent(record)
        assert not any(alive(pid) for pid in old.values())  # killed before the new task started
        new = sleeps_of(second.proc.pid, "sleep 600", "sleep 601")
        assert set(new.values()).isdisjoint(old.values())
        second.close()  # a clean stop takes its own tree
        assert not any(alive(pid) for pid in new.values())
        assert not record.exists()
    finally:
        first.close()
        if second is not None:
            second.close()
        kill_leftovers(list(old.values()))


def test_a_second_agent_for_a_live_agents_task_is_refused(tmp_path: Path) -> None:
    record = tmp_path / "victim.task.json"
    agent = TreeAgent(record)
    try:
        with pytest.raises(SpawnError, match="still supervised by the agent with pid"):
            Supervisor(["true"], name="victim", record=record).start()
        assert alive(agent.task_pid)
    finally:
        agent.close()


def test_a_process_that_left_the_group_dies_with_the_run(supervisors: list[Supervisor]) -> None:
    s = make(supervisors, sh("setsid sleep 602 & exec sleep 603"), name="escapee")
    s.start()
    escaped = sleeps_of(os.getpid(), "sleep 602", "sleep 603")["sleep 602"]
    assert os.getsid(escaped) != os.getsid(s.pid or 0)  # in a session of its own: a group kill misses it
    s.stop()
    assert not alive(escaped)


@pytest.mark.slow
def test_the_agent_adopts_its_tasks_orphans_and_reaps_them(tmp_path: Path) -> None:
    """A subreaping agent: the task's orphan becomes the agent's child (not init's) and, once it exits, does not
    stay a zombie."""
    pidfile = tmp_path / "orphan.pid"
    agent = TreeAgent(tmp_path / "t.task.json", f"(sleep 3 & echo $! > {pidfile}); exec sleep 600")
    try:
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip().isdigit(), what="orphan started")
        orphan = int(pidfile.read_text())

        wait_until(lambda: parent_pid(orphan) == agent.proc.pid, what="orphan re-parented to the agent, not to init")
        wait_until(lambda: not Path(f"/proc/{orphan}").exists(), timeout=20, what="orphan reaped, not a zombie")
    finally:
        agent.close()
