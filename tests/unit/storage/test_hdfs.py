"""The HDFS backend bounds every call to its NameNode: one that hangs is a transient failure after ``op_timeout``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from psguard.storage.hdfs import HdfsBackend
from psguard.storage.retry import TransientStorageError


class HangingFs:
    """An fsspec filesystem whose every call waits for ``release`` (a NameNode that accepts and never answers)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.release.wait()
            raise FileNotFoundError(name)

        return call


CALLS: dict[str, Callable[[HdfsBackend], object]] = {
    "get": lambda b: b.get("k"),
    "exists": lambda b: b.exists("k"),
    "size": lambda b: b.size("k"),
    "mtime": lambda b: b.mtime("k"),
    "keys": lambda b: b.keys(""),
    "mtimes": lambda b: b.mtimes(""),
    "leftovers": lambda b: b.leftovers(),
    "delete": lambda b: b.delete("k"),
    "put": lambda b: b.put("k", b"x"),
    "put_new": lambda b: b.put_new("k", b"x"),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_call_the_namenode_never_answers_times_out(call: str) -> None:
    backend = HdfsBackend.__new__(HdfsBackend)
    backend.url, backend.root, backend.op_timeout = "hdfs://namenode:8020/job", "/job", 0.2
    backend.fs = fs = HangingFs()
    backend._calls = ThreadPoolExecutor(max_workers=2)
    try:
        started = time.monotonic()
        with pytest.raises(TransientStorageError, match="did not answer within"):
            CALLS[call](backend)
        assert time.monotonic() - started < 5.0
    finally:
        fs.release.set()
        backend._calls.shutdown(wait=True)
