"""The harness trainer's save acknowledgements (memory tier and durable log): awaited off the step loop, each
outcome recorded."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

from psguard.chaos.history import Record, operations
from psguard.demo_trainer import Progress, SaveAcks, cron_came, durable_cadence_due
from psguard.errors import SaveError


class _Info:
    def __init__(self, step: int) -> None:
        self.step, self.id = step, f"ckpt-{step}"


class _Handle:
    """A save whose durable answer comes when the test says so."""

    def __init__(self, step: int, outcome: BaseException | None = None) -> None:
        self.step, self.outcome = step, outcome
        self.answered = threading.Event()

    def result(self, timeout: float | None = None) -> _Info:
        if not self.answered.wait(timeout):
            raise TimeoutError(f"save of step {self.step} not durable within {timeout}s")
        if self.outcome is not None:
            raise self.outcome
        return _Info(self.step)


def _ops(path: Path) -> list[tuple[str, int]]:
    """The durable-commit completions, as (type, step asked)."""
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    ops = [d for d in docs if d["event"] == "op" and d["f"] == "durable-commit"]
    return [(d["type"], d["value"]["asked"]) for d in ops if d["type"] != "invoke"]


def test_add_returns_at_once_and_each_answer_is_recorded_when_it_comes(tmp_path: Path) -> None:
    progress = Progress(str(tmp_path / "progress.jsonl"))
    acks = SaveAcks(progress, timeout=30)
    first, second = _Handle(25), _Handle(50, SaveError("/shards/write failed on ps:1: node lost"))
    acks.add(25, first, acks.begin(25))
    acks.add(50, second, acks.begin(50))  # neither call waited for an answer
    assert acks.acked is None and _ops(tmp_path / "progress.jsonl") == []
    second.answered.set()
    first.answered.set()
    acks.join(30)
    assert sorted(_ops(tmp_path / "progress.jsonl")) == [("fail", 50), ("ok", 25)]
    assert acks.acked == 25  # a failed save is not acknowledged, and the job went on
    progress.close()


class _MemoryHandle:
    """A save whose memory tier answers when the test says so (``restorable``), or refuses it."""

    def __init__(self, outcome: BaseException | None = None) -> None:
        self.outcome = outcome
        self.answered = threading.Event()

    def restorable(self, timeout: float | None = None) -> None:
        if not self.answered.wait(timeout):
            raise TimeoutError("not in the memory tier in time")
        if self.outcome is not None:
            raise self.outcome


def test_memory_answers_are_awaited_off_the_step_loop_each_its_own_operation(tmp_path: Path) -> None:
    """The harness waited for each memory acknowledgement in the step loop: 15 ms per capture that a user's job
    does not spend (explore seed 21 case 1 judged psguard's pace with it in)."""
    path = tmp_path / "progress.jsonl"
    progress = Progress(str(path))
    acks = SaveAcks(progress, timeout=1.0)
    kept, refused, late = _MemoryHandle(), _MemoryHandle(SaveError("refused: ps:1 restarted")), _MemoryHandle()
    for step, handle in ((10, kept), (20, refused), (30, late)):
        acks.memory(step, handle, acks.begin(step, "memory"))  # returns at once: nothing has answered
    refused.answered.set()
    kept.answered.set()
    acks.join(30)  # the late one is recorded unknown at the timeout
    progress.close()
    records = []
    for n, line in enumerate(path.read_text().splitlines()):
        d = json.loads(line)
        records.append(Record(n, d["mono"], d["process"], d["type"], d["f"], d["value"]))
    ops = operations(records)
    assert sorted((o.invoke.value["step"], o.type) for o in ops) == [(10, "ok"), (20, "fail"), (30, "info")]
    assert all(o.f == "memory-commit" and "/memory-" in o.process for o in ops) and len({o.process for o in ops}) == 3


def test_an_old_generations_answer_is_recorded_but_not_taken_for_the_new_ones(tmp_path: Path) -> None:
    progress = Progress(str(tmp_path / "progress.jsonl"))
    acks = SaveAcks(progress, timeout=30)
    late = _Handle(75)
    acks.add(75, late, acks.begin(75))
    acks.new_generation(50)  # a recovery restored step 50 while step 75's write was still open
    late.answered.set()
    acks.join(30)
    assert _ops(tmp_path / "progress.jsonl") == [("ok", 75)]
    assert acks.acked == 50


def test_an_answer_that_never_comes_is_recorded_unknown_at_the_timeout(tmp_path: Path) -> None:
    progress = Progress(str(tmp_path / "progress.jsonl"))
    acks = SaveAcks(progress, timeout=0.2)
    acks.add(25, _Handle(25), acks.begin(25))
    acks.join(30)
    assert _ops(tmp_path / "progress.jsonl") == [("info", 25)]
    progress.close()
    acks.add(30, _Handle(30), acks.begin(30))
    acks.join(30)  # an answer after the trainer closed its progress file is dropped, not an error
    assert _ops(tmp_path / "progress.jsonl") == [("info", 25)]


def test_open_saves_are_operations_of_processes_of_their_own_so_the_history_pairs_them(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    progress = Progress(str(path))
    acks = SaveAcks(progress, timeout=30)
    handles = [_Handle(100), _Handle(200)]
    for h in handles:
        acks.add(h.step, h, acks.begin(h.step))  # both open at once
    handles[1].answered.set()
    acks.join(0.5)
    handles[0].answered.set()
    acks.join(30)
    progress.close()
    records = []
    for n, line in enumerate(path.read_text().splitlines()):
        d = json.loads(line)
        records.append(Record(n, d["mono"], d["process"], d["type"], d["f"], d["value"]))
    ops = operations(records)  # raises on a completion without its invoke
    assert sorted((o.invoke.value["step"], o.value["asked"], o.type) for o in ops) == [
        (100, 100, "ok"),
        (200, 200, "ok"),
    ]
    assert len({o.process for o in ops}) == 2 and all(o.process.startswith("trainer-") for o in ops)


def test_a_durable_commit_is_invoked_before_its_save_and_unknown_when_the_save_fails(tmp_path: Path) -> None:
    """Under the default durable_lag the save returns once committed: its commit is in flight (and recorded so,
    for the faults that wait for one) while the save runs; a save that raises leaves its commit's outcome open."""
    path = tmp_path / "progress.jsonl"
    progress = Progress(str(path))
    acks = SaveAcks(progress, timeout=30)
    process = acks.begin(40)
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(d["type"], d["f"], d["process"]) for d in docs if d["event"] == "op"] == [
        ("invoke", "durable-commit", process)
    ]
    acks.unknown(process, 40, "UnavailableError: ps:0 lost")
    assert _ops(path) == [("info", 40)]
    progress.close()


def test_the_durable_cadence_counts_steps_and_keeps_its_time_floor() -> None:
    """The rule both sides of a chaos case save on (the plain-TF baseline ignored the time floor, so a case with
    one compared psguard with a baseline that saved more often: explore case 3 of seed 3)."""
    assert durable_cadence_due(None, None, 0, 40, 2.0, now=100.0)  # nothing saved yet
    assert not durable_cadence_due(40, 99.5, 79, 40, 2.0, now=100.0)  # 39 steps
    assert not durable_cadence_due(40, 99.5, 80, 40, 2.0, now=100.0)  # 40 steps, but 0.5 s
    assert durable_cadence_due(40, 98.0, 80, 40, 2.0, now=100.0)  # 40 steps and 2 s
    assert durable_cadence_due(40, None, 80, 40, 2.0, now=100.0)  # a new process: no floor yet
    assert durable_cadence_due(40, 99.9, 80, 40, 0.0, now=100.0)  # no floor


def test_a_durable_cron_saves_whenever_one_of_its_times_came_since_the_last_durable_save() -> None:
    """``--durable-cron``: the clock's cadence beside the steps' (any rule saves, as in a policy file), decided by
    psguard's own Cron; both sides of a chaos case save on it."""
    every_20s = "* * * * * */20"  # a sixth field counts seconds: :00, :20, :40 of every minute
    assert not cron_came(every_20s, since=1000.0, now=1019.9)  # 1000 is :40 past; the next time is 1020
    assert cron_came(every_20s, since=1000.0, now=1020.0)
    assert cron_came(every_20s, since=1000.0, now=1100.0)  # several came: one save
    assert not cron_came(None, since=1000.0, now=5000.0)  # no cron: the steps alone


class _Manager:
    """A manager whose save sees what the history holds when the save is handed off, and whose memory tier
    has already answered by the time ``save`` returns (it waited on the durable log meanwhile)."""

    last_hold_seconds = 0.1

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[tuple[str, str]] = []

    def save(self, step: int, tiers: object) -> _MemoryHandle:
        self.called_at = time.monotonic()
        docs = [json.loads(line) for line in self.path.read_text().splitlines()]
        self.seen = [(d["type"], d["f"]) for d in docs if d["event"] == "op"]
        handle = _MemoryHandle()
        handle.answered.set()
        handle.stall_seconds = 0.01  # type: ignore[attr-defined]
        return handle


def test_a_saves_memory_commit_is_invoked_before_the_save_is_handed_off(tmp_path: Path) -> None:
    """Explore seed 25 case 7: the memory tier applied step 235 on every PS agent, then a PS node was lost, then
    ``save`` returned (it had waited on the durable log) and the harness recorded the memory commit's invoke
    only then, after the loss: the checker took a commit made before the node loss for one made after it."""
    from types import SimpleNamespace

    from psguard.demo_trainer import Cadence, DemoTrainer

    path = tmp_path / "progress.jsonl"
    trainer = object.__new__(DemoTrainer)
    trainer.args = SimpleNamespace(digest=False, durable_every=1000, durable_min_seconds=0.0, durable_cron=None)
    trainer.progress = Progress(str(path), fsync=False)
    trainer.state = Cadence(durable=0, durable_at=None)
    trainer.acks = SaveAcks(trainer.progress, timeout=5)
    manager = _Manager(path)
    job = SimpleNamespace(model=None, optimizer=None, manager=manager)
    trainer.save(job, 5)  # type: ignore[arg-type]
    trainer.acks.join(5)
    trainer.progress.close()
    assert ("invoke", "memory-commit") in manager.seen  # in flight from the hand-off on
    docs = [json.loads(line) for line in path.read_text().splitlines() if '"op"' in line]
    assert [(d["type"], d["f"]) for d in docs if d["f"] == "memory-commit"] == [("invoke", "memory-commit"),
                                                                              ("ok", "memory-commit")]  # fmt: skip


def test_the_durable_floor_counts_from_the_start_of_the_save_as_tfs_saver_hooks_timer() -> None:
    """Counted from the save's end, the rule "every 10 steps, 2 s apart" let plain TF (4 s saves) save every ~70
    steps and psguard (2.3 s) every ~27, and judged psguard slower for saving more often (explore seed 26 case
    10). TF's ``CheckpointSaverHook`` counts its timer from the trigger; both trainers do now."""
    from types import SimpleNamespace

    from psguard.demo_trainer import Cadence, DemoTrainer

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "progress.jsonl"
        trainer = object.__new__(DemoTrainer)
        trainer.args = SimpleNamespace(digest=False, durable_every=10, durable_min_seconds=2.0, durable_cron=None)
        trainer.progress = Progress(str(path), fsync=False)
        trainer.state = Cadence()
        trainer.acks = SaveAcks(trainer.progress, timeout=5)
        manager = _Manager(path)
        trainer.save(SimpleNamespace(model=None, optimizer=None, manager=manager), 10)  # type: ignore[arg-type]
        trainer.acks.join(5)
        trainer.progress.close()
    assert trainer.state.durable == 10
    assert trainer.state.durable_at is not None and trainer.state.durable_at <= manager.called_at
