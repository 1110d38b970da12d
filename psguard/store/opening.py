"""A durable store opened on a thread, so that whoever needs it later goes on meanwhile.

A PS agent on a node replaced after a loss has two things on the recovery's path before it opens its store: start
its PS and serve its peers (the chief's agent fetches the peer copy through it). Opening an S3 store loads s3fs and
botocore first (0.3 s of imports on the machines we measured), which no call made until a save or a load of the log
needs. The agent still waits for the open before it says it started, so a bad store URL fails its start as before.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from psguard.store.facade import Store

__all__ = ["StoreOpening"]


class StoreOpening:
    """:meth:`Store.open` on a thread. Any attribute of the store waits for it (and raises what the open raised);
    :meth:`wait` does the same and returns the store."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self._done = threading.Event()
        self._store: Store | None = None
        self._error: BaseException | None = None
        options = dict(storage_options or {})
        threading.Thread(target=self._open, args=(options,), name="psguard-store-open", daemon=True).start()

    def _open(self, options: dict[str, Any]) -> None:
        try:
            self._store = Store.open(self.url, options)
        except BaseException as e:  # handed to whoever waits
            self._error = e
        finally:
            self._done.set()

    def wait(self) -> Store:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._store is not None
        return self._store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wait(), name)

    def close(self) -> None:
        self._done.wait()
        if self._store is not None:
            self._store.close()
