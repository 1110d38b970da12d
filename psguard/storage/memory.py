"""In-process backend: fast tests and scratch stores. ``memory://NAME`` stores with one name share data.

Named stores live in a module-level table so two ``open_backend("memory://x")`` calls in one process see
the same objects (as two clients of one S3 bucket would); :func:`drop` clears one explicitly. fsspec's
memory filesystem is not used because its single hidden global store leaks between tests.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from psguard.errors import ObjectExistsError, ObjectNotFoundError
from psguard.storage.base import Backend, Buffer, validate_key

_STORES: dict[str, dict[str, bytes]] = {}
_MTIMES: dict[str, dict[str, float]] = {}  # per store: when each object was written (one process, one clock)
_LOCK = threading.Lock()


def drop(name: str) -> None:
    """Forget the named memory store."""
    with _LOCK:
        _STORES.pop(name, None)
        _MTIMES.pop(name, None)


class MemoryBackend(Backend):
    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        self.name = url[len("memory://") :].strip("/")
        self.url = f"memory://{self.name}"
        self.io_parallelism = 2
        self.mtime_resolution = 0.0
        with _LOCK:
            self._objects = _STORES.setdefault(self.name, {})
            self._mtimes = _MTIMES.setdefault(self.name, {})

    def get(self, key: str) -> bytes:
        with _LOCK:
            try:
                return self._objects[validate_key(key)]
            except KeyError:
                raise ObjectNotFoundError(f"{key} not found in {self.url}") from None

    def put(self, key: str, data: Buffer) -> None:
        blob = bytes(data)
        with _LOCK:
            self._objects[validate_key(key)] = blob
            self._mtimes[key] = time.time()

    def put_new(self, key: str, data: Buffer) -> None:
        blob = bytes(data)
        with _LOCK:
            if validate_key(key) in self._objects:
                raise ObjectExistsError(f"{key} already exists in {self.url}; psguard never overwrites it")
            self._objects[key] = blob
            self._mtimes[key] = time.time()

    def exists(self, key: str) -> bool:
        with _LOCK:
            return validate_key(key) in self._objects

    def keys(self, prefix: str) -> list[str]:
        with _LOCK:
            return sorted(k for k in self._objects if k.startswith(prefix))

    def delete(self, key: str) -> None:
        with _LOCK:
            self._objects.pop(validate_key(key), None)
            self._mtimes.pop(key, None)

    def mtime(self, key: str) -> float:
        with _LOCK:
            if validate_key(key) not in self._objects:
                raise ObjectNotFoundError(f"{key} not found in {self.url}")
            return self._mtimes.get(key, 0.0)
