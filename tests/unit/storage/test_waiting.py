"""StoreWait: a store that does not answer is waited for with capped backoff, saying why, and only that is waited
for; a timeout or a stop ends the wait with an error."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from psguard.errors import StorageError, StorageUnavailableError
from psguard.storage.memory import MemoryBackend
from psguard.storage.retry import RetryConfig, RetryingBackend
from psguard.storage.waiting import StoreWait


class DownFor(MemoryBackend):
    """Listings are refused (a closed port) for the first ``n`` calls, then answered; every call counted."""

    def __init__(self, url: str, n: int) -> None:
        super().__init__(url)
        self.n = n
        self.calls = 0

    def keys(self, prefix: str) -> list[str]:
        self.calls += 1
        if self.calls <= self.n:
            raise ConnectionRefusedError(111, "Connection refused")
        return super().keys(prefix)


def unavailable(n: int) -> Any:
    """A call that finds the store unavailable ``n`` times, then returns ``"done"``."""
    calls = [0]

    def fn() -> str:
        calls[0] += 1
        if calls[0] <= n:
            try:
                raise ConnectionRefusedError(111, "Connection refused")
            except ConnectionRefusedError as e:
                raise StorageUnavailableError("storage unavailable: list 'manifests/' failed") from e
        return "done"

    return fn


def test_it_waits_with_capped_exponential_backoff_one_log_line_per_try_and_says_why(
    caplog: pytest.LogCaptureFixture, unique: str
) -> None:
    backend = RetryingBackend(MemoryBackend(f"memory://{unique}"))
    seen: list[tuple[float, dict[str, Any] | None, float]] = []
    now = [100.0]

    def sleep(seconds: float) -> bool:
        seen.append((seconds, wait.status(), wait.seconds()))
        now[0] += seconds
        return False

    wait = StoreWait(backend, initial=1.0, cap=4.0, clock=lambda: now[0], sleep=sleep)
    with caplog.at_level(logging.INFO, logger="psguard.storage.waiting"):
        assert wait.call(unavailable(5)) == "done"
    assert [s for s, _, _ in seen] == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert [w for _, _, w in seen] == [0.0, 1.0, 3.0, 7.0, 11.0]  # the metric: seconds waited so far
    last = seen[-1][1]
    assert last is not None and last["attempt"] == 5
    assert last["reason"].startswith(f"waiting for storage memory://{unique}: ConnectionRefusedError")
    assert "since 20" in last["reason"] and last["reason"].endswith("attempt 5")
    lines = [r for r in caplog.records if "event=waiting_for_storage" in r.getMessage()]
    assert len(lines) == 5
    assert any("event=storage_answered" in r.getMessage() and "attempts=6" in r.getMessage() for r in caplog.records)
    assert wait.status() is None and wait.seconds() == 0.0  # answered: no longer waiting


def test_the_probe_fails_at_once_so_the_wait_reports_from_the_first_try(unique: str) -> None:
    inner = DownFor(f"memory://{unique}", n=2)
    backend = RetryingBackend(inner, RetryConfig(deadline=60.0))  # its own retries would hold each try a minute
    delays: list[float] = []
    wait = StoreWait(backend, sleep=lambda s: bool(delays.append(s)))
    assert wait.call(lambda: backend.keys("manifests/"), probe=lambda: backend.keys("manifests/")) == []
    assert delays == [1.0, 2.0]
    assert inner.calls == 4  # one per failed probe, then the probe and the call


def test_a_timeout_gives_the_old_ending_an_error_that_says_how_long(unique: str) -> None:
    now = [0.0]

    def sleep(seconds: float) -> bool:
        now[0] += seconds
        return False

    wait = StoreWait(
        RetryingBackend(MemoryBackend(f"memory://{unique}")), timeout=10, clock=lambda: now[0], sleep=sleep
    )
    with pytest.raises(StorageUnavailableError, match=r"did not answer for 10s .*timeout is 10s.*ConnectionRefused"):
        wait.call(unavailable(100))
    assert now[0] == 10.0  # the last pause was cut to the timeout
    assert wait.status() is None


def test_a_stop_ends_the_wait(unique: str) -> None:
    stop = threading.Event()
    stop.set()
    wait = StoreWait(RetryingBackend(MemoryBackend(f"memory://{unique}")), stop=stop)
    with pytest.raises(StorageUnavailableError, match=r"stopped waiting for storage .* the process is stopping"):
        wait.call(unavailable(1))


def test_only_unavailability_is_waited_out(unique: str) -> None:
    wait = StoreWait(RetryingBackend(MemoryBackend(f"memory://{unique}")), sleep=lambda s: pytest.fail("waited"))

    def denied() -> None:
        raise StorageError("list 'manifests/' failed: PermissionError: denied")

    with pytest.raises(StorageError, match="denied"):
        wait.call(denied)
