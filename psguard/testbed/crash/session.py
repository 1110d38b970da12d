"""One run of a workload: where it happens, and what the workload uses in the child that runs it.

The workload prepares what it needs (earlier commits, a spool with captures) unrecorded, calls
:meth:`Session.begin`, and from then on every mutating call is a crash point. It writes its history, Jepsen's
model as the chaos harness's history has it (which nothing outside the harness imports): an ``invoke`` before
each operation and an ``ok`` once it returned, each a line written at once and fsynced outside the store, so the
checker knows what was acknowledged before the crash.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psguard.storage import RetryConfig, open_backend
from psguard.storage.retry import RetryingBackend
from psguard.store import Store
from psguard.testbed.crash.lazyfs import PageCache
from psguard.testbed.crash.recorder import CrashPlan, FsRecorder, RecordingBackend

__all__ = ["CHUNK_BYTES", "History", "Op", "Run", "Session", "read_ops"]

#: Chunks of a few rows: a save of the workloads' small tensors cuts several chunks per tensor, as a real one does.
CHUNK_BYTES = 128
#: How long a storage call of a workload or a check may keep retrying (a crash is not an outage).
RETRY = RetryConfig(deadline=20.0)


@dataclass(frozen=True)
class Op:
    """One operation of a run: what its invoke said, updated by its ok; ``done`` False if it was in flight."""

    f: str
    invoked: dict[str, Any]
    value: dict[str, Any]
    done: bool


class History:
    """A run's operations, appended as they happen: each record one ``write`` and an ``fsync``."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)

    def append(self, kind: str, f: str, value: Mapping[str, Any]) -> None:
        line = (json.dumps({"type": kind, "f": f, "value": dict(value)}) + "\n").encode()
        if os.write(self._fd, line) != len(line):
            raise OSError(f"a short write to the history of {f}")
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_ops(path: Path) -> list[Op]:
    """The operations of a history, in order (a line the crash cut short is dropped: it was never written)."""
    ops: list[Op] = []
    for line in path.read_text().split("\n"):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc["type"] == "invoke":
            ops.append(Op(doc["f"], dict(doc["value"]), dict(doc["value"]), False))
        else:
            i = max(i for i, op in enumerate(ops) if op.f == doc["f"] and not op.done)
            ops[i] = Op(ops[i].f, ops[i].invoked, {**ops[i].value, **doc["value"]}, True)
    return ops


@dataclass(frozen=True)
class Run:
    """Where one run of a workload happens; its check looks at the same places.

    ``backend``: ``local`` (the store in a folder under ``dir``), ``s3`` (``url`` a prefix of its own) or
    ``tmpfs`` (the hand-off paths: their folders under ``dir``, which is on tmpfs).
    """

    dir: Path
    url: str
    backend: str
    lazyfs: bool = False
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def history(self) -> Path:
        return self.dir / "history.jsonl"

    @property
    def crash_record(self) -> Path:
        return self.dir / "crash.json"

    @property
    def image(self) -> Path:
        """The page cache's durable image, written at a crash in LazyFS mode."""
        return self.dir / "durable.json"

    @property
    def store_root(self) -> Path:
        if self.backend != "local":
            raise ValueError(f"a {self.backend} run has no store folder")
        return Path(self.url)

    def open_store(self, **kwargs: Any) -> Store:
        """The store as a fresh process after the crash opens it (no recorder)."""
        return Store.open(self.url, self.options, retry=RETRY, **kwargs)


class Session:
    """The child's side of a run: recorders installed, the history open, the store over the recorders.

    ``roots``: the folders whose file-system calls are the crash points (a local store's folder, a spool); for
    a store on S3 the backend's requests are. In LazyFS mode a :class:`PageCache` of the local store follows the
    run and its image is written at the crash.
    """

    def __init__(self, run: Run, plan: CrashPlan, roots: Sequence[Path]) -> None:
        self.run = run
        self.plan = plan
        self.cache = PageCache(run.store_root) if run.lazyfs else None
        if roots:
            cache = self.cache
            FsRecorder(
                plan,
                roots,
                names=run.dir,
                on_sync=cache.synced if cache is not None else None,
                on_unlink=cache.unlinking if cache is not None else None,
            ).install()
        if self.cache is not None:
            plan.at_crash.append(self._write_image)
        self.history = History(run.history)

    def store(self, **kwargs: Any) -> Store:
        """A store over the recording backend, one I/O thread (calls in the same order every run)."""
        opened = open_backend(self.run.url, self.run.options, retry=RETRY)
        inner = opened.inner if isinstance(opened, RetryingBackend) else opened
        recorded = RecordingBackend(inner, self.plan, points=self.run.backend == "s3")
        return Store(RetryingBackend(recorded, RETRY), io_threads=1, chunk_bytes=CHUNK_BYTES, **kwargs)

    def begin(self) -> None:
        """From here on every mutating call is a crash point; what exists now counts as durable."""
        if self.cache is not None:
            self.cache.begin()
        self.plan.active = True

    def invoke(self, f: str, **value: Any) -> None:
        self.history.append("invoke", f, value)

    def ok(self, f: str, **value: Any) -> None:
        self.history.append("ok", f, value)

    def _write_image(self) -> None:
        assert self.cache is not None
        data = json.dumps(self.cache.image()).encode()
        fd = os.open(self.run.image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
