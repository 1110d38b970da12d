"""A writer process for crash tests: saves one checkpoint and stops at a chosen point until killed.

Usage: python -m tests.support.writer_proc URL OPTIONS_JSON {before-manifest|mid-manifest|slow-chunks} [LOCK_TTL]
It prints "ready" once it has reached the point, then blocks on stdin; the test kills it with SIGKILL.
``slow-chunks`` instead writes its first chunk, prints "ready" and waits for a line on stdin (its lease
refresher runs meanwhile, unless the test freezes the process), then finishes the save and prints
``ok <checkpoint id>`` or ``failed <error type>: <message>``: a save as long as the test wants.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np

from psguard.storage import open_backend
from psguard.storage.base import Backend, Buffer
from psguard.storage.local import LocalBackend
from psguard.storage.retry import RetryingBackend
from psguard.store import Store


def park() -> None:
    print("ready", flush=True)
    sys.stdin.read()  # never returns in the test: the process is killed here
    raise SystemExit("stdin closed before the kill")


class StopBeforeManifest(RetryingBackend):
    def put_new(self, key: str, data: Buffer) -> None:
        if key.startswith("manifests/"):
            park()
        super().put_new(key, data)


class HalfWrittenManifest(LocalBackend):
    def _write_tmp(self, path, data):  # type: ignore[no-untyped-def]
        if "manifests" in str(path):
            super()._write_tmp(path, bytes(data)[: len(data) // 2])
            park()
        return super()._write_tmp(path, data)


class HoldFirstChunk(RetryingBackend):
    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self._held = threading.Lock()
        self._first = True

    def put(self, key: str, data: Buffer) -> None:
        super().put(key, data)
        if key.startswith("chunks/"):
            with self._held:
                if self._first:
                    self._first = False
                    print("ready", flush=True)
                    sys.stdin.readline()  # the test says when the save may go on


def slow_save(url: str, options: dict[str, object], ttl: float) -> None:
    store = Store(HoldFirstChunk(open_backend(url, options)), chunk_bytes=4096, lock_ttl=ttl)
    try:
        info = store.save(7, {"w": np.arange(20_000, dtype=np.float32)})
    except Exception as e:
        print(f"failed {type(e).__name__}: {e}", flush=True)
    else:
        print(f"ok {info.id}", flush=True)
    finally:
        store.close()


def main() -> None:
    url, options, point = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    backend: Backend
    if point == "slow-chunks":
        slow_save(url, options, float(sys.argv[4]))
        return
    if point == "before-manifest":
        backend = StopBeforeManifest(open_backend(url, options))
    else:
        backend = HalfWrittenManifest(url, options)
    store = Store(backend, chunk_bytes=4096)
    store.save(99, {"w": np.random.default_rng(0).standard_normal(20_000).astype(np.float32)})
    raise SystemExit("unreachable: the save should have parked")


if __name__ == "__main__":
    main()
