"""psguard.store.opening: a store opened on a thread gives the store, or the open's error, to whoever waits."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.errors import ConfigError, PsguardError
from psguard.storage import registry
from psguard.store import Store
from psguard.store.opening import StoreOpening


def test_the_store_opened_on_a_thread_is_the_store(tmp_path: Path) -> None:
    opening = StoreOpening(str(tmp_path / "log"))
    store = opening.wait()
    info = store.save(1, {"w": np.arange(6, dtype=np.float32)})
    assert opening.checkpoint_ids() == store.checkpoint_ids() == [info.id]  # any attribute is the store's
    opening.close()


def test_the_opens_error_reaches_every_caller() -> None:
    opening = StoreOpening("nosuchscheme://bucket/job")
    with pytest.raises(PsguardError) as first:
        opening.wait()
    with pytest.raises(PsguardError) as second:
        opening.checkpoint_ids()  # any attribute waits for the open
    assert first.value is second.value
    opening.close()  # nothing to close: no error


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when :meth:`Store.open` runs (it then opens as usual)."""
    opened = threading.Event()
    real_open = Store.open.__func__  # type: ignore[attr-defined]

    def open_and_say(cls: type[Store], *args: Any, **kwargs: Any) -> Store:
        opened.set()
        return real_open(cls, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(Store, "open", classmethod(open_and_say))
    return opened


def test_a_held_open_waits_for_its_release(tmp_path: Path, opens: threading.Event) -> None:
    """A PS agent holds its open back while it fetches its shards: the open's imports slowed the fetch."""
    opening = StoreOpening(str(tmp_path / "log"), hold=600)
    assert not opens.wait(0.5), "the store opened while held"
    assert opening.failed is None and opening.state == "held"
    opening.release()  # the fetch is done
    assert opens.wait(30)
    assert opening.wait().checkpoint_ids() == []
    assert opening.state == "open"
    opening.close()


def test_a_fetch_begun_within_the_hold_keeps_it_past_its_end(tmp_path: Path, opens: threading.Event) -> None:
    """A fetch of 10 GB outlasts any hold: once begun, only its end (or a use of the store) opens it."""
    opening = StoreOpening(str(tmp_path / "log"), hold=0.3)
    opening.keep_held()
    assert not opens.wait(1.5), "the hold ended in the middle of the fetch"
    assert opening.state == "held"
    opening.release()
    assert opens.wait(30)
    opening.close()


def test_a_held_open_runs_when_its_hold_ends_or_someone_needs_the_store(tmp_path: Path, opens: threading.Event) -> None:
    expired = StoreOpening(str(tmp_path / "a"), hold=0.2)  # nothing released it: it opens on its own
    assert opens.wait(30)
    expired.close()
    opens.clear()
    needed = StoreOpening(str(tmp_path / "b"), hold=600)
    assert needed.checkpoint_ids() == []  # any attribute releases the hold and waits for the open
    assert opens.is_set()
    needed.close()


def test_after_a_fetch_that_worked_the_hold_starts_again(tmp_path: Path, opens: threading.Event) -> None:
    """The restore after the fetch, then the training it resumes, come before the open's imports."""
    opening = StoreOpening(str(tmp_path / "log"), hold=600)
    opening.keep_held()
    opening.release(later=True)
    assert not opens.wait(0.5) and opening.state == "held"
    opening.close()
    short = StoreOpening(str(tmp_path / "log"), hold=0.3)
    short.keep_held()
    short.release(later=True)
    assert opens.wait(30), "the hold after the fetch never ended"
    assert short.wait().checkpoint_ids() == []
    short.close()


def test_a_store_closed_while_held_is_never_opened(tmp_path: Path, opens: threading.Event) -> None:
    opening = StoreOpening(str(tmp_path / "log"), hold=600)
    opening.close()
    assert not opens.is_set() and opening.state == "closed"
    assert not (tmp_path / "log").exists()


def test_a_held_open_refuses_at_once_what_would_fail_before_any_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad URL or a missing client package still fails the agent's start, not seconds later."""
    with pytest.raises(ConfigError, match="unknown storage scheme"):
        StoreOpening("nosuchscheme://bucket/job", hold=600)
    with pytest.raises(ConfigError, match="missing a slash"):
        StoreOpening("s3:/bucket/job", hold=600)
    monkeypatch.setitem(registry._REGISTRY, "psgx", ("psguard.storage.memory", "MemoryBackend", "no-such-client-psg"))
    with pytest.raises(ConfigError, match="pip install no-such-client-psg"):
        StoreOpening("psgx://bucket/job", hold=600)


def test_an_open_that_fails_later_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """What only the open finds (here a backend that raises) goes to ``on_error`` and to every caller."""

    def refuse(cls: type[Store], *args: Any, **kwargs: Any) -> Store:
        raise PsguardError("the bucket's credentials were refused")

    monkeypatch.setattr(Store, "open", classmethod(refuse))
    reported: list[BaseException] = []
    done = threading.Event()
    opening = StoreOpening("memory://job", hold=600, on_error=lambda e: (reported.append(e), done.set()))
    opening.release()
    assert done.wait(30)
    assert isinstance(opening.failed, PsguardError) and reported == [opening.failed]
    assert opening.state == "failed"
    with pytest.raises(PsguardError, match="credentials were refused"):
        opening.wait()
    opening.close()
