"""``psguard.keras.CheckpointCallback``'s surface, on a plain tf_keras model (no cluster): Keras' arguments, then
``policy``, ``options`` and ``sink``; the options reach the manager the callback creates; each old keyword
argument warns with its new spelling at the caller's line and still takes effect; contradictions are refused.

Training, resuming and saving under PS are tests/cluster/test_keras_callback.py's.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tf_keras

from psguard.errors import ConfigError
from psguard.policy.engine import EverySteps, Retention, Schedule
from psguard.store import Store
from psguard.trainer.keras import CheckpointCallback
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.options import CALLBACK_MOVES, CallbackOptions, CaptureOptions, ManagerOptions
from tests.support.agents import under_agent


@pytest.fixture(autouse=True)
def no_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    under_agent(monkeypatch, None, None)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def begun() -> Iterator[Callable[[CheckpointCallback], CheckpointManager]]:
    """Start a fit's checkpointing as ``fit`` does (``set_model``, ``on_train_begin``) and hand back the manager
    the callback created; every callback begun is closed after the test."""
    callbacks: list[CheckpointCallback] = []

    def begin(callback: CheckpointCallback) -> CheckpointManager:
        model = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        callback.set_model(model)
        callback.set_params({"epochs": 1, "steps": 4})
        callbacks.append(callback)
        callback.on_train_begin()
        assert callback.manager is not None
        return callback.manager

    yield begin
    for callback in callbacks:
        callback.close()


def test_the_signature_is_keras_arguments_then_psguards_three() -> None:
    params = list(inspect.signature(CheckpointCallback.__init__).parameters.values())[1:]
    backup_and_restore = ["directory", "save_freq", "delete_checkpoint", "save_before_preemption", "backup_dir"]
    model_checkpoint = ["monitor", "mode", "save_best_only"]
    assert [p.name for p in params] == [
        *backup_and_restore,
        *model_checkpoint,
        "policy",
        "options",
        "sink",
        "deprecated",
    ]
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD


def test_the_options_reach_the_manager_the_callback_creates(
    url: str, tmp_path: Path, begun: Callable[[CheckpointCallback], CheckpointManager]
) -> None:
    options = CallbackOptions(
        max_to_keep=2,
        summaries=tmp_path / "logs",
        manager=ManagerOptions(new_base_after=3, restore_timeout=5.0, capture=CaptureOptions(verify_every=4)),
    )
    callback = CheckpointCallback(url, options=options, sink="store")
    manager = begun(callback)
    assert (manager.max_to_keep, manager.new_base_after, manager.restore_timeout) == (2, 3, 5.0)
    assert manager.capturer.verify_every == 4 and manager.summaries == str(tmp_path / "logs")
    assert str(manager.sink) == "store(sink='store')"
    assert manager.data_position == callback._data_position  # the callback's own, beside the user's options


@pytest.mark.parametrize("save_at_end", [True, False])
def test_save_at_end_decides_whether_the_end_of_fit_saves(
    url: str, save_at_end: bool, begun: Callable[[CheckpointCallback], CheckpointManager]
) -> None:
    callback = CheckpointCallback(url, options=CallbackOptions(save_at_end=save_at_end))
    begun(callback)
    callback.on_train_end()
    with Store.open(url) as store:
        assert len(store.checkpoints()) == int(save_at_end)


def test_the_sink_goes_to_the_manager_and_is_checked_there(
    url: str, begun: Callable[[CheckpointCallback], CheckpointManager]
) -> None:
    with pytest.raises(ConfigError, match=r"sink='agent', but \$PSGUARD_SPOOL is not set"):
        begun(CheckpointCallback(url, sink="agent"))


# ----------------------------------------------------------------------------------- the old keyword arguments
def caught_warnings(make: Callable[[], CheckpointCallback]) -> tuple[CheckpointCallback, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback = make()
    ours = [w for w in caught if issubclass(w.category, DeprecationWarning) and "is deprecated; use" in str(w.message)]
    assert all(w.filename == __file__ for w in ours), [w.filename for w in ours]  # the user's line
    return callback, [str(w.message) for w in ours]


OLD: dict[str, tuple[Any, Callable[[CheckpointManager], bool]]] = {
    "max_to_keep": (2, lambda m: m.max_to_keep == 2),
    "storage_options": ({}, lambda m: m.options.storage_options == {}),
    "manager_options": ({"new_base_after": 3, "restore_timeout": 4.0}, lambda m: m.new_base_after == 3),
    "summaries": ("logs-folder", lambda m: m.summaries == "logs-folder"),
    "save_at_end": (False, lambda m: True),  # its effect: test_save_at_end_... below, through the old spelling
}


@pytest.mark.parametrize("name", sorted(OLD))
def test_an_old_keyword_argument_warns_with_its_new_spelling_and_still_takes_effect(
    name: str, url: str, begun: Callable[[CheckpointCallback], CheckpointManager]
) -> None:
    value, took_effect = OLD[name]
    callback, messages = caught_warnings(lambda: CheckpointCallback(url, **{name: value}))
    assert messages == [f"`{name}=` is deprecated; use `{CALLBACK_MOVES[name].spelling}`"]
    assert took_effect(begun(callback))


def test_old_save_at_end_still_takes_effect(url: str, begun: Callable[[CheckpointCallback], CheckpointManager]) -> None:
    callback, _ = caught_warnings(lambda: CheckpointCallback(url, **{"save_at_end": False}))
    begun(callback)
    callback.on_train_end()
    with Store.open(url) as store:
        assert store.checkpoints() == []


def test_old_save_every_n_steps_is_save_freq() -> None:
    callback, messages = caught_warnings(lambda: CheckpointCallback("unused", **{"save_every_n_steps": 4}))
    assert messages == ["`save_every_n_steps=` is deprecated; use `save_freq=...`"]
    new = CheckpointCallback("unused", save_freq=4)
    assert callback._schedule == new._schedule == Schedule(durable=EverySteps(4))
    assert callback.save_per_epoch is new.save_per_epoch is False


def test_old_save_every_n_steps_beside_epoch_saves_names_the_schedule_that_does_both() -> None:
    callback, messages = caught_warnings(
        lambda: CheckpointCallback("unused", save_freq="epoch", **{"save_every_n_steps": 4})
    )
    spelling = "policy=psguard.policy.Schedule(durable=psguard.policy.EverySteps(...))` beside `save_freq='epoch'"
    assert messages == [f"`save_every_n_steps=` is deprecated; use `{spelling}`"]
    new = CheckpointCallback("unused", save_freq="epoch", policy=Schedule(durable=EverySteps(4)))
    assert callback._schedule == new._schedule and callback.save_per_epoch and new.save_per_epoch


# ------------------------------------------------------------------------------------------------ refused
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"max_to_keep": 2, "options": CallbackOptions(max_to_keep=3)},
            r"`max_to_keep=` \(deprecated\) and `options\.max_to_keep` are both given",
        ),
        ({"save_every_n_steps": 4, "save_freq": 5}, "give save_freq .steps. or save_every_n_steps, not both"),
        ({"options": CallbackOptions(manager=ManagerOptions(coordinator=object()))}, "leave options.manager.coord"),
        (
            {"monitor": "loss", "options": CallbackOptions(manager=ManagerOptions(retention=Retention(keep_last=1)))},
            "give retention once",
        ),
        (
            {"options": CallbackOptions(summaries=False, manager=ManagerOptions(summaries="logs"))},
            "give summaries once",
        ),
    ],
)
def test_contradicting_arguments_are_refused(url: str, kwargs: dict[str, Any], match: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError, match=match):
            CheckpointCallback(url, **kwargs)


def test_options_and_sink_are_refused_with_an_existing_manager(url: str, tmp_path: Path) -> None:
    import tensorflow as tf

    manager = CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), url)
    try:
        for kwargs in ({"options": CallbackOptions(max_to_keep=1)}, {"sink": "store"}):
            with pytest.raises(ConfigError, match="existing CheckpointManager"):
                CheckpointCallback(manager, **kwargs)
        CheckpointCallback(manager, options=CallbackOptions())  # the defaults configure nothing
    finally:
        manager.close()
