"""Retries with exponential backoff and a deadline, around any backend.

Backends raise :class:`TransientStorageError` (or a connection-type error of their client library) for failures
worth retrying; other errors are final. When the deadline passes the caller gets one
:class:`~psguard.errors.StorageUnavailableError` naming the operation, the key and the last cause: a save fails
clearly instead of hanging.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from psguard.errors import ObjectExistsError, ObjectNotFoundError, PsguardError, StorageError, StorageUnavailableError
from psguard.storage.base import Backend, Buffer, Wrapper, causes

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.EAGAIN,
    errno.EIO,
    # s3fs turns InternalError / 500 into EREMOTEIO and SlowDown / ServiceUnavailable / 503 (and 409
    # OperationAborted) into EBUSY: all "try again", and they come right after an object store restarts.
    getattr(errno, "EREMOTEIO", errno.EIO),
    errno.EBUSY,
}
# Client-library exception class names that mean "the server did not answer properly this time". Matched by
# name so this module imports no client library.
_TRANSIENT_NAMES = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectorError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "ClientPayloadError",
    "IncompleteReadError",
    "ResponseStreamingError",
    "ProxyConnectionError",
    "ConnectionError",
    "ChunkedEncodingError",
    "HdfsError",
}
_TRANSIENT_WORDS = ("503", "500", "502", "504", "SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout")
# Hadoop's answers that mean "not now": a NameNode in safe mode (for seconds after every start, until the DataNodes
# report their blocks), a standby NameNode, an explicit retriable error. hdfs-native raises them as a RuntimeError
# whose text is the RPC error with the Java class's name, which Hadoop's own client retries.
_HADOOP_RETRIABLE = ("SafeModeException", "RetriableException", "StandbyException")


# Modules whose exceptions are storage client failures (a bad answer, no credentials), not bugs in the caller.
_CLIENT_MODULES = (
    "botocore",
    "aiobotocore",
    "aiohttp",
    "s3fs",
    "gcsfs",
    "google",
    "fsspec",
    "hdfs_native",
    "requests",
    "urllib3",
)
# HTTP statuses that mean "try again": a timeout, a rate limit (GCS answers 429), a server error.
_TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def one_line(error: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _from_client(exc: BaseException) -> bool:
    return type(exc).__module__.split(".", 1)[0] in _CLIENT_MODULES


def is_client_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) came from the OS or a storage client library."""
    return any(isinstance(e, OSError) or _from_client(e) for e in causes(exc))


def http_status(exc: BaseException) -> int | None:
    """The HTTP status a storage client's exception carries (gcsfs's ``code``, aiohttp's ``status``), or None."""
    if not _from_client(exc):
        return None
    for name in ("status", "code"):
        value = getattr(exc, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


_RETRY_EVENT = "event=storage_retry op=%s key=%s url=%s attempt=%d retry_in=%.2fs deadline_left=%.1fs error=%r"


class TransientStorageError(StorageError):
    """A failure worth retrying (connection refused, timeout, 5xx)."""


def is_transient(exc: BaseException) -> bool:
    """Decide whether retrying ``exc`` can help."""
    if isinstance(exc, TransientStorageError):
        return True
    if isinstance(exc, PsguardError):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
        return True
    status = http_status(exc)
    if status is not None:
        return status in _TRANSIENT_STATUSES
    text = str(exc)
    if "org.apache.hadoop." in text and any(f".{name}" in text for name in _HADOOP_RETRIABLE):
        return True
    if isinstance(exc, OSError):
        if exc.errno in _TRANSIENT_ERRNOS:
            return True
        final = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError)
        if isinstance(exc, final) or exc.errno == errno.ENOSPC:
            return False
        return any(w in text for w in _TRANSIENT_WORDS) or exc.errno is None
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


@dataclass(frozen=True)
class Retrying:
    """A store call that is failing and being retried now: since when (``time.monotonic``) and the last error."""

    since: float
    error: str

    @property
    def seconds(self) -> float:
        return max(0.0, time.monotonic() - self.since)


@dataclass(frozen=True)
class RetryConfig:
    """How long to keep trying one storage operation.

    ``deadline`` bounds the total time of one operation including its retries (0 disables retries).
    """

    deadline: float = 60.0
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0


class RetryingBackend(Wrapper):
    """Wraps a backend; every call retries transient failures until ``config.deadline``."""

    def __init__(self, inner: Backend, config: RetryConfig | None = None) -> None:
        super().__init__(inner)
        self.config = config or RetryConfig()
        self._stop = threading.Event()
        self._local = threading.local()  # a cap on the deadline for calls made by one thread (``capped``)
        self._failing: dict[int, Retrying] = {}  # the calls being retried now, by a number of their own
        self._failing_lock = threading.Lock()
        self._calls = itertools.count()

    def retrying(self) -> Retrying | None:
        """The oldest call being retried now (``None``: no call in progress has failed yet).

        Why: a caller that can do without the store for a while (the trainer's durable-lag hold, whose captures
        the memory tier keeps restorable) learns that the store is down at its first failure, not its deadline."""
        with self._failing_lock:
            return min(self._failing.values(), key=lambda r: r.since, default=None)

    def abort(self) -> None:
        """Make pending and future retries give up at once (used when shutting down)."""
        self._stop.set()

    @contextlib.contextmanager
    def capped(self, seconds: float) -> Iterator[None]:
        """Calls made by this thread inside the block give up after ``seconds`` (or the configured deadline,
        whichever is shorter): for a caller that has a better answer than waiting, such as a restore that
        already holds the memory tier and only asks the store whether it has something newer."""
        before = getattr(self._local, "cap", None)
        self._local.cap = seconds if before is None else min(before, seconds)
        try:
            yield
        finally:
            self._local.cap = before

    def _around(self, op: str, key: str, fn: Callable[[], T]) -> T:
        cfg = self.config
        cap = getattr(self._local, "cap", None)
        budget = cfg.deadline if cap is None else min(cfg.deadline, cap)
        deadline = time.monotonic() + budget
        call = next(self._calls)
        try:
            return self._attempts(op, key, fn, call, budget, deadline)
        finally:
            with self._failing_lock:
                self._failing.pop(call, None)

    def _attempts(self, op: str, key: str, fn: Callable[[], T], call: int, budget: float, deadline: float) -> T:
        cfg = self.config
        backoff = cfg.initial_backoff
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as e:
                if not is_transient(e):
                    final = self._final(op, key, e)
                    if final is e:
                        raise
                    raise final from e
                why, remaining = self._why(e), deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    raise StorageUnavailableError(
                        f"storage unavailable: {op} {key!r} on {self.url} failed {attempt} time(s) "
                        f"over {budget:.0f}s; last error: {why}. "
                        "Check that the storage service is up and reachable, then retry."
                    ) from e
                sleep = min(backoff * (0.5 + random.random()), remaining, cfg.max_backoff)
                log.warning(_RETRY_EVENT, op, key, self.url, attempt, sleep, remaining, why)
                with self._failing_lock:
                    since = self._failing[call].since if call in self._failing else time.monotonic()
                    self._failing[call] = Retrying(since, why)
                self._stop.wait(sleep)
                backoff = min(backoff * cfg.multiplier, cfg.max_backoff)

    def _why(self, e: BaseException) -> str:
        return self.inner.explain(e) or one_line(e)

    def _final(self, op: str, key: str, e: Exception) -> Exception:
        """A failure retrying cannot fix, as the error to raise: psguard's own as they are; a storage client's
        as one-line :class:`StorageError` (:class:`ObjectNotFoundError` for a missing object or bucket) saying
        what to do; anything else (a bug) as it is."""
        if isinstance(e, PsguardError) or not (is_client_failure(e) or self.inner.explain(e)):
            return e
        message = f"{op} {key!r} on {self.url} failed: {self._why(e)}"
        return ObjectNotFoundError(message) if isinstance(e, FileNotFoundError) else StorageError(message)

    def put_new(self, key: str, data: Buffer) -> None:
        failed_before = False

        def attempt() -> None:
            nonlocal failed_before
            try:
                self.inner.put_new(key, data)
            except ObjectExistsError:
                # An earlier attempt may have succeeded with its answer lost: then the object is ours.
                if failed_before and self.inner.get(key) == bytes(data):
                    return
                raise
            except Exception:
                failed_before = True
                raise

        self._around("put_new", key, attempt)
