"""Hand-made chaos histories for the checkers' tests: a job that trained, committed, met a fault and restored,
written record by record so that each test can break exactly one promise."""

from __future__ import annotations

from typing import Any

from psguard.chaos.history import Record, operations

#: The trainer's process name in a history.
T = "trainer-100"


class H:
    """A hand-made history: a job trained to ``target`` with commits, a fault, a restore, a final store."""

    def __init__(self, target: int = 20) -> None:
        self.records: list[Record] = []
        self.t = 100.0
        self.target = target
        run = {"target_step": target, "training": {"memory_every": 5, "durable_every": 10, "chunk": 5},
               "liveness_seconds": 60, "loss_tolerance": 0.05, "faults_scheduled": 1, "seed": 0}  # fmt: skip
        self.op("harness", "run", run, run)

    def rec(self, process: str, type: str, f: str, value: dict[str, Any]) -> None:
        self.t += 0.1
        self.records.append(Record(len(self.records), self.t, process, type, f, value))

    def op(self, process: str, f: str, invoke: dict[str, Any], done: dict[str, Any] | None, type: str = "ok") -> None:
        self.rec(process, "invoke", f, invoke)
        if done is not None:
            self.rec(process, type, f, done)

    def train(self, step: int, to: int, p: str = T) -> None:
        self.op(p, "train", {"step": step, "steps": to - step}, {"step": to})

    def commit(self, step: int, durable: bool, p: str = T, type: str = "ok") -> None:
        # As the chaos trainer records it: the digest with the invoke, taken before the capture is handed over.
        self.op(p, "capture", {"step": step, "digest": {"*": f"d{step}"}}, {"step": step})
        self.op(p, "memory-commit", {"step": step}, {"step": step}, type)
        if durable:
            self.op(p, "durable-commit", {"step": step}, {"step": step, "id": f"{step:012d}-aaaaaaaa"}, type)

    def restore(self, step: int, source: str | None = "memory", digest: str | None = None, p: str = T) -> None:
        self.op(p, "restore", {}, {"step": step, "source": source, "digest": {"*": digest or f"d{step}"}})

    def fault(self, f: str = "kill", target: str = "ps:0", **value: Any) -> None:
        self.op("nemesis", f, {"target": target, "fault": f"{f} {target}", **value},
                {"target": target, "fault": f"{f} {target}", **value})  # fmt: skip

    def finish(self, store: list[dict[str, Any]] | None = None, leaks: dict[str, Any] | None = None) -> None:
        self.op(T, "eval", {}, {"loss": 0.5})
        self.op("harness", "final-store", {}, {"checkpoints": store if store is not None else self.store()})
        cleanup = {"alive_pids": [], "busy_ports": [], "temp_files": [], "threads": [], "pids_seen": [1, 2]}
        self.op("harness", "cleanup", {}, {**cleanup, **(leaks or {})})

    def store(self) -> list[dict[str, Any]]:
        ids = [o.value["id"] for o in operations(self.records) if o.f == "durable-commit" and o.type == "ok"]
        return [{"id": i, "step": int(i[:12]), "ok": True, "problems": []} for i in ids]

    def good(self) -> H:
        """Train 0..20, commits at 0, 5, 10 (durable at 0 and 10), PS killed at 10, restored 10, done."""
        self.restore(0, source=None)
        self.commit(0, durable=True)
        self.train(0, 5)
        self.commit(5, durable=False)
        self.train(5, 10)
        self.commit(10, durable=True)
        self.fault()
        self.rec(T, "invoke", "train", {"step": 10, "steps": 5})
        self.rec(T, "info", "train", {"error": "UnavailableError"})
        self.restore(10)
        self.train(10, 15)
        self.train(15, 20)
        return self
