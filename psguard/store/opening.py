"""A durable store opened on a thread, so that whoever needs it later goes on meanwhile.

A PS agent on a replaced node starts its PS and fetches its shards before it needs its store, and opening an S3
store (its client's imports hold the GIL) would slow that fetch. So a PS agent holds the open back: ``hold``
seconds after its start, for as long as a fetch runs (:meth:`StoreOpening.keep_held`), ``hold`` seconds more after
a fetch that worked and not at all after one that did not. Any use of the store opens it at once. What would fail
the open before any import (:func:`~psguard.storage.registry.check_url`) fails at once; anything else goes to
``on_error`` when the open runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from psguard.storage.registry import check_url, redact
from psguard.store.facade import Store

log = logging.getLogger(__name__)


class StoreOpening:
    """:meth:`Store.open` on a thread, held back ``hold`` seconds (see the module's text). Any attribute of the
    store waits for it (opening it now; raises what the open raised); :meth:`wait` does the same and returns the
    store."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        hold: float = 0.0,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        if hold > 0:
            check_url(url)
        self.url = url
        self._hold = hold
        self._cond = threading.Condition()
        self._now = hold <= 0  # open now: released, used or closed
        self._deadline: float | None = time.monotonic() + hold  # None: no end to the hold but a release
        self._done = threading.Event()
        self._store: Store | None = None
        self._error: BaseException | None = None
        self._on_error = on_error
        self._closed = False
        self._opening = False
        options = dict(storage_options or {})
        threading.Thread(target=self._open, args=(options,), name="psguard-store-open", daemon=True).start()

    def _open(self, options: dict[str, Any]) -> None:
        t0 = time.monotonic()
        with self._cond:
            while not self._now and (self._deadline is None or time.monotonic() < self._deadline):
                self._cond.wait(None if self._deadline is None else self._deadline - time.monotonic())
            self._opening = True
            why = "released" if self._now else "hold over"
        t1 = time.monotonic()
        try:
            if not self._closed:  # else closed while held: nothing to open
                self._store = Store.open(self.url, options)
                log.info(
                    "event=store_opened store=%s held_seconds=%.2f (%s) open_seconds=%.2f",
                    redact(self.url),
                    t1 - t0,
                    why,
                    time.monotonic() - t1,
                )
        except BaseException as e:  # handed to whoever waits
            self._error = e
        finally:
            self._done.set()
        if self._error is not None and self._on_error is not None:
            self._on_error(self._error)

    def release(self, *, later: bool = False) -> None:
        """Open now (what the hold made way for is done, and the store is needed next), or with ``later``
        ``hold`` seconds from now (a fetch that worked: its restore and the training it resumes come first)."""
        with self._cond:
            if later:
                self._deadline = time.monotonic() + self._hold
            else:
                self._now = True
            self._cond.notify_all()

    def keep_held(self) -> None:
        """What the hold makes way for has begun (a fetch of 10 GB outlasts any hold): only :meth:`release`
        (which its end calls) or a use of the store ends the hold now."""
        with self._cond:
            self._deadline = None
            self._cond.notify_all()

    @property
    def state(self) -> str:
        """``held``, ``opening``, ``open``, ``failed`` or ``closed`` (closed while held, never opened)."""
        if self._done.is_set():
            return "failed" if self._error is not None else "open" if self._store is not None else "closed"
        return "opening" if self._opening or self._now else "held"

    @property
    def failed(self) -> BaseException | None:
        """The open's error once it ran and failed; None while it runs or when it succeeded."""
        return self._error if self._done.is_set() else None

    def wait(self) -> Store:
        self.release()
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._store is not None
        return self._store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wait(), name)

    def close(self) -> None:
        self._closed = True
        self.release()
        self._done.wait()
        if self._store is not None:
            self._store.close()
