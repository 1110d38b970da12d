"""FIFOs put in place of files psguard reads, and a way out should a read block on one.

A reader blocked on a FIFO waits for a writer for good: a test of the bug would hang the run instead of failing.
:meth:`Fifos.within` fails the test instead, and :meth:`Fifos.release` then keeps giving every FIFO a writer that
hangs up at once (and a reader, for a blocked writer), so the blocked calls end and their threads can be joined.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

__all__ = ["Fifos"]

T = TypeVar("T")


class Fifos:
    """FIFOs a test puts in place of files. Should a reader block on one (the bug these tests catch), the test
    fails and :meth:`release` keeps giving every FIFO a writer that hangs up at once, so the blocked reads end
    (with nothing read) and the store's threads and the test can finish instead of hanging the run."""

    def __init__(self) -> None:
        self.made: list[Path] = []
        self._stop = threading.Event()
        self._releaser: threading.Thread | None = None

    def put(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        os.mkfifo(path)
        self.made.append(path)

    def within(self, call: Callable[[], T], seconds: float = 10.0) -> T:
        """``call()``'s answer, which must come within ``seconds`` (the bug blocked it for good)."""
        out: list[T] = []
        error: list[BaseException] = []

        def run() -> None:
            try:
                out.append(call())
            except BaseException as e:
                error.append(e)

        thread = threading.Thread(target=run, name="test-within", daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            self.release()
            thread.join()
            pytest.fail(f"blocked for over {seconds}s (on a FIFO)")
        if error:
            raise error[0]
        return out[0]

    def release(self) -> None:
        def run() -> None:
            while not self._stop.wait(0.02):
                for fifo in self.made:
                    with contextlib.suppress(OSError):  # a FIFO gone by now
                        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets a blocked writer's open through
                        with contextlib.suppress(OSError):
                            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # and a blocked reader's
                        os.close(reader)

        if self._releaser is None:
            self._releaser = threading.Thread(target=run, name="test-fifo-releaser", daemon=True)
            self._releaser.start()

    def close(self) -> None:
        self._stop.set()
        if self._releaser is not None:
            self._releaser.join()
