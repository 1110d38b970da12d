"""A durable store opened on a thread, so that whoever needs it later goes on meanwhile.

A PS agent on a node replaced after a loss has two things on the recovery's path before it needs its store: start
its PS and fetch its shards from the peer's copy (the chief's agent asks for it as soon as the agent answers).
Opening an S3 store imports s3fs, aiohttp and botocore first (0.3 s of imports on the machines we measured, holding
the GIL), which no call needs until a save or a load of the log. Opened beside the fetch, those imports slowed it by
half or more (the fetch's threads hash and place each piece under the GIL). So a PS agent holds the open back
(``hold``) until the fetch is done, or anything needs the store, or ``hold`` seconds pass. What would fail the
open before any import (an unknown scheme, a client package not installed) still fails at once:
:func:`~psguard.storage.registry.check_url`; anything else goes to ``on_error`` when the open runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from psguard.storage.registry import check_url
from psguard.store.facade import Store

__all__ = ["StoreOpening"]


class StoreOpening:
    """:meth:`Store.open` on a thread, held back up to ``hold`` seconds (until :meth:`release`). Any attribute of
    the store waits for it (releasing the hold; raises what the open raised); :meth:`wait` does the same and
    returns the store."""

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
        self._go = threading.Event()
        self._done = threading.Event()
        self._store: Store | None = None
        self._error: BaseException | None = None
        self._on_error = on_error
        self._closed = False
        options = dict(storage_options or {})
        threading.Thread(target=self._open, args=(options, hold), name="psguard-store-open", daemon=True).start()

    def _open(self, options: dict[str, Any], hold: float) -> None:
        self._go.wait(hold)
        try:
            if not self._closed:  # else closed while held: nothing to open
                self._store = Store.open(self.url, options)
        except BaseException as e:  # handed to whoever waits
            self._error = e
        finally:
            self._done.set()
        if self._error is not None and self._on_error is not None:
            self._on_error(self._error)

    def release(self) -> None:
        """Open now: what the hold made way for is done."""
        self._go.set()

    @property
    def held(self) -> bool:
        """Whether the open still waits for its release (or the end of its hold)."""
        return not self._go.is_set() and not self._done.is_set()

    @property
    def failed(self) -> BaseException | None:
        """The open's error once it ran and failed; None while it runs or when it succeeded."""
        return self._error if self._done.is_set() else None

    def wait(self) -> Store:
        self._go.set()
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._store is not None
        return self._store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wait(), name)

    def close(self) -> None:
        self._closed = True
        self._go.set()
        self._done.wait()
        if self._store is not None:
            self._store.close()
