"""The backend interface every storage tier implements.

Deliberately tiny: whole-object reads and writes, a create-only write for commits, listing and deletion.
Two guarantees every backend gives, because the checkpoint log's correctness rests on them:

* ``put`` and ``put_new`` are atomic: a reader sees the whole object or no object, never a prefix
  (local disk and HDFS write a temporary name and rename; S3 PUTs are atomic).
* ``put_new`` never overwrites: when the key exists it raises :class:`ObjectExistsError` and the existing
  object is untouched (S3 ``If-None-Match: *``, ``link(2)`` locally, rename-without-overwrite on HDFS).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TypeVar

from psguard.errors import ConfigError, StorageError

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")

_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what it was raised from or during, the first ten (a cycle stops the walk)."""
    seen: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and len(seen) < 10 and e not in seen:
        seen.append(e)
        yield e
        e = e.__cause__ or e.__context__


def validate_key(key: str) -> str:
    """Refuse keys that could escape the store's root (``..``, absolute paths, odd characters)."""
    if not _KEY_RE.match(key) or any(part in (".", "..") for part in key.split("/")):
        raise ConfigError(f"refusing storage key {key!r}: keys are relative paths of [A-Za-z0-9_.-] parts")
    return key


class Backend(ABC):
    """A flat namespace of immutable-ish objects under one root URL."""

    #: The URL this backend was opened from (without credentials), for messages and listings.
    url: str
    #: How many requests in parallel suit it: remote stores hide latency with many, a local disk read from
    #: the page cache is memory-bound and only loses to thread switching beyond the number of cores.
    io_parallelism: int = 8
    #: How coarse :meth:`mtime` may be, in seconds (S3's HEAD answers in whole seconds); age judgements
    #: allow this much on top of a lease's TTL.
    mtime_resolution: float = 1.0

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; :class:`ObjectNotFoundError` when absent."""

    def get_into(self, key: str, out: memoryview) -> int:
        """Read the object into ``out`` (bytes past ``len(out)`` are not read); return the object's size.
        Backends that can read straight into the caller's buffer override this to save a copy."""
        data = self.get(key)
        n = min(len(data), len(out))
        out[:n] = data[:n]
        return len(data)

    @abstractmethod
    def put(self, key: str, data: Buffer) -> None:
        """Write atomically, replacing any existing object."""

    @abstractmethod
    def put_new(self, key: str, data: Buffer) -> None:
        """Write atomically only if ``key`` does not exist; :class:`ObjectExistsError` otherwise."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a folder-like prefix ending in ``/`` or empty), recursively, sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; absent objects are not an error (deletion is idempotent)."""

    def size(self, key: str) -> int:
        """The object's size in bytes, asked of the storage without reading it (a stat, a HEAD): readers ask before
        allocating for a size a manifest only claims. :class:`ObjectNotFoundError` when absent; this default reads."""
        return len(self.get(key))

    def mtime(self, key: str) -> float:
        """When the object was last written, by the *storage's* clock: gc judges the age of locks and chunks by these
        times, never by comparing two nodes' clocks. :class:`ObjectNotFoundError` when absent."""
        raise StorageError(f"{type(self).__name__} cannot tell when {key} was written")

    def mtimes(self, prefix: str) -> dict[str, float]:
        """:meth:`keys` under ``prefix`` with their :meth:`mtime` (backends override this with one listing)."""
        out: dict[str, float] = {}
        for key in self.keys(prefix):
            try:
                out[key] = self.mtime(key)
            except FileNotFoundError:
                continue  # deleted since the listing
        return out

    def leftovers(self) -> list[str]:
        """Keys of temporary objects a killed writer left behind (never visible through :meth:`keys`)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default has nothing to release."""

    def explain(self, error: BaseException) -> str | None:
        """What a failure of this backend's client means and what to do, in one line (never a credential);
        ``None`` when the backend has nothing to add to the error's own text."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class Wrapper(Backend):
    """``inner`` with every call made through :meth:`_around`: a wrapper overrides that hook and what it changes."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.url = inner.url
        self.io_parallelism = inner.io_parallelism
        self.mtime_resolution = inner.mtime_resolution

    def _around(self, op: str, key: str, fn: Callable[[], T]) -> T:
        return fn()

    def get(self, key: str) -> bytes:
        return self._around("get", key, lambda: self.inner.get(key))

    def get_into(self, key: str, out: memoryview) -> int:
        return self._around("get", key, lambda: self.inner.get_into(key, out))

    def put(self, key: str, data: Buffer) -> None:
        self._around("put", key, lambda: self.inner.put(key, data))

    def put_new(self, key: str, data: Buffer) -> None:
        self._around("put_new", key, lambda: self.inner.put_new(key, data))

    def exists(self, key: str) -> bool:
        return self._around("exists", key, lambda: self.inner.exists(key))

    def keys(self, prefix: str) -> list[str]:
        return self._around("list", prefix, lambda: self.inner.keys(prefix))

    def delete(self, key: str) -> None:
        self._around("delete", key, lambda: self.inner.delete(key))

    def mtime(self, key: str) -> float:
        return self._around("stat", key, lambda: self.inner.mtime(key))

    def size(self, key: str) -> int:
        return self._around("stat", key, lambda: self.inner.size(key))

    def mtimes(self, prefix: str) -> dict[str, float]:
        return self._around("list", prefix, lambda: self.inner.mtimes(prefix))

    def leftovers(self) -> list[str]:
        return self._around("list", "(temporaries)", self.inner.leftovers)

    def close(self) -> None:
        self.inner.close()

    def explain(self, error: BaseException) -> str | None:
        return self.inner.explain(error)
