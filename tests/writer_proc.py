"""A writer process for crash tests: saves one checkpoint and stops at a chosen point until killed.

Usage: python -m tests.writer_proc URL OPTIONS_JSON {before-manifest|mid-manifest}
It prints "ready" once it has reached the point, then blocks on stdin; the test kills it with SIGKILL.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from psguard.storage import open_backend
from psguard.storage.base import Backend, Buffer
from psguard.storage.local import LocalBackend
from psguard.storage.retry import RetryingBackend
from psguard.store.log import Store


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


def main() -> None:
    url, options, point = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    backend: Backend
    if point == "before-manifest":
        backend = StopBeforeManifest(open_backend(url, options))
    else:
        backend = HalfWrittenManifest(url, options)
    store = Store(backend, chunk_bytes=4096)
    store.save(99, {"w": np.random.default_rng(0).standard_normal(20_000).astype(np.float32)})
    raise SystemExit("unreachable: the save should have parked")


if __name__ == "__main__":
    main()
