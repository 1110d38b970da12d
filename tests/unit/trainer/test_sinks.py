"""The save handles ``CheckpointManager.save`` returns, as the trainer's writer resolves them; and which sink a
manager chooses (``sink=``, ``options.spool``, ``$PSGUARD_SPOOL`` / ``$PSGUARD_STORE``) and the reason it shows."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from psguard.errors import ConfigError
from psguard.handoff.contract import Tier
from psguard.trainer.sinks import BOTH, MemoryCheckpoint, SinkChoice, _StoreSaveHandle, choose_sink
from tests.support.agents import under_agent


def test_a_handle_waits_then_reraises_why_its_save_failed() -> None:
    handle = _StoreSaveHandle(3, 0.0, BOTH)
    assert handle.durable and not handle.done() and "pending" in repr(handle)
    with pytest.raises(TimeoutError, match="step 3 not durable"):
        handle.result(0.01)
    with pytest.raises(TimeoutError):
        handle.exception(0.01)  # a timeout is not the save's failure
    handle.future.set_exception(PermissionError("disk on fire"))
    assert handle.done() and "done" in repr(handle)
    assert isinstance(handle.exception(0), PermissionError)
    with pytest.raises(PermissionError):
        handle.restorable(0)  # without an agent, restorable means committed


def test_a_memory_only_save_is_not_durable_and_its_checkpoint_is_a_value() -> None:
    assert not _StoreSaveHandle(1, 0.0, frozenset({Tier.MEMORY})).durable
    checkpoint = MemoryCheckpoint(step=5, token="t")
    assert checkpoint == MemoryCheckpoint(5, "t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        checkpoint.step = 6  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- which sink
@pytest.fixture
def url(tmp_path: Path) -> str:
    return str(tmp_path / "store")


def test_without_an_agent_the_manager_writes_the_store_and_says_why(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    under_agent(monkeypatch, None, None)
    choice = choose_sink(None, None, url)
    assert choice == SinkChoice("store", "$PSGUARD_SPOOL unset") and str(choice) == "store($PSGUARD_SPOOL unset)"


def test_under_an_agent_of_the_same_store_saves_go_to_its_spool(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    under_agent(monkeypatch, "/dev/shm/psguard-j", url)
    for asked in (None, "agent"):
        choice = choose_sink(asked, None, url)  # type: ignore[arg-type]
        assert str(choice) == "agent(spool=/dev/shm/psguard-j, from $PSGUARD_SPOOL)"


def test_an_agent_too_old_to_name_its_store_is_trusted(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    under_agent(monkeypatch, "/s", None)
    assert choose_sink(None, None, url) == SinkChoice("agent", "from $PSGUARD_SPOOL", "/s")


def test_sink_store_writes_the_store_under_an_agent_of_another_store(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    under_agent(monkeypatch, "/s", url + "-other")
    assert str(choose_sink("store", None, url)) == "store(sink='store')"


def test_sink_store_is_refused_where_the_agent_writes_the_same_store(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    under_agent(monkeypatch, "/s", url)
    with pytest.raises(ConfigError, match="two writers of one durable log"):
        choose_sink("store", None, url)


def test_sink_agent_without_an_agent_is_refused(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    under_agent(monkeypatch, None, None)
    with pytest.raises(ConfigError, match=r"sink='agent', but \$PSGUARD_SPOOL is not set"):
        choose_sink("agent", None, url)


def test_an_agent_without_store_is_refused_when_asked_for_and_else_passed_over_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    under_agent(monkeypatch, "/s", "")
    with pytest.raises(ConfigError, match="without --store and keeps checkpoints in memory only"):
        choose_sink("agent", None, url)
    with caplog.at_level(logging.WARNING, logger="psguard.trainer.sinks"):
        choice = choose_sink(None, None, url)
    assert choice == SinkChoice("store", "the agent of $PSGUARD_SPOOL has no --store")
    assert "event=agent_without_store" in caplog.text


def test_a_manager_pointed_elsewhere_than_its_agents_store_is_refused(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    under_agent(monkeypatch, "/s", url + "-other")
    with pytest.raises(ConfigError, match="writes checkpoints to --store"):
        choose_sink(None, None, url)


def test_an_explicit_spool_is_the_agents_sink_whatever_the_environment(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    under_agent(monkeypatch, None, None)
    assert str(choose_sink(None, Path("/x/spool"), url)) == "agent(spool=/x/spool, from options.spool)"
    assert choose_sink("agent", "/x/spool", url).spool == "/x/spool"
    with pytest.raises(ConfigError, match="sink='store' and a spool"):
        choose_sink("store", "/x/spool", url)


def test_an_unknown_sink_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="sink must be 'store', 'agent' or None"):
        choose_sink("spool", None, url)  # type: ignore[arg-type]
