"""The harness trainer's durable acknowledgements: awaited off the step loop, each outcome recorded."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from psguard.demo_trainer import DurableAcks, Progress
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
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    return [(d["type"], d["value"]["step"]) for d in docs if d["event"] == "op" and d["f"] == "durable-commit"]


def test_add_returns_at_once_and_each_answer_is_recorded_when_it_comes(tmp_path: Path) -> None:
    progress = Progress(str(tmp_path / "progress.jsonl"))
    acks = DurableAcks(progress, timeout=30)
    first, second = _Handle(25), _Handle(50, SaveError("/shards/write failed on ps:1: node lost"))
    acks.add(25, first)
    acks.add(50, second)  # neither call waited for an answer
    assert acks.acked is None and _ops(tmp_path / "progress.jsonl") == []
    second.answered.set()
    first.answered.set()
    acks.join(30)
    assert sorted(_ops(tmp_path / "progress.jsonl")) == [("fail", 50), ("ok", 25)]
    assert acks.acked == 25  # a failed save is not acknowledged, and the job went on
    progress.close()


def test_an_old_generations_answer_is_recorded_but_not_taken_for_the_new_ones(tmp_path: Path) -> None:
    progress = Progress(str(tmp_path / "progress.jsonl"))
    acks = DurableAcks(progress, timeout=30)
    late = _Handle(75)
    acks.add(75, late)
    acks.new_generation(50)  # a recovery restored step 50 while step 75's write was still open
    late.answered.set()
    acks.join(30)
    assert _ops(tmp_path / "progress.jsonl") == [("ok", 75)]
    assert acks.acked == 50


def test_an_answer_that_never_comes_is_recorded_unknown_at_the_timeout(tmp_path: Path) -> None:
    progress = Progress(str(tmp_path / "progress.jsonl"))
    acks = DurableAcks(progress, timeout=0.2)
    acks.add(25, _Handle(25))
    acks.join(30)
    assert _ops(tmp_path / "progress.jsonl") == [("info", 25)]
    progress.close()
    acks.add(30, _Handle(30))
    acks.join(30)  # an answer after the trainer closed its progress file is dropped, not an error
    assert _ops(tmp_path / "progress.jsonl") == [("info", 25)]
