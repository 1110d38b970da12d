"""``psguard.CheckpointManager``'s surface, on local variables (no cluster): TF's arguments, then ``policy``,
``options`` and ``sink``; each group of :class:`ManagerOptions` takes effect; each old keyword argument warns
with its new spelling at the caller's line and still takes effect; an old argument beside its field in
``options`` is refused; ``repr`` says which sink the manager uses and why.

Saving and restoring themselves are tests/cluster/test_manager.py's (its first half is local too).
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

import psguard
from psguard.errors import ConfigError
from psguard.policy.engine import Retention
from psguard.policy.files import HangSpec
from psguard.store import Store
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.options import MANAGER_MOVES, CaptureOptions, ManagerOptions
from tests.support.agents import under_agent

TF_ARGUMENTS = list(inspect.signature(tf.train.CheckpointManager.__init__).parameters)[1:]


@pytest.fixture(autouse=True)
def no_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    under_agent(monkeypatch, None, None)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def checkpoint() -> tf.train.Checkpoint:
    return tf.train.Checkpoint(v=tf.Variable(np.arange(4, dtype=np.float32)), step=tf.Variable(0, dtype=tf.int64))


@pytest.fixture
def opened() -> Iterator[list[CheckpointManager]]:
    """Managers a test opened, closed after it (a failed assertion must not leave a writer thread behind)."""
    managers: list[CheckpointManager] = []
    yield managers
    for manager in managers:
        manager.close()


def test_the_signature_is_tfs_arguments_then_psguards_three() -> None:
    params = inspect.signature(CheckpointManager.__init__).parameters.values()
    named = [p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD][1:]
    assert named == [*TF_ARGUMENTS, "policy", "options", "sink"]
    assert [p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD] == ["deprecated"]
    assert psguard.ManagerOptions is ManagerOptions


# --------------------------------------------------------------------------------- the new spelling, by group
def test_capture_options_reach_the_capturer_and_the_checkpoints(
    checkpoint: tf.train.Checkpoint, url: str, opened: list[CheckpointManager]
) -> None:
    coordinator = object()
    options = ManagerOptions(
        coordinator=coordinator,
        data_position=lambda: {"batches": 12},
        capture=CaptureOptions(verify_every=3, row_tracking_min_rows=2),
    )
    opened.append(m := CheckpointManager(checkpoint, url, options=options))
    assert m.coordinator is coordinator and m.capturer.coordinator is coordinator
    assert (m.capturer.verify_every, m.capturer.row_tracking_min_rows) == (3, 2)
    assert m.options is options


def test_durable_options_open_the_store_and_keep_what_retention_says(
    checkpoint: tf.train.Checkpoint, url: str, opened: list[CheckpointManager]
) -> None:
    store = Store.open(url)
    options = ManagerOptions(store=store, retention=Retention(keep_last=1), new_base_after=2)
    opened.append(m := CheckpointManager(checkpoint, url, options=options))
    assert m.store is store and m.new_base_after == 2 and m.retention == Retention(keep_last=1)
    for step in (1, 2, 3):
        m.save(step).result(timeout=60)
    m.wait(60)  # the retention after the last commit too
    assert [c.step for c in store.checkpoints()][-1] == 3 and len(store.checkpoints()) < 3
    m.close()
    assert store.latest() is not None  # a given store is left open
    store.close()


def test_storage_options_go_to_the_stores_client(
    checkpoint: tf.train.Checkpoint, url: str, monkeypatch: pytest.MonkeyPatch, opened: list[CheckpointManager]
) -> None:
    seen: list[Any] = []
    real = Store.open

    def spy(where: str, storage_options: Any = None) -> Store:
        seen.append(storage_options)
        return real(where)

    monkeypatch.setattr(Store, "open", spy)
    opened.append(CheckpointManager(checkpoint, url, options=ManagerOptions(storage_options={"anon": True})))
    assert seen == [{"anon": True}]


def test_agent_options_choose_the_agents_sink_and_its_waits(
    checkpoint: tf.train.Checkpoint, url: str, tmp_path: Path, opened: list[CheckpointManager]
) -> None:
    spool = tmp_path / "spool"
    options = ManagerOptions(spool=spool, restore_timeout=7.0, hang=HangSpec(after=30.0))
    opened.append(m := CheckpointManager(checkpoint, url, options=options))
    assert m.sink.kind == "agent" and m.sink.spool == str(spool)
    assert type(m._sink).__name__ == "AgentSink" and m.restore_timeout == 7.0 and m.hang == HangSpec(after=30.0)


def test_policy_options_set_how_the_policy_applies(
    checkpoint: tf.train.Checkpoint, url: str, tmp_path: Path, opened: list[CheckpointManager]
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("durable: {every_steps: 5}\n")
    opened.append(watched := CheckpointManager(checkpoint, url, policy=policy))
    assert watched._policy.watcher is not None
    watched.close()
    opened.append(m := CheckpointManager(checkpoint, url, policy=policy, options=ManagerOptions(watch_policy=False)))
    assert m._policy.watcher is None and m.schedule is not None
    m.close()
    opened.append(m := CheckpointManager(checkpoint, url, options=ManagerOptions(preemption=True)))
    assert m._preemption is not None


def test_the_summaries_option_names_the_folder(
    checkpoint: tf.train.Checkpoint, url: str, tmp_path: Path, opened: list[CheckpointManager]
) -> None:
    opened.append(m := CheckpointManager(checkpoint, url, options=ManagerOptions(summaries=tmp_path / "logs")))
    assert m.summaries == str(tmp_path / "logs")


# ----------------------------------------------------------------------------------- the old keyword arguments
def old_arguments(tmp_path: Path) -> dict[str, tuple[Any, Callable[[CheckpointManager], bool]]]:
    """Each old keyword argument: a value, and a check that it took effect on the manager."""
    coordinator = object()

    def position() -> int:
        return 3

    store = Store.open(str(tmp_path / "store"))
    return {
        "coordinator": (coordinator, lambda m: m.coordinator is coordinator),
        "retention": (Retention(keep_last=4), lambda m: m.retention == Retention(keep_last=4)),
        "watch_policy": (False, lambda m: m.options.watch_policy is False),
        "storage_options": ({}, lambda m: m.options.storage_options == {}),
        "data_position": (position, lambda m: m.data_position is position),
        "new_base_after": (5, lambda m: m.new_base_after == 5),
        "preemption": (True, lambda m: m._preemption is not None),
        "store": (store, lambda m: m.store is store),
        "capturer_options": ({"verify_every": 2}, lambda m: m.capturer.verify_every == 2),
        "spool": (tmp_path / "spool", lambda m: m.sink.kind == "agent"),
        "restore_timeout": (9.0, lambda m: m.restore_timeout == 9.0),
        "hang": (HangSpec(after=8.0), lambda m: m.hang == HangSpec(after=8.0)),
        "summaries": (tmp_path / "logs", lambda m: m.summaries == str(tmp_path / "logs")),
    }


@pytest.mark.parametrize("name", sorted(MANAGER_MOVES))
def test_an_old_keyword_argument_warns_with_its_new_spelling_and_still_takes_effect(
    name: str, checkpoint: tf.train.Checkpoint, url: str, tmp_path: Path, opened: list[CheckpointManager]
) -> None:
    value, took_effect = old_arguments(tmp_path)[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opened.append(m := CheckpointManager(checkpoint, url, **{name: value}))
    ours = [w for w in caught if issubclass(w.category, DeprecationWarning) and "is deprecated; use" in str(w.message)]
    assert [str(w.message) for w in ours] == [f"`{name}=` is deprecated; use `{MANAGER_MOVES[name].spelling}`"]
    assert ours[0].filename == __file__  # the user's line, not psguard's
    assert took_effect(m)


def test_an_old_keyword_argument_beside_its_field_in_options_is_refused(
    checkpoint: tf.train.Checkpoint, url: str, tmp_path: Path
) -> None:
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ConfigError, match=r"`spool=` \(deprecated\) and `options\.spool`"),
    ):
        CheckpointManager(checkpoint, url, options=ManagerOptions(spool=tmp_path / "a"), spool=tmp_path / "b")


def test_max_to_keep_beside_a_retention_in_options_is_refused(checkpoint: tf.train.Checkpoint, url: str) -> None:
    with pytest.raises(ConfigError, match=r"either options\.retention or max_to_keep"):
        CheckpointManager(checkpoint, url, max_to_keep=2, options=ManagerOptions(retention=Retention(keep_last=1)))


def test_an_unknown_keyword_argument_is_a_type_error(checkpoint: tf.train.Checkpoint, url: str) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'spoool'"):
        CheckpointManager(checkpoint, url, **{"spoool": "/x"})


# ----------------------------------------------------------------------------------------------- the sink
def test_repr_shows_the_store_sink_and_why(
    checkpoint: tf.train.Checkpoint, url: str, opened: list[CheckpointManager]
) -> None:
    opened.append(m := CheckpointManager(checkpoint, url))
    assert repr(m) == f"psguard.CheckpointManager(directory={url!r}, sink=store($PSGUARD_SPOOL unset))"
    opened.append(forced := CheckpointManager(checkpoint, url, sink="store"))
    assert repr(forced).endswith("sink=store(sink='store'))")


def test_repr_shows_the_agents_spool_from_the_environment(
    checkpoint: tf.train.Checkpoint,
    url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    opened: list[CheckpointManager],
) -> None:
    spool = str(tmp_path / "spool")
    under_agent(monkeypatch, spool, url)
    opened.append(m := CheckpointManager(checkpoint, url))
    assert repr(m) == f"psguard.CheckpointManager(directory={url!r}, sink=agent(spool={spool}, from $PSGUARD_SPOOL))"
    assert type(m._sink).__name__ == "AgentSink"
    with pytest.raises(ConfigError, match="two writers of one durable log"):
        CheckpointManager(checkpoint, url, sink="store")
