"""The chaos run's history: every operation as an invoke record and a completion, in one append-only file.

Jepsen's model. An operation is a pair of records with the same ``process`` and ``f``: an ``invoke`` written
before the operation starts, and a completion written after it ends: ``ok`` (it happened), ``fail`` (it
certainly did not happen) or ``info`` (unknown: the process died or timed out mid-operation, so the operation
may or may not have taken effect). Faults are operations of the ``nemesis`` process, and a fault's invoke is
written (and fsynced) *before* the fault is injected: a crash of the harness between the two can only leave
a fault recorded that did not happen, never one that happened unrecorded.

``time`` is ``time.monotonic()`` of the writer. On Linux that clock is system-wide (``CLOCK_MONOTONIC``), so
records written by the trainer process and by the harness compare directly; a wall clock could step.

Each record is one JSON line, written with one ``write`` and fsynced. A write that fails raises
:class:`HistoryError`: a run whose history is incomplete proves nothing, so the runner stops.

A process has one operation of each ``f`` open at a time, unless its records carry an ``op_id`` in their value:
then an invoke pairs with the completion of the same ``op_id`` (the nemesis runs its faults and heals on threads of
their own, so two restarts of agents may be open at once).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from psguard.errors import PsguardError

__all__ = [
    "COMPLETIONS",
    "HistoryError",
    "HistoryWriter",
    "Op",
    "Record",
    "operations",
    "read_history",
]

RecordType = Literal["invoke", "ok", "fail", "info"]
TYPES: tuple[str, ...] = ("invoke", "ok", "fail", "info")
COMPLETIONS: tuple[str, ...] = ("ok", "fail", "info")


class HistoryError(PsguardError):
    """The history could not be written or read; a run without a complete history cannot be judged."""


@dataclass(frozen=True)
class Record:
    """One line of ``history.jsonl``."""

    index: int
    time: float
    process: str
    type: str
    f: str
    value: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "time": self.time,
            "process": self.process,
            "type": self.type,
            "f": self.f,
            "value": dict(self.value),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], *, where: str = "history") -> Record:
        try:
            index, t, process, kind, f = doc["index"], doc["time"], doc["process"], doc["type"], doc["f"]
        except KeyError as e:
            raise HistoryError(f"{where}: record lacks key {e.args[0]!r}: {dict(doc)}") from None
        value = doc.get("value") or {}
        if kind not in TYPES:
            raise HistoryError(f"{where}: type: expected one of {', '.join(TYPES)}, got {kind!r}")
        if not isinstance(index, int) or not isinstance(t, int | float) or not isinstance(value, Mapping):
            raise HistoryError(f"{where}: index must be an int, time a number and value an object: {dict(doc)}")
        return cls(int(index), float(t), str(process), str(kind), str(f), dict(value))


class HistoryWriter:
    """Appends records to ``history.jsonl``: one ``write`` + ``fsync`` each, indices in write order.

    Thread-safe: the runner's loop and the nemesis's actions append from their own threads, each record whole and
    indices in write order; the runner is the only writer of the file (the trainer's records reach it through
    the runner, see :mod:`psguard.chaos.runner`). ``records`` keeps
    in memory only the records of the processes in ``keep`` (all when ``None``): the checkers read the file, and
    a soak's hour of resource samples and trainer records kept here grew the harness by 85 MB an hour.
    """

    def __init__(self, path: str | os.PathLike[str], *, keep: frozenset[str] | None = None) -> None:
        self.path = Path(path)
        self._keep = keep
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise HistoryError(f"cannot create the history {self.path}: {e}") from e
        self._index = 0
        self._lock = threading.Lock()
        self.records: list[Record] = []

    def append(
        self,
        process: str,
        type: RecordType | str,
        f: str,
        value: Mapping[str, Any] | None = None,
        *,
        at: float | None = None,
    ) -> Record:
        """Write one record durably, or raise :class:`HistoryError` (the run must stop)."""
        if type not in TYPES:
            raise HistoryError(f"record type must be one of {', '.join(TYPES)}, got {type!r}")
        with self._lock:
            record = Record(self._index, time.monotonic() if at is None else at, process, type, f, dict(value or {}))
            line = (json.dumps(record.to_json(), sort_keys=True, default=str) + "\n").encode()
            try:
                written = os.write(self._fd, line)
                if written != len(line):
                    raise OSError(f"short write ({written} of {len(line)} bytes)")
                os.fsync(self._fd)
            except OSError as e:
                raise HistoryError(f"cannot append to the history {self.path}: {e}; stopping the run") from e
            self._index += 1
            if self._keep is None or process in self._keep:
                self.records.append(record)
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_history(path: str | os.PathLike[str]) -> list[Record]:
    """Every record of a history file, in file order. A torn last line (the writer died mid-write) is dropped;
    a malformed line anywhere else is an error."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    out: list[Record] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):
                break  # the last line was being written when the writer died
            raise HistoryError(f"{path}:{n}: not JSON: {e}") from None
        out.append(Record.from_json(doc, where=f"{path}:{n}"))
    return out


@dataclass(frozen=True)
class Op:
    """An invoke paired with its completion (``None`` when the history ends first: outcome unknown)."""

    invoke: Record
    completion: Record | None

    @property
    def f(self) -> str:
        return self.invoke.f

    @property
    def process(self) -> str:
        return self.invoke.process

    @property
    def type(self) -> str:
        """``ok``, ``fail`` or ``info`` (an operation without a completion counts as ``info``)."""
        return self.completion.type if self.completion is not None else "info"

    @property
    def start(self) -> float:
        return self.invoke.time

    @property
    def end(self) -> float | None:
        return self.completion.time if self.completion is not None else None

    @property
    def value(self) -> dict[str, Any]:
        """The invoke's value updated with the completion's (a completion says what actually happened)."""
        out = dict(self.invoke.value)
        if self.completion is not None:
            out.update(self.completion.value)
        return out


def operations(records: Iterable[Record]) -> list[Op]:
    """Pair invokes with completions per process (a process has at most one operation open at a time, per
    ``f`` and ``op_id`` when its records carry one), ordered by invoke time. A completion without an invoke is an
    error in the history."""
    ordered = sorted(records, key=lambda r: (r.time, r.index))
    open_ops: dict[tuple[str, str, Any], Record] = {}
    ops: list[Op] = []
    for r in ordered:
        key = (r.process, r.f, r.value.get("op_id"))
        if r.type == "invoke":
            if key in open_ops:  # the earlier one never completed: its outcome is unknown
                ops.append(Op(open_ops.pop(key), None))
            open_ops[key] = r
        else:
            invoke = open_ops.pop(key, None)
            if invoke is None:
                raise HistoryError(f"record {r.index}: {r.type} of {r.process} {r.f} has no invoke")
            ops.append(Op(invoke, r))
    ops.extend(Op(r, None) for r in open_ops.values())
    ops.sort(key=lambda o: (o.start, o.invoke.index))
    return ops


def iter_ops(ops: Iterable[Op], f: str | tuple[str, ...], type: str | None = None) -> Iterator[Op]:
    fs = (f,) if isinstance(f, str) else f
    return (o for o in ops if o.f in fs and (type is None or o.type == type))


def harness_seconds(ops: Iterable[Op], begin: float, end: float) -> float:
    """Seconds the trainers spent on the harness's own work (``harness_seconds``: the restore-exact digests)
    in operations started in ``[begin, end)``: time a user's job would not spend, left out of its pace."""
    return sum(
        float(o.value.get("harness_seconds") or 0.0)
        for o in ops
        if o.process.startswith("trainer") and begin <= o.start < end
    )
