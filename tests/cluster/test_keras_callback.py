"""psguard.trainer.keras.CheckpointCallback: tf_keras ``model.fit`` saving incrementally and resuming where it stopped.

The first half runs without a cluster (a plain tf_keras model: fast); the second trains under
ParameterServerStrategy on the session cluster, in this process and, for the restart test, in chief
subprocesses (``tests/support/keras_chief.py``) that connect to the same PS and worker servers. A second chief in
another process works beside this one: each chief is its own TF context on the servers.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf
import tf_keras

from psguard.errors import ConfigError
from psguard.policy.engine import AnyOf, EveryInterval, EverySteps, Schedule
from psguard.store import Store
from psguard.trainer.export import OBJECT_GRAPH_KEY
from psguard.trainer.keras import CheckpointCallback, FitPosition, KerasSupportError
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.options import CallbackOptions, ManagerOptions
from psguard.trainer.variables import bitwise_equal, read_tensors
from tests.support.clusters import Chief
from tests.support.keras_chief import build_model, dataset_fn
from tests.support.paths import ROOT
from tests.support.storage_targets import make_target
from tests.support.tensorboard import scalars

EMBEDDING = "model/layer_with_weights-0/embeddings/.ATTRIBUTES/VARIABLE_VALUE"


def assert_bitwise(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> None:
    expected = {n: v for n, v in expected.items() if n != OBJECT_GRAPH_KEY}
    actual = {n: v for n, v in actual.items() if n != OBJECT_GRAPH_KEY}
    assert sorted(expected) == sorted(actual)
    bad = [n for n in expected if not bitwise_equal(expected[n], actual[n])]
    assert not bad, f"tensors differ bit for bit: {bad}"


def stored(url: str, options: dict[str, Any] | None = None) -> list[Any]:
    with Store.open(url, options) as store:
        return store.checkpoints()


def load(url: str, checkpoint_id: str, options: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    with Store.open(url, options) as store:
        return store.load(checkpoint_id)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return str(tmp_path / "ckpts")


# --------------------------------------------------------------------------------------------- local
def local_model(steps_per_execution: int = 3, optimizer: str = "adam") -> Any:
    model = tf_keras.Sequential(
        [
            tf_keras.Input((2,), dtype="int64"),
            tf_keras.layers.Embedding(100, 4),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(1),
        ]
    )
    opt = tf_keras.optimizers.Adam(0.01) if optimizer == "adam" else tf_keras.optimizers.legacy.Adagrad(0.1)
    model.compile(optimizer=opt, loss="mse", steps_per_execution=steps_per_execution)
    return model


def local_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 100, (320, 2)), rng.random((320, 1)).astype(np.float32)


class Crash(tf_keras.callbacks.Callback):  # type: ignore[misc]
    """Stands for the process dying: raises once fit has scheduled ``at`` steps."""

    def __init__(self, psguard: CheckpointCallback, at: int) -> None:
        super().__init__()
        self.psguard, self.at = psguard, at

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.psguard.step >= self.at:
            raise KeyboardInterrupt


class Batches(tf_keras.callbacks.Callback):  # type: ignore[misc]
    """Records (epoch, last batch index) of every execution fit runs."""

    def __init__(self) -> None:
        super().__init__()
        self._supports_tf_logs = True  # batch hooks under PS need it (logs are RemoteValues; unread here)
        self.seen: list[tuple[int, int]] = []
        self.epoch = -1

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.seen.append((self.epoch, batch))


@pytest.mark.parametrize("backend", ["local", pytest.param("seaweed", id="s3-seaweedfs", marks=pytest.mark.slow)])
def test_fit_resumes_mid_epoch_at_the_saved_step(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, unique: str
) -> None:
    target = make_target(backend, request, tmp_path, unique)
    url, options = target.url, target.options or None
    x, y = local_data()  # 10 batches of 32 per epoch, 3 per execution: executions end at batches 2, 5, 8, 9
    first = local_model()
    cb = CheckpointCallback(url, save_freq=4, options=CallbackOptions(manager=ManagerOptions(storage_options=options)))
    with pytest.raises(KeyboardInterrupt):
        first.fit(x, y, batch_size=32, epochs=3, callbacks=[cb, Crash(cb, 16)], verbose=0)
    cb.close()  # fit raised: on_train_end never ran
    infos = stored(url, options)
    last = infos[-1]
    assert [i.kind for i in infos] == ["full"] + ["delta"] * (len(infos) - 1)
    assert 0 < last.step <= 16
    position = FitPosition.from_json(last.metadata["data_position"])
    assert position is not None and position.step == last.step
    assert position.resume_at(10) == divmod(last.step, 10)

    second = local_model()
    cb2 = CheckpointCallback(url, save_freq=4, options=CallbackOptions(manager=ManagerOptions(storage_options=options)))
    batches = Batches()
    second.fit(x, y, batch_size=32, epochs=3, callbacks=[cb2, batches], verbose=0)
    assert cb2.restored_step == last.step
    assert cb2.resumed_at == divmod(last.step, 10)
    epoch, done = divmod(last.step, 10)
    assert batches.seen[0] == (epoch, min(done + 2, 9))  # the first execution continues the epoch
    assert int(second.optimizer.iterations.numpy()) == 30 == cb2.step
    final = stored(url, options)[-1]
    assert final.step == 30 and final.kind == "delta"
    assert_bitwise(read_tensors(cb2.checkpoint), load(url, final.id, options))


def test_a_finished_run_trains_nothing_and_restores_everything(url: str) -> None:
    """The optimizer is built before the restore: its slots come back too (TF would skip them silently)."""
    x, y = local_data()
    model = local_model(optimizer="legacy-adagrad")
    cb = CheckpointCallback(url, save_freq=5)
    model.fit(x, y, batch_size=32, epochs=2, callbacks=[cb], verbose=0)
    want = read_tensors(cb.checkpoint)
    assert any(".OPTIMIZER_SLOT" in n for n in want)

    fresh = local_model(optimizer="legacy-adagrad")
    cb2 = CheckpointCallback(url, save_freq=5)
    batches = Batches()
    fresh.fit(x, y, batch_size=32, epochs=2, callbacks=[cb2, batches], verbose=0)
    assert cb2.resumed_at == (2, 0) and batches.seen == []
    assert_bitwise(want, read_tensors(cb2.checkpoint))
    assert stored(url)[-1].step == 20  # no new checkpoint for a run that did nothing
    assert len(stored(url)) == len({i.step for i in stored(url)})


def test_an_existing_manager_is_used_and_left_open(url: str) -> None:
    x, y = local_data()
    model = local_model()
    model.optimizer.build(model.trainable_variables)
    manager = CheckpointManager(tf.train.Checkpoint(model=model, optimizer=model.optimizer), url)
    try:
        cb = CheckpointCallback(manager, save_freq=6)
        model.fit(x, y, batch_size=32, epochs=1, callbacks=[cb], verbose=0)
        # The callback's schedule and position hook applied during the fit only.
        assert manager.schedule is None and manager.data_position is None
        info = manager.save(99).result(timeout=60)  # still open
        assert info.step == 99
        infos = manager.store.checkpoints()
        assert [i.step for i in infos] == [6, 10, 99]  # every 6 steps (batches end at 3, 6, 9, 10), at the end
        assert FitPosition.from_json(infos[1].metadata["data_position"]) == FitPosition(0, 10, 10, 10)
        assert "data_position" not in infos[2].metadata
    finally:
        manager.close()


def test_configuration_errors(url: str) -> None:
    with pytest.raises(ConfigError, match="store once"):
        CheckpointCallback(url, backup_dir=url)
    with pytest.raises(ConfigError, match="store once"):
        CheckpointCallback()
    with pytest.raises(ConfigError, match="positive"):
        CheckpointCallback(url, save_freq=0)
    with pytest.raises(ConfigError, match="save_freq"):
        CheckpointCallback(url, save_freq="batch")
    with pytest.raises(ConfigError, match="needs monitor"):
        CheckpointCallback(url, save_best_only=True)
    with pytest.raises(ConfigError, match="mode"):
        CheckpointCallback(url, monitor="loss", mode="up")
    manager = CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)), url)
    try:
        with pytest.raises(ConfigError, match="existing CheckpointManager"):
            CheckpointCallback(manager, save_freq=3, options=CallbackOptions(max_to_keep=2))
        with pytest.raises(ConfigError, match="existing CheckpointManager"):
            CheckpointCallback(manager, options=CallbackOptions(summaries="logs"))
    finally:
        manager.close()
    with pytest.raises(ConfigError, match="summaries once"):
        CheckpointCallback(url, options=CallbackOptions(summaries=False, manager=ManagerOptions(summaries="logs")))
    unbuilt = tf_keras.Sequential([tf_keras.layers.Dense(1)])
    unbuilt.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ConfigError, match="build the model"):
        unbuilt.fit(np.zeros((4, 2)), np.zeros((4, 1)), callbacks=[CheckpointCallback(url, save_freq=1)])


def test_it_replaces_backup_and_restore_with_one_line(url: str) -> None:
    """BackupAndRestore(backup_dir) -> CheckpointCallback(backup_dir): a save at every epoch's end, resumed."""
    x, y = local_data()
    callback = CheckpointCallback(backup_dir=url)
    model = local_model()
    model.fit(x, y, epochs=3, batch_size=32, callbacks=[callback], verbose=0)
    steps = [c.step for c in Store.open(url).checkpoints()]
    # One save per epoch (10 batches each); a save asked while the previous one is still written folds into it.
    assert steps[-1] == 30 and steps[0] == 10 and set(steps) <= {10, 20, 30}, steps
    again = CheckpointCallback(url, "epoch")
    model2 = local_model()
    model2.fit(x, y, epochs=3, batch_size=32, callbacks=[again], verbose=0)
    assert again.restored_step == 30 and int(model2.optimizer.iterations.numpy()) == 30, "nothing left to train"


def test_model_checkpoint_monitor_keeps_the_best_epoch_and_save_best_only_skips_the_rest(url: str) -> None:
    x, y = local_data()

    class Scripted(tf_keras.callbacks.Callback):  # type: ignore[misc]
        """Replaces the epoch's val_loss by a scripted one (before psguard's callback reads it)."""

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            logs["val_loss"] = [0.5, 0.2, 0.4, 0.3, 0.6][epoch]

    callback = CheckpointCallback(
        url, monitor="val_loss", save_best_only=True, options=CallbackOptions(max_to_keep=1, save_at_end=False)
    )
    local_model().fit(x, y, epochs=5, batch_size=32, callbacks=[Scripted(), callback], verbose=0)
    store = Store.open(url)
    steps = [c.step for c in store.checkpoints()]
    assert steps[-1] == 20 and set(steps) <= {10, 20}, f"only improvements saved, the best kept: {steps}"
    assert callback.best == 0.2 and callback.mode == "min"
    assert CheckpointCallback(url, monitor="val_accuracy").mode == "max", "auto as ModelCheckpoint decides"


def test_backup_and_restore_beside_it_is_refused(url: str, tmp_path: Path) -> None:
    """Both resume through model._training_state: with two, one would silently lose."""
    x, y = local_data()
    backup = tf_keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(ConfigError, match="BackupAndRestore"):
        local_model().fit(x, y, epochs=1, callbacks=[backup, CheckpointCallback(url, save_freq=1)], verbose=0)


def test_steps_and_policy_combine() -> None:
    cb = CheckpointCallback("unused", save_freq=7, policy=Schedule(durable=EveryInterval(60.0)))
    assert cb._schedule == Schedule(durable=AnyOf((EveryInterval(60.0), EverySteps(7))))
    preset = CheckpointCallback("unused", policy="default")
    assert preset._schedule is not None and preset._schedule.durable is not None


def test_fit_position_resume() -> None:
    assert FitPosition(epoch=1, batches=10, step=20).resume_at(10) == (2, 0)
    assert FitPosition(epoch=1, batches=4, step=14).resume_at(10) == (1, 4)
    assert FitPosition(epoch=0, batches=7, step=7).resume_at(None) == (0, 7)
    assert FitPosition.from_json({"other": 1}) is None


def test_keras3_model_without_ps_is_refused(url: str) -> None:
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(KerasSupportError, match="custom training loop"):
        model.fit(np.zeros((4, 2)), np.zeros((4, 1)), callbacks=[CheckpointCallback(url, save_freq=1)])


def test_fit_writes_psguards_scalars_as_a_run_beside_the_tensorboard_callbacks(url: str, tmp_path: Path) -> None:
    x, y = local_data()  # 10 batches of 32 per epoch
    logs = tmp_path / "tb"
    # update_freq=4: while it trains, the TensorBoard callback records only every 4th step, saves are every 3rd
    board = tf_keras.callbacks.TensorBoard(log_dir=str(logs), update_freq=4)
    cb = CheckpointCallback(url, save_freq=3)
    local_model(steps_per_execution=1).fit(x, y, batch_size=32, epochs=2, callbacks=[board, cb], verbose=0)
    assert cb.summaries_folder == str(logs / "psguard")
    assert {"train", "psguard"} <= {p.name for p in logs.iterdir()}
    steps = [i.step for i in stored(url)]
    assert steps == [3, 6, 9, 12, 15, 18, 20]  # every 3rd step, and the end
    got = scalars(logs / "psguard")
    assert {"psguard/capture_stall_seconds", "psguard/save_bytes", "psguard/held_seconds"} <= set(got)
    for tag in ("psguard/capture_stall_seconds", "psguard/save_bytes", "psguard/durable_lag_steps"):
        assert sorted(got[tag]) == steps, tag
    assert all(v > 0 for v in got["psguard/capture_stall_seconds"].values())
    assert all(v > 0 for v in got["psguard/save_bytes"].values())
    # the default durable_lag holds each save until it is durable: no lag after any
    assert set(got["psguard/durable_lag_steps"].values()) == {0.0}
    assert "psguard/restores/durable" not in got  # a fresh run restores nothing

    # A second fit with one more epoch resumes from step 20: its restore is written there.
    again = CheckpointCallback(url, save_freq=3)
    board = tf_keras.callbacks.TensorBoard(log_dir=str(logs), update_freq=4)
    local_model(steps_per_execution=1).fit(x, y, batch_size=32, epochs=3, callbacks=[again, board], verbose=0)
    got = scalars(logs / "psguard")
    assert got["psguard/restores/durable"] == {20: 1.0}
    assert got["psguard/lost_steps"] == {20: 0.0}  # this process had seen step 20 and no later one
    assert sorted(got["psguard/save_bytes"]) == [i.step for i in stored(url)] == [*steps, 23, 26, 29, 30]

    # summaries=False: none written, TensorBoard callback or not.
    off = CheckpointCallback(str(tmp_path / "other"), save_freq=3, options=CallbackOptions(summaries=False))
    board = tf_keras.callbacks.TensorBoard(log_dir=str(tmp_path / "tb-off"))
    local_model(steps_per_execution=1).fit(x, y, batch_size=32, epochs=1, callbacks=[board, off], verbose=0)
    assert off.summaries_folder is None
    assert not (tmp_path / "tb-off" / "psguard").exists()


# --------------------------------------------------------------------------------------------- cluster
@pytest.mark.slow
def test_fit_under_ps_saves_incrementally_and_restores_exactly(chief: Chief, url: str) -> None:
    strategy = chief.strategies["fixed2"]
    model = build_model(strategy, steps_per_execution=2)
    data = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
    cb = CheckpointCallback(url, save_freq=4)
    model.fit(data, epochs=2, steps_per_epoch=10, callbacks=[cb], verbose=0)
    assert model._cluster_coordinator is chief.coordinators["fixed2"]
    assert int(model.optimizer.iterations.numpy()) == 20 == cb.step

    infos = stored(url)
    assert len(infos) >= 2 and infos[-1].step == 20
    assert [i.kind for i in infos] == ["full"] + ["delta"] * (len(infos) - 1)
    assert [i.step for i in infos] == sorted({i.step for i in infos})
    assert all(i.step % 2 == 0 for i in infos)  # batches arrive every steps_per_execution steps
    # Each delta holds the rows a few batches touched (<= 4 steps x 16 x 2 ids of 2000), not the tables.
    for delta in infos[1:]:
        assert delta.stored_bytes < infos[0].stored_bytes / 4, (delta.stored_bytes, infos[0].stored_bytes)
    print("\nfit under PS, stored bytes per save:", [(i.step, i.kind, i.stored_bytes) for i in infos])
    live = read_tensors(cb.checkpoint)
    assert len(model.layers[0].embeddings.variables) == 2  # sharded by the strategy's partitioner
    assert_bitwise(live, load(url, infos[-1].id))

    # A fresh model (optimizer not built: the callback builds it before restoring) given the same fit resumes
    # at its end: it trains nothing and holds exactly what the store held.
    fresh = build_model(strategy, steps_per_execution=2)
    cb2 = CheckpointCallback(url, save_freq=4)
    batches = Batches()
    fresh.fit(data, epochs=2, steps_per_epoch=10, callbacks=[cb2, batches], verbose=0)
    assert cb2.restored_step == 20 and cb2.resumed_at == (2, 0) and batches.seen == []
    assert_bitwise(live, read_tensors(cb2.checkpoint))


class HashedAll(tf_keras.callbacks.Callback):  # type: ignore[misc]
    """Placed after the psguard callback: for each save it made, the tensors whose every row its capture hashed."""

    def __init__(self, psguard: CheckpointCallback) -> None:
        super().__init__()
        self._supports_tf_logs = True
        self.psguard = psguard
        self.seen: list[list[str]] = []
        self.last: Any = None

    def _implements_train_batch_hooks(self) -> bool:
        return True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.psguard.last_save is not self.last:
            self.last = self.psguard.last_save
            assert self.psguard.manager is not None
            self.seen.append(list(self.psguard.manager.capturer.last_stats.hashed_all))


@pytest.mark.slow
def test_write_tracking_holds_across_fits(chief: Chief, url: str, tmp_path: Path) -> None:
    """Only written rows are hashed in every fit, not in the first one alone.

    tf_keras keeps the first fit's train function for later fits; traced under the first fit's capturer, it
    would leave every capture of a second fit hashing every row (an Adagrad job as slow to save as an Adam one).
    And an existing manager made before the optimizer was built gets the slots hooked before fit traces a step.
    """
    strategy = chief.strategies["fixed2"]
    data = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
    model = build_model(strategy, steps_per_execution=2)
    cb = CheckpointCallback(url, save_freq=4)
    watch = HashedAll(cb)
    model.fit(data, epochs=1, steps_per_epoch=8, callbacks=[cb, watch], verbose=0)
    first = model.train_tf_function
    model.fit(data, epochs=2, steps_per_epoch=8, callbacks=[cb, watch], verbose=0)  # resumes at epoch 1
    assert len(watch.seen) >= 3 and watch.seen[0], watch.seen  # the first capture is full: every row
    assert not any(watch.seen[1:]), watch.seen
    assert model.train_tf_function is not first  # traced again, under the second fit's hooks

    # optimizer not built: its slots appear in the callback's on_train_begin
    fresh = build_model(strategy, steps_per_execution=2)
    manager = CheckpointManager(
        tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer),
        str(tmp_path / "given"),
        options=ManagerOptions(coordinator=chief.coordinator),
    )
    try:
        cb2 = CheckpointCallback(manager, save_freq=4)
        watch2 = HashedAll(cb2)
        fresh.fit(data, epochs=1, steps_per_epoch=8, callbacks=[cb2, watch2], verbose=0)
        kept = fresh.train_tf_function
        fresh.fit(data, epochs=2, steps_per_epoch=8, callbacks=[cb2, watch2], verbose=0)
        assert len(watch2.seen) >= 3 and watch2.seen[0], watch2.seen
        assert not any(watch2.seen[1:]), watch2.seen
        assert fresh.train_tf_function is kept  # traced under this manager's hooks: nothing to trace again
    finally:
        manager.close()


@pytest.mark.slow
def test_keras3_model_under_ps_is_refused_with_what_to_use(chief: Chief, url: str) -> None:
    import keras

    with chief.strategies["none"].scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    cb = CheckpointCallback(url, save_freq=1)
    with pytest.raises(KerasSupportError) as err:
        cb.set_model(model)  # what every CallbackList does before training
    text = str(err.value)
    assert "does not support ParameterServerStrategy" in text
    assert "TF_USE_LEGACY_KERAS=1" in text and "psguard.CheckpointManager" in text
    # Keras 3's own fit fails earlier still, before it hands the model to any callback.
    with pytest.raises(ValueError, match="create_per_worker_dataset"):
        model.fit(np.zeros((8, 4), np.float32), np.zeros((8, 1), np.float32), callbacks=[cb], verbose=0)


# --------------------------------------------------------------------------------------------- restart
class _ChiefGone(Exception):
    """The chief subprocess closed its output: ended, with this exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class ChiefProcess:
    """A ``tests.support.keras_chief`` subprocess and its JSON event lines, read with deadlines (never sleeps)."""

    #: Starts of a chief whose gRPC server could not bind its port: the port is chosen free, then bound by TF in
    #: the child seconds later, and a process of the other test worker may take it meanwhile.
    BIND_TRIES = 3

    def __init__(self, cluster: Any, url: str, opts: dict[str, Any], log: Path) -> None:
        self._cluster, self._args = cluster, [sys.executable, "-m", "tests.support.keras_chief", url, json.dumps(opts)]
        self.log = log
        self._starts = 0
        self._start()

    def _start(self) -> None:
        env = dict(os.environ, TF_CONFIG=self._cluster.tf_config(), TF_USE_LEGACY_KERAS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        self._starts += 1
        self._log_file = open(self.log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            self._args, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file
        )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        self._buffer = b""
        self.events: list[dict[str, Any]] = []

    def _port_taken(self) -> bool:
        """The chief died before its first event because its server's port was taken (not a psguard failure)."""
        return not self.events and b"Could not start gRPC server" in self.log.read_bytes()

    def wait_for(
        self, name: str, timeout: float = 300.0, where: Callable[[dict[str, Any]], bool] = lambda e: True
    ) -> dict[str, Any]:
        """The next event called ``name`` that satisfies ``where`` (events before it are kept in ``events``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._wait_for(name, deadline, timeout, where)
            except _ChiefGone as gone:
                if not (self._port_taken() and self._starts < self.BIND_TRIES):
                    raise AssertionError(
                        f"chief exited ({gone.code}) before {name!r}; got {self.events}\n{self.tail()}"
                    ) from None
                self.close()
                self._start()

    def _wait_for(
        self, name: str, deadline: float, timeout: float, where: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any]:
        with selectors.DefaultSelector() as sel:
            sel.register(self._fd, selectors.EVENT_READ)
            while True:
                for event in self._parse():
                    if event["event"] == name and where(event):
                        return event
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {name!r} event within {timeout}s; got {self.events}\n{self.tail()}")
                if sel.select(left):
                    data = os.read(self._fd, 65536)
                    if not data:
                        raise _ChiefGone(self.proc.wait(timeout=60))
                    self._buffer += data

    def _parse(self) -> Iterator[dict[str, Any]]:
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            if line.strip().startswith(b"{"):
                event = json.loads(line)
                self.events.append(event)
                yield event

    def tail(self) -> str:
        return self.log.read_bytes()[-3000:].decode("utf-8", "replace")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log_file.close()


@contextlib.contextmanager
def chief_process(cluster: Any, url: str, opts: dict[str, Any], log: Path) -> Iterator[ChiefProcess]:
    proc = ChiefProcess(cluster, url, opts, log)
    try:
        yield proc
    finally:
        proc.close()


@pytest.mark.slow
def test_fit_resumes_after_the_chief_process_is_killed(chief: Chief, url: str, tmp_path: Path) -> None:
    """SIGKILL a chief mid-fit, start another with the same fit: it continues from the last durable step."""
    epochs, spe, spx = 3, 20, 2
    opts = {"epochs": epochs, "steps_per_epoch": spe, "steps_per_execution": spx, "every": 6}
    t0 = time.monotonic()
    with chief_process(chief.cluster, url, {**opts, "hold": True}, tmp_path / "chief1.log") as first:
        assert first.wait_for("restored")["step"] is None  # a fresh store
        # A delta, so that the restore materialises a chain (base + deltas); the chief parks before its last
        # execution, so this comes while fit still has steps to schedule: the kill lands mid-training.
        durable = first.wait_for("durable", where=lambda e: e["kind"] == "delta")
        first.kill()
    t_kill = time.monotonic()
    assert first.proc.returncode == -signal.SIGKILL

    last = stored(url)[-1]  # a save may have committed after the event and before the kill
    assert last.step >= durable["step"] > 0 and last.kind == "delta"
    assert last.step < epochs * spe
    dump = tmp_path / "restored.npz"
    with chief_process(chief.cluster, url, {**opts, "dump": str(dump)}, tmp_path / "chief2.log") as second:
        restored = second.wait_for("restored")
        resumed = second.wait_for("resumed")
        finished = second.wait_for("finished")
        assert second.proc.wait(timeout=120) == 0, second.tail()
    t_done = time.monotonic()

    # The second chief restored the newest durable checkpoint, not step 0, with the values the store held.
    assert restored["step"] == last.step and restored["id"] == last.id
    assert restored["iterations"] == last.step
    with np.load(dump, allow_pickle=True) as npz:
        assert_bitwise(load(url, last.id), {name: npz[name] for name in npz.files})
    # It continued at the position of that step, and ran only the steps the checkpoint had not seen.
    assert resumed["at"] == list(divmod(last.step, spe)) and resumed["epoch"] == last.step // spe
    assert finished["iterations"] == epochs * spe == finished["step"]

    infos = {i.id: i for i in stored(url)}
    final = infos[finished["id"]]
    assert final.step == epochs * spe
    chain = [final]
    while chain[-1].parent is not None:
        chain.append(infos[chain[-1].parent])
    assert last.id in {i.id for i in chain}, "the second run's saves are deltas on top of the restored checkpoint"
    # The session's own chief (this process) still trains on the servers those chiefs used.
    with chief.strategies["none"].scope():
        probe = tf.Variable(1.0)
    assert chief.coordinator.schedule(tf.function(lambda: probe.assign_add(1.0))).fetch() == 2.0
    print(
        f"restart: chief 1 killed {t_kill - t0:.1f}s after start (durable step {durable['step']}, store at "
        f"{last.step}); chief 2 resumed at {resumed['at']}, finished {t_done - t_kill:.1f}s after the kill"
    )
