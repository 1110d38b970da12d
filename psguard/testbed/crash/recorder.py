"""Recording the storage and file-system calls a run makes, and killing the run at one of them.

A crash point sits between two mutating calls: point ``k`` is "call ``k`` has returned, call ``k + 1`` has not
begun" (point ``N``, after the last call, is the run's end). :class:`CrashPlan` numbers the calls as the run makes
them; told to crash at ``k``, it ends the process with :func:`os._exit` as call ``k + 1`` is about to begin (or at
:meth:`CrashPlan.finish`). Whatever the run did between the two calls touched no watched storage, so the store is
as call ``k`` left it; what the run wrote outside the store meanwhile (the acknowledgement of a commit that had
returned) is there too, and the checker holds the store to it.

Two recorders number the calls:

- :class:`RecordingBackend`, around a :class:`~psguard.storage.base.Backend`: every ``put``, ``put_new`` and
  ``delete`` is a call (on an object store each is one request). On a local folder it only names the backend
  call that the file-system calls beneath it belong to.
- :class:`FsRecorder`: every mutating file-system call under the watched folders. ``open`` for writing,
  ``mkdir``, ``rename``, ``link``, ``unlink``, ``rmdir``, ``truncate`` and ``symlink`` come from an audit hook
  (:func:`sys.addaudithook`), which sees them whichever module makes them and however it imported :mod:`os`;
  ``write``, ``pwrite``, ``fsync``, ``fdatasync``, ``posix_fallocate`` and ``copy_file_range`` raise no audit
  event and are wrapped in :mod:`os`. Calls that would change nothing (``mkdir`` of a folder that exists, an
  ``unlink`` of a missing file) are not counted. Writes through a Python file object (``f.write``) raise no
  event: the state after one is the state at the next call, which is a point; writes into a shared mapping are
  no calls at all.

Installing :class:`FsRecorder` changes the process for good (an audit hook cannot be removed): only the child that
runs one workload and dies installs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from psguard.storage.base import Backend, Buffer
from psguard.storage.metered import MeteredBackend

__all__ = ["CRASHED", "CrashPlan", "FsRecorder", "RecordingBackend"]

#: The exit status of a run that died at its crash point.
CRASHED = 75

_THROUGH_FD = re.compile(r"^/proc/(?:self|[0-9]+)/fd/([0-9]+)(/.*)?$")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# os functions without an audit event, and which argument is the file they change.
_FD_CALLS = {"write": 0, "pwrite": 0, "fsync": 0, "fdatasync": 0, "posix_fallocate": 0, "copy_file_range": 1}


class CrashPlan:
    """Numbers a run's mutating calls and, given ``crash_at``, kills the process at that point.

    Calls count only once :attr:`active` (the workload's own preparation is not enumerated). Before dying, the
    plan runs :attr:`at_crash` (a page cache dumps what would survive a power cut) and writes ``record``: the
    point, the call before it and the call after it, which the enumeration compares with the recorded run.
    """

    def __init__(self, crash_at: int | None, record: Path) -> None:
        if crash_at is not None and crash_at < 1:
            raise ValueError(f"crash points are numbered from 1, got {crash_at}")
        self.crash_at = crash_at
        self.record = record
        self.calls: list[str] = []
        self.active = False
        self.at_crash: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._context = threading.local()

    def call(self, what: str) -> None:
        """Call ``what`` is about to begin (from any thread)."""
        if not self.active:
            return
        with self._lock:
            if self.active and self.crash_at is not None and len(self.calls) == self.crash_at:
                self._crash(what)
            self.calls.append(what)

    def finish(self) -> None:
        """The run is over: the point after its last call, then nothing more is counted."""
        with self._lock:
            if self.active and self.crash_at is not None and len(self.calls) == self.crash_at:
                self._crash("(the end of the run)")
            self.active = False

    @contextlib.contextmanager
    def within(self, what: str) -> Iterator[None]:
        """Name the calls this thread makes inside the block after ``what`` (a backend call)."""
        before = getattr(self._context, "what", None)
        self._context.what = what
        try:
            yield
        finally:
            self._context.what = before

    def named(self, what: str) -> str:
        context = getattr(self._context, "what", None)
        return f"{context}: {what}" if context else what

    def _crash(self, following: str) -> NoReturn:
        self.active = False
        for hook in self.at_crash:
            hook()
        doc = {"point": len(self.calls), "after": self.calls[-1] if self.calls else None, "next": following}
        fd = os.open(self.record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, json.dumps(doc).encode())
        finally:
            os.close(fd)
        os._exit(CRASHED)


def _ignore(_: int) -> None:
    return None


class RecordingBackend(MeteredBackend):
    """``inner`` with each mutating call a call of ``plan``; with ``points=False`` (a local folder, whose
    file-system calls are the points) it only names the calls made beneath it."""

    def __init__(self, inner: Backend, plan: CrashPlan, *, points: bool) -> None:
        super().__init__(inner, _ignore)
        self.plan = plan
        self.points = points

    def _mutate(self, what: str, fn: Callable[[], None]) -> None:
        if self.points:
            self.plan.call(what)
        with self.plan.within(what):
            fn()

    def put(self, key: str, data: Buffer) -> None:
        self._mutate(f"put {key}", lambda: self.inner.put(key, data))

    def put_new(self, key: str, data: Buffer) -> None:
        self._mutate(f"put_new {key}", lambda: self.inner.put_new(key, data))

    def delete(self, key: str) -> None:
        self._mutate(f"delete {key}", lambda: self.inner.delete(key))


class FsRecorder:
    """The mutating file-system calls this process makes under ``roots``, each a call of ``plan``.

    ``on_sync(fd, path)`` runs after every successful ``fsync``/``fdatasync`` under the roots and
    ``on_unlink(path)`` before every call that may drop a file's last link (an ``unlink``, a ``rename`` over an
    existing file): how a :class:`~psguard.testbed.crash.lazyfs.PageCache` follows the run. ``names`` is the
    folder that call descriptions are relative to.
    """

    def __init__(
        self,
        plan: CrashPlan,
        roots: Sequence[Path],
        *,
        names: Path,
        on_sync: Callable[[int, str], None] | None = None,
        on_unlink: Callable[[str], None] | None = None,
    ) -> None:
        self.plan = plan
        self.roots = tuple(os.path.abspath(r) for r in roots)
        self.names = os.path.abspath(names)
        self.on_sync = on_sync
        self.on_unlink = on_unlink
        self._events: dict[str, Callable[[tuple[Any, ...]], None]] = {
            "open": self._open,
            "os.mkdir": self._mkdir,
            "os.rmdir": lambda a: self._path_call("rmdir", a[0], a[1]),
            "os.remove": self._remove,
            "os.rename": self._rename,
            "os.link": self._link,
            "os.symlink": lambda a: self._path_call("symlink", a[1], a[2]),
            "os.truncate": self._truncate,
        }

    def install(self) -> None:
        sys.addaudithook(self._audit)
        for name, arg in _FD_CALLS.items():
            setattr(os, name, self._wrap(name, arg, getattr(os, name)))

    # ------------------------------------------------------------------------------------------- paths
    def _resolve(self, path: Any, dir_fd: Any = None) -> str | None:
        """``path`` absolute (relative to ``dir_fd`` when given), if it lies under a root; else None."""
        if isinstance(path, int) or path is None:
            return None
        path = os.fsdecode(path)
        if not os.path.isabs(path):
            base = fd_path(dir_fd) if isinstance(dir_fd, int) and dir_fd >= 0 else os.getcwd()
            if base is None:
                return None
            path = os.path.join(base, path)
        path = os.path.normpath(path)
        held = _THROUGH_FD.match(path)  # a folder held open, reached through its descriptor
        if held is not None:
            folder = fd_path(int(held[1]))
            if folder is None:
                return None
            path = folder + (held[2] or "")
        return path if any(path == r or path.startswith(r + os.sep) for r in self.roots) else None

    def _name(self, verb: str, *paths: str) -> str:
        return self.plan.named(f"{verb} " + " -> ".join(os.path.relpath(p, self.names) for p in paths))

    # ------------------------------------------------------------------------------------------- audit events
    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if self.plan.active:
            handler = self._events.get(event)
            if handler is not None:
                handler(args)

    def _open(self, args: tuple[Any, ...]) -> None:
        path, _mode, flags = args
        if isinstance(flags, int) and flags & _WRITE_FLAGS and (p := self._resolve(path)):
            self.plan.call(self._name("open", p))

    def _mkdir(self, args: tuple[Any, ...]) -> None:
        p = self._resolve(args[0], args[2])
        if p is not None and not os.path.lexists(p):
            self.plan.call(self._name("mkdir", p))

    def _path_call(self, verb: str, path: Any, dir_fd: Any) -> None:
        p = self._resolve(path, dir_fd)
        if p is not None:
            self.plan.call(self._name(verb, p))

    def _remove(self, args: tuple[Any, ...]) -> None:
        p = self._resolve(args[0], args[1])
        if p is not None and os.path.lexists(p):
            self.plan.call(self._name("unlink", p))
            if self.on_unlink is not None:
                self.on_unlink(p)

    def _rename(self, args: tuple[Any, ...]) -> None:
        src, dst = self._resolve(args[0], args[2]), self._resolve(args[1], args[3])
        if src is None and dst is None:
            return
        self.plan.call(self._name("rename", src or os.fsdecode(args[0]), dst or os.fsdecode(args[1])))
        if dst is not None and self.on_unlink is not None:
            self.on_unlink(dst)

    def _link(self, args: tuple[Any, ...]) -> None:
        src, dst = self._resolve(args[0], args[2]), self._resolve(args[1], args[3])
        if dst is not None and not os.path.lexists(dst):
            self.plan.call(self._name("link", src or os.fsdecode(args[0]), dst))

    def _truncate(self, args: tuple[Any, ...]) -> None:
        target = args[0]
        p = fd_path(target) if isinstance(target, int) else target
        if (p := self._resolve(p)) is not None:
            self.plan.call(self._name("truncate", p))

    # ------------------------------------------------------------------------------------------- fd calls
    def _wrap(self, name: str, arg: int, original: Callable[..., Any]) -> Callable[..., Any]:
        syncs = name in ("fsync", "fdatasync")

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if not self.plan.active:
                return original(*args, **kwargs)
            fd = args[arg] if len(args) > arg else None
            fd = fd if isinstance(fd, int) or fd is None else fd.fileno()
            p = self._resolve(fd_path(fd)) if fd is not None else None
            if p is not None:
                self.plan.call(self._name(name, p))
            result = original(*args, **kwargs)
            if syncs and p is not None and fd is not None and self.on_sync is not None:
                self.on_sync(fd, p)
            return result

        recorded.__name__ = name
        return recorded


def fd_path(fd: int | None) -> str | None:
    """The path an open descriptor names (``None`` for one that is not a file or a folder)."""
    if fd is None:
        return None
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    target = target.removesuffix(" (deleted)")
    return target if target.startswith("/") else None
