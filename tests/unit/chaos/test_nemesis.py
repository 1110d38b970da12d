"""The nemesis's schedule (psguard.chaos.nemesis): every fault and heal fires on its time whatever another action
is waiting for, and the history pairs each one's invoke with its completion, recorded when it ends.

The run that found it: a storage outage of 20 s was healed only after a restarted chief agent's start ended (the
nemesis ran its actions in turn), 75 s after the store went down."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from psguard.chaos.history import HistoryWriter, Record, operations, read_history
from psguard.chaos.nemesis import Nemesis
from psguard.chaos.scenario import Scenario
from psguard.config import from_data
from psguard.testbed.s3_server import pdeathsig_prefix

#: How late a heal may fire on a loaded 2-core machine (its thread started, the history fsynced).
LATE = 1.5


class Storage:
    """A storage server whose stop hangs until ``release`` (a stop that waits for something that does not come
    during the test), and whose restart starts a real server process as the testbed's do: under a parent-death
    signal, which the kernel sends when the *thread* that started it ends."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.stopping = threading.Event()
        self.server: subprocess.Popen[bytes] | None = None

    def stop(self, timeout: float | None = None) -> None:
        self.stopping.set()
        self.release.wait()

    def restart(self) -> None:
        sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
        self.server = subprocess.Popen(pdeathsig_prefix(True) + sleep)


class Task:
    """A task without an agent (``TaskProcess``): a real process the nemesis stops and continues."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        return {"pid": self.proc.pid, "agent_pid": None}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Watched(HistoryWriter):
    """The history, with an event per ``ok`` of ``f`` seen ``n`` times (awaited instead of polling the file)."""

    def __init__(self, path: Path, f: str, n: int) -> None:
        super().__init__(path)
        self.f, self.n, self.seen = f, n, 0
        self.done = threading.Event()

    def append(self, process: str, type: str, f: str, value: Any = None, *, at: float | None = None) -> Record:
        record = super().append(process, type, f, value, at=at)
        if type == "ok" and f == self.f:
            self.seen += 1
            if self.seen >= self.n:
                self.done.set()
        return record


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) sets the parent-death signal")
def test_a_heal_fires_on_its_time_while_another_action_is_still_waiting(tmp_path: Path) -> None:
    scenario = from_data(
        Scenario,
        {
            "name": "t",
            "proves": "x",
            "storage": {"kind": "s3"},
            "faults": [
                {"action": "storage-outage", "target": "store", "at_time": 0, "duration": 0.2},  # its stop hangs
                {"action": "pause", "target": "ps:*", "at_time": 0, "duration": 0.5},  # ps:0 and ps:1
            ],
        },
        source="t.yaml",
    )
    storage, tasks = Storage(), {"ps0": Task(), "ps1": Task()}
    history = Watched(tmp_path / "history.jsonl", "resume", n=2)
    nemesis = Nemesis(scenario, list(scenario.schedule(0)), history, tasks, store_dir=None, storage=storage, seed=0)
    ticked = threading.Thread(target=nemesis.tick, args=(None, 0.0), name="tick")
    try:
        ticked.start()
        ticked.join(10)
        assert not ticked.is_alive(), "tick waited for an action to end"
        assert storage.stopping.wait(30)
        assert history.done.wait(30), "the pauses were not healed while the storage's stop hung"
        assert not storage.release.is_set() and nemesis.healing  # the stop is still waiting
        ops = operations(history.records)
        paused = {o.value["target"]: o for o in ops if o.f == "pause"}
        resumed = {o.value["target"]: o for o in ops if o.f == "resume"}
        assert sorted(paused) == sorted(resumed) == ["ps:0", "ps:1"]
        for target, pause in paused.items():
            heal = resumed[target]
            assert pause.type == heal.type == "ok" and pause.end is not None
            assert 0.5 <= heal.start - pause.end <= 0.5 + LATE, (target, heal.start - pause.end)
        (stop,) = [o for o in ops if o.f == "storage-stop"]
        assert stop.type == "info" and stop.completion is None  # invoked, still running: no completion yet
        storage.release.set()
        nemesis.heal_all()  # the final phase: the store's heal comes once its stop ends
        assert storage.server is not None
        with pytest.raises(subprocess.TimeoutExpired):  # the server outlives its heal (it died with its thread)
            storage.server.wait(1)
    finally:
        storage.release.set()
        nemesis.close()
        history.close()
        for task in tasks.values():
            task.close()
        if storage.server is not None:
            storage.server.kill()
            storage.server.wait()
    final = {o.f: o.type for o in operations(read_history(tmp_path / "history.jsonl"))}
    assert final == {"storage-stop": "ok", "storage-start": "ok", "pause": "ok", "resume": "ok"}


class Chief(Task):
    """The chief's agent as the nemesis sees it: a task, and its persister, in flight or not."""

    def __init__(self, in_flight: bool) -> None:
        super().__init__()
        self.in_flight = in_flight
        self.polls = 0

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        self.polls += 1
        return {**super().status(timeout), "persister": {"in_flight": self.in_flight}}


def _during_commit(target: str) -> Scenario:
    fault = {"action": "kill", "target": target, "at_step": 10, "during": "durable-commit"}
    doc = {"name": "t", "proves": "x", "cluster": {"ps": 1, "workers": 1}, "faults": [fault]}
    return from_data(Scenario, doc, source="t.yaml")


def _fire_once(nemesis: Nemesis, history: Watched) -> Any:
    nemesis.tick(10, 1.0, 10)  # step 10 reached, a durable commit of step 10 invoked since the last tick
    assert history.done.wait(30), "the fault never fired"
    nemesis.heal_all()
    (kill,) = [o for o in operations(history.records) if o.f == "kill"]
    return kill


def test_a_fault_on_any_task_during_a_durable_commit_waits_for_the_chiefs_persister(tmp_path: Path) -> None:
    """The persister lives on the chief's agent; a worker's or a PS's /status has none. The nemesis polled the
    target's agent, so a fault on a worker 'during a durable-commit' never found one in flight (it waited 10 s,
    then recorded ``persist_in_flight: false`` and faults-injected judged the run worthless: explore seed 1 case 2)."""
    scenario = _during_commit("worker:0")
    chief, worker = Chief(in_flight=True), Task()
    history = Watched(tmp_path / "history.jsonl", "kill", n=1)
    agents = {"chief": chief, "worker0": worker}
    nemesis = Nemesis(scenario, list(scenario.faults), history, agents, store_dir=None, storage=None, seed=0)
    try:
        kill = _fire_once(nemesis, history)
        assert kill.value["moment"] == "durable-commit" and kill.value["moment_found"] is True and chief.polls >= 1
        assert kill.value["target"] == "worker:0" and worker.proc.wait(10) == -9
    finally:
        nemesis.close()
        history.close()
        chief.close()
        worker.close()


def test_plain_tf_has_no_persister_to_wait_for_its_fault_fires_at_the_save(tmp_path: Path) -> None:
    """The baseline saves in its trainer, synchronously: the runner fires a 'during a durable-commit' fault once
    that save was invoked. Polling an agent it does not have for a persister delayed its fault 10 s past TF's
    save (and recorded it as not found): TF was judged under a later fault than psguard."""
    from psguard.chaos.baseline import BaselineNemesis

    scenario = _during_commit("ps:0")
    chief, ps = Task(), Task()
    history = Watched(tmp_path / "history.jsonl", "kill", n=1)
    agents = {"chief": chief, "ps0": ps}
    nemesis = BaselineNemesis(scenario, list(scenario.faults), history, agents, store_dir=None, storage=None, seed=0)
    try:
        kill = _fire_once(nemesis, history)
        assert "persist_in_flight" not in kill.value and kill.type == "ok"
        assert ps.proc.wait(10) == -9
    finally:
        nemesis.close()
        history.close()
        chief.close()
        ps.close()


class Persisting(Task):
    """The chief's agent with a persister the test moves through its phases; every look at it is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: str | None = None  # the write in flight's phase (None: idle)
        self.durable: str | None = None  # the log's newest checkpoint
        self.written = 0  # checkpoints written
        self.looked = threading.Condition()
        self.polls = 0

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        with self.looked:
            self.polls += 1
            self.looked.notify_all()
            persister = {"in_flight": self.phase is not None, "phase": self.phase, "pending_requests": 0,
                         "checkpoints_written": self.written}  # fmt: skip
            return {**super().status(timeout), "persister": persister, "durable_checkpoint": self.durable}

    def looked_again(self, times: int = 3) -> None:
        with self.looked:
            until = self.polls + times
            assert self.looked.wait_for(lambda: self.polls >= until, 30)


def _during(moment: str, **training: Any) -> Scenario:
    fault = {"action": "kill", "target": "worker:0", "at_step": 10, "during": moment}
    doc = {"name": "t", "proves": "x", "cluster": {"ps": 1, "workers": 1}, "faults": [fault], "training": training}
    return from_data(Scenario, doc, source="t.yaml")


def test_a_fault_during_a_gc_waits_for_the_persisters_retention_phase(tmp_path: Path) -> None:
    scenario = _during("gc", max_to_keep=2)
    chief, worker = Persisting(), Task()
    history = Watched(tmp_path / "history.jsonl", "kill", n=1)
    agents = {"chief": chief, "worker0": worker}
    nemesis = Nemesis(scenario, list(scenario.faults), history, agents, store_dir=None, storage=None, seed=0)
    try:
        nemesis.tick(10, 1.0)
        chief.looked_again()
        chief.phase = "delta"  # a persist, but not its gc yet
        chief.looked_again()
        assert not [r for r in history.records if r.f == "kill"] and worker.proc.poll() is None
        chief.phase = "retention"
        assert history.done.wait(30)
        nemesis.heal_all()
        (kill,) = [o for o in operations(history.records) if o.f == "kill"]
        assert kill.value["moment"] == "gc" and kill.value["moment_found"] is True
        assert kill.value["persister"]["phase"] == "retention" and worker.proc.wait(10) == -9
    finally:
        nemesis.close()
        history.close()
        chief.close()
        worker.close()


def test_a_first_base_already_written_is_a_moment_missed_and_a_run_that_ends_first_injects_nothing(
    tmp_path: Path,
) -> None:
    chief, worker = Persisting(), Task()
    agents = {"chief": chief, "worker0": worker}
    first, compaction = _during("first-base"), _during("compaction")
    history, other = Watched(tmp_path / "first.jsonl", "kill", n=1), HistoryWriter(tmp_path / "compaction.jsonl")
    nemesis = Nemesis(first, list(first.faults), history, agents, store_dir=None, storage=None, seed=0)
    later = Nemesis(compaction, list(compaction.faults), other, agents, store_dir=None, storage=None, seed=0)
    try:
        chief.durable = "00000005-aa"  # the log's first base is committed: its moment never comes again
        nemesis.tick(10, 1.0)
        assert history.done.wait(30)  # fired anyway, and says it was not the fault asked for
        nemesis.heal_all()
        (kill,) = [o for o in operations(history.records) if o.f == "kill"]
        assert kill.type == "ok" and kill.value["moment_found"] is False and kill.value["moment"] == "first-base"
        later.tick(10, 1.0)  # an idle persister: no new base comes before the job ends
        chief.looked_again()
        later.job_ended()
        later.heal_all()
        assert not later.healing
        missed = [(o.f, o.type, o.value["moment"], o.value["error"]) for o in operations(other.records)]
        assert missed == [("kill", "fail", "compaction", "the run ended before a compaction came")]
    finally:
        nemesis.close()
        later.close()
        history.close()
        other.close()
        chief.close()
        worker.close()


def _commit_then_kill(during: str = "durable-commit") -> Scenario:
    faults = [{"action": "kill", "target": "worker:0", "at_step": 10, "during": during},
              {"action": "kill", "target": "ps:0", "at_step": 20}]  # fmt: skip
    doc = {"name": "t", "proves": "x", "cluster": {"ps": 1, "workers": 1}, "faults": faults}
    return from_data(Scenario, doc, source="t.yaml")


@contextlib.contextmanager
def _commit_then_kill_run(
    path: Path, cls: type[Nemesis], chief: Task, kills: int, during: str = "durable-commit"
) -> Iterator[tuple[Nemesis, Watched, Task, Task]]:
    """:func:`_commit_then_kill`'s nemesis over a worker and a PS (real processes) with ``chief`` as the chief's
    agent, its history awaiting ``kills`` kills; everything stopped after."""
    scenario = _commit_then_kill(during)
    worker, ps = Task(), Task()
    history = Watched(path, "kill", n=kills)
    run = {"faults_scheduled": len(scenario.faults)}
    history.append("harness", "invoke", "run", run)
    history.append("harness", "ok", "run", run)
    agents = {"chief": chief, "worker0": worker, "ps0": ps}
    nemesis = cls(scenario, list(scenario.faults), history, agents, store_dir=None, storage=None, seed=0)
    try:
        yield nemesis, history, worker, ps
    finally:
        nemesis.close()
        history.close()
        for task in (chief, worker, ps):
            task.close()


def test_a_fault_during_a_durable_commit_waits_for_a_write_it_sees_and_holds_back_no_later_fault(
    tmp_path: Path,
) -> None:
    """A fast local write is over before the first look: the next one is waited for, however far off, while the
    faults after it fire on their steps. It was due only once the runner saw the trainer's ask (every later fault
    waited behind it: explore seed 5 case 13's node loss at 75 came at 85) and then watched the persister 10 s."""
    chief = Persisting()
    with _commit_then_kill_run(tmp_path / "history.jsonl", Nemesis, chief, kills=2) as (nemesis, history, worker, ps):
        nemesis.tick(10, 1.0)  # step 10: no durable commit asked for yet
        chief.looked_again()
        nemesis.tick(20, 2.0)  # the next fault's step
        assert ps.proc.wait(10) == -9 and worker.proc.poll() is None
        chief.written += 1  # a write came and went between two looks
        chief.looked_again()
        assert worker.proc.poll() is None
        chief.phase = "delta"  # the next one is seen in flight
        assert history.done.wait(30)
        nemesis.heal_all()
        (kill,) = [o for o in operations(history.records) if o.f == "kill" and o.value["target"] == "worker:0"]
        assert kill.type == "ok" and kill.value["moment"] == "durable-commit" and kill.value["moment_found"] is True
        assert kill.value["writes_unseen"] == 1 and "missed" not in kill.value and worker.proc.wait(10) == -9


@pytest.mark.parametrize("side", ["psguard", "baseline"])
def test_a_durable_commit_that_never_comes_is_a_moment_missed_not_a_fault_left_unfired(
    tmp_path: Path, side: str
) -> None:
    """The job ends before a durable commit follows the fault's step (on plain TF: before its trainer saves): the
    fault is recorded as not injected and missed, and faults-injected says so (explore counts the case apart)."""
    from psguard.chaos.baseline import BaselineNemesis
    from psguard.chaos.checkers import check_all, missed_moments

    chief = Persisting() if side == "psguard" else Task()
    cls = Nemesis if side == "psguard" else BaselineNemesis
    with _commit_then_kill_run(tmp_path / "history.jsonl", cls, chief, kills=1) as (nemesis, history, worker, _):
        nemesis.tick(20, 2.0)  # both due; no durable commit asked for
        assert history.done.wait(30)  # the PS's kill was not held back
        if isinstance(chief, Persisting):
            chief.looked_again()
        nemesis.job_ended()
        nemesis.heal_all()
        assert not nemesis.healing and worker.proc.poll() is None
        (missed,) = [o for o in operations(history.records) if o.value.get("target") == "worker:0"]
        assert (missed.f, missed.type, missed.value["moment"], missed.value["missed"]) == (
            "kill", "fail", "durable-commit", True)  # fmt: skip
        assert missed.value["error"] == "the run ended before a durable-commit came"
        verdict = check_all(history.records)["faults-injected"]
        assert verdict.summary == "missed: durable-commit" and missed_moments(verdict) == ["durable-commit"]


@pytest.mark.parametrize("side", ["psguard", "baseline"])
def test_a_fault_during_a_restore_holds_back_no_later_fault_and_a_restore_that_never_comes_is_missed(
    tmp_path: Path, side: str
) -> None:
    """A fault aimed at a restore waited at the head of the schedule: every later fault waited behind it, for ever
    when no restore came, and the run was judged by faults-injected as a harness failure (explore seed 22 cases 11
    and 13). Now the later fault fires on its step and the one still waiting at the job's end is recorded missed."""
    from psguard.chaos.baseline import BaselineNemesis
    from psguard.chaos.checkers import check_all, missed_moments

    cls = Nemesis if side == "psguard" else BaselineNemesis
    with _commit_then_kill_run(tmp_path / "history.jsonl", cls, Task(), kills=1, during="restore") as run:
        nemesis, history, worker, ps = run
        nemesis.tick(10, 1.0)  # the restore fault's step, no restore in flight: held
        nemesis.tick(20, 2.0)  # the next fault's step
        assert history.done.wait(30) and ps.proc.wait(10) == -9  # not held back
        assert worker.proc.poll() is None and not nemesis.done
        nemesis.job_ended()
        nemesis.heal_all()
        assert nemesis.done and worker.proc.poll() is None
        (missed,) = [o for o in operations(history.records) if o.f == "kill" and o.type != "ok"]
        assert (missed.type, missed.value["moment"], missed.value["missed"]) == ("fail", "restore", True)
        assert missed.value["error"] == "the run ended before a restore came"
        verdict = check_all(history.records)["faults-injected"]
        assert verdict.summary == "missed: restore" and missed_moments(verdict) == ["restore"]


def test_a_held_fault_fires_when_a_restore_is_in_flight(tmp_path: Path) -> None:
    with _commit_then_kill_run(tmp_path / "history.jsonl", Nemesis, Task(), kills=1, during="restore") as run:
        nemesis, history, worker, ps = run
        nemesis.tick(12, 1.0)  # due, no restore yet
        nemesis.tick(14, 1.5, restoring=True)  # a trainer's restore is in flight
        assert history.done.wait(30) and worker.proc.wait(10) == -9 and ps.proc.poll() is None
        nemesis.heal_all()
        (kill,) = [o for o in operations(history.records) if o.f == "kill"]
        assert kill.type == "ok" and kill.value["target"] == "worker:0" and kill.value["at_step"] == 14


def test_plain_tfs_fault_during_a_durable_commit_fires_at_its_next_save(tmp_path: Path) -> None:
    from psguard.chaos.baseline import BaselineNemesis

    with _commit_then_kill_run(tmp_path / "history.jsonl", BaselineNemesis, Task(), kills=2) as run:
        nemesis, history, worker, ps = run
        nemesis.tick(20, 2.0)
        assert ps.proc.wait(10) == -9 and worker.proc.poll() is None  # TF has not saved since step 10
        nemesis.tick(25, 2.5, 25)  # TF's save of step 25 invoked
        assert history.done.wait(30)
        nemesis.heal_all()
        (kill,) = [o for o in operations(history.records) if o.value.get("target") == "worker:0"]
        assert kill.type == "ok" and kill.value["durable_commit_step"] == 25 and worker.proc.wait(10) == -9


def test_plain_tf_has_no_persisters_moments_its_fault_fires_at_its_step(tmp_path: Path) -> None:
    from psguard.chaos.baseline import BaselineNemesis

    scenario = _during("compaction")
    chief, worker = Task(), Task()
    history = Watched(tmp_path / "history.jsonl", "kill", n=1)
    agents = {"chief": chief, "worker0": worker}
    nemesis = BaselineNemesis(scenario, list(scenario.faults), history, agents, store_dir=None, storage=None, seed=0)
    try:
        nemesis.tick(10, 1.0)
        assert history.done.wait(30)
        nemesis.heal_all()
        (kill,) = [o for o in operations(history.records) if o.f == "kill"]
        assert kill.type == "ok" and "moment_found" not in kill.value and worker.proc.wait(10) == -9
    finally:
        nemesis.close()
        history.close()
        chief.close()
        worker.close()


def test_store_errors_answer_every_request_with_the_status_until_healed(tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    from psguard.chaos.http_faults import HttpErrorProxy

    fault = {"action": "store-errors", "target": "store", "at_step": 10, "duration": 60, "http_status": 500}
    doc = {"name": "t", "proves": "x", "storage": {"kind": "gcs"}, "faults": [fault]}
    scenario = from_data(Scenario, doc, source="t.yaml")
    history = Watched(tmp_path / "history.jsonl", "store-errors", n=1)
    with HttpErrorProxy("http://127.0.0.1:9", dialect="gcs") as proxy:  # nothing upstream: no request forwarded
        nemesis = Nemesis(
            scenario, list(scenario.faults), history, {}, store_dir=None, storage=None, seed=0, store_errors=proxy
        )
        try:
            nemesis.tick(10, 1.0)
            assert history.done.wait(30)
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(f"{proxy.endpoint_url}/storage/v1/b/x/o", timeout=10)
            assert answer.value.code == 500 and b"internalError" in answer.value.read()
            nemesis.heal_all()  # the final phase heals it at once
            assert proxy.failed == 1 and proxy._take_fault() is None  # forwarding again
        finally:
            nemesis.close()
            history.close()
    ops = {o.f: (o.type, o.value.get("http_status")) for o in operations(read_history(tmp_path / "history.jsonl"))}
    assert ops == {"store-errors": ("ok", 500), "heal": ("ok", None)}
