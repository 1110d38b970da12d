"""psguard.CheckpointManager: the tf.train.CheckpointManager drop-in, async, incremental and exact.

The first half uses local variables (no cluster: fast); the second trains the recommendation model on a
real 2-PS, 2-worker cluster with this process as chief.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

from psguard.errors import ConfigError, SaveError, TensorMismatchError
from psguard.policy.engine import EverySteps, Schedule
from psguard.policy.lag import LagBound
from psguard.storage import RetryConfig, open_backend
from psguard.store import Store
from psguard.testbed.model import ModelConfig, RecModel, Trainer, build_optimizer, make_optimizer
from psguard.trainer.export import OBJECT_GRAPH_KEY, export_checkpoint
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.options import ManagerOptions
from psguard.trainer.variables import bitwise_equal
from tests.support.clusters import Chief
from tests.support.managers import FlakyBackend, GatedBackend, assert_restores, make_local, snapshot, train_local
from tests.support.paths import ROOT

#: The async pipeline these tests look into: saves return at the capture and the durable log trails, reported.
ASYNC = Schedule(durable_lag=LagBound(on_exceed="report"))


@pytest.fixture
def url(tmp_path: Path) -> str:
    return str(tmp_path / "ckpts")


SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


# --------------------------------------------------------------------------------------------- local
def test_incremental_chain_restores_every_step_exactly(url: str) -> None:
    ckpt, emb, dense = make_local()
    rng = np.random.default_rng(1)
    expected = {}
    with CheckpointManager(ckpt, url, step_counter=ckpt.step) as m:
        for _ in range(10):
            train_local(emb, dense, ckpt, rng)
            handle = m.save()
            expected[handle.result(timeout=60).id] = snapshot(ckpt)
        infos = m.store.checkpoints()
        assert [i.kind for i in infos] == ["full"] + ["delta"] * 9
        assert infos[-1].stored_bytes < infos[0].stored_bytes / 10  # only the touched rows travel
        for cid, state in expected.items():
            assert_restores(m.store, cid, state)
        assert m.latest_checkpoint == infos[-1].id and m.checkpoints == [i.id for i in infos]


def test_restore_or_initialize_into_fresh_variables_of_another_partitioning(url: str) -> None:
    ckpt, emb, dense = make_local()
    train_local(emb, dense, ckpt, np.random.default_rng(2))
    with CheckpointManager(ckpt, url) as m:
        m.save(7).result(timeout=60)
        want = snapshot(ckpt)
    fresh, _, _ = make_local(seed=99, rows=(1000, 1000, 1000))
    with CheckpointManager(fresh, url) as m2:
        assert m2.restore_or_initialize() is not None
        assert m2.restored is not None and m2.restored.step == 7
        got = snapshot(fresh)
        assert all(bitwise_equal(want[n], got[n]) for n in want)
        assert all(type(u).__name__ == "Same" for u in m2.capturer.capture().values())  # rebased


def test_restore_or_initialize_without_checkpoint_runs_init_fn(url: str) -> None:
    ckpt, _, _ = make_local()
    called = []
    with CheckpointManager(ckpt, url) as m:
        assert m.restore_or_initialize(lambda: called.append(1)) is None
    assert called == [1]


def test_by_default_a_save_returns_once_it_is_durable_as_tfs_does(url: str) -> None:
    ckpt, _, _ = make_local()
    gate = threading.Event()
    backend = GatedBackend(open_backend(url), gate)
    store = Store(backend)
    try:
        with CheckpointManager(ckpt, url, options=ManagerOptions(store=store)) as m:
            handles: list[Any] = []
            saving = threading.Thread(target=lambda: handles.append(m.save(1)), daemon=True)
            saving.start()
            assert backend.entered.wait(60)  # the durable write is under way and the save has not returned
            assert saving.is_alive() and not handles
            gate.set()
            saving.join(60)
            assert handles and handles[0].done() and m.durable_lag.holds == 1 and m.last_hold_seconds > 0
            assert store.latest() is not None and store.latest().step == 1  # type: ignore[union-attr]
    finally:
        gate.set()
        store.close()


def test_async_save_persists_the_values_of_its_own_step(url: str) -> None:
    ckpt, emb, dense = make_local()
    gate = threading.Event()
    backend = GatedBackend(open_backend(url), gate)
    store = Store(backend)
    try:
        with CheckpointManager(ckpt, url, options=ManagerOptions(store=store), policy=ASYNC) as m:
            first = m.save(1)
            at_save = snapshot(ckpt)
            train_local(emb, dense, ckpt, np.random.default_rng(3), rows=500)  # while the write is blocked
            assert not first.done()
            gate.set()
            info = first.result(timeout=60)
            assert_restores(store, info.id, at_save)
    finally:
        store.close()


def test_saves_fold_while_the_store_is_slow_and_nothing_is_lost(url: str) -> None:
    ckpt, emb, dense = make_local()
    gate = threading.Event()
    backend = GatedBackend(open_backend(url), gate)
    store = Store(backend)
    rng = np.random.default_rng(4)
    try:
        with CheckpointManager(ckpt, url, options=ManagerOptions(store=store), policy=ASYNC) as m:
            handles = []
            for step in range(1, 5):
                train_local(emb, dense, ckpt, rng)
                handles.append(m.save(step))
                if step == 1:
                    assert backend.entered.wait(60)  # the first write is under way before the others come
            gate.set()
            results = [h.result(timeout=60) for h in handles]
            final = snapshot(ckpt)
            # the first write was in flight; saves 2..4 folded into one checkpoint at step 4
            assert [r.step for r in results] == [1, 4, 4, 4]
            assert len(store.checkpoint_ids()) == 2
            assert_restores(store, results[-1].id, final)
    finally:
        store.close()


def test_a_failed_write_keeps_its_rows_for_the_next_save(url: str) -> None:
    ckpt, emb, dense = make_local()
    backend = FlakyBackend(open_backend(url, retry=RetryConfig(deadline=0)))
    store = Store(backend)
    rng = np.random.default_rng(5)
    try:
        with CheckpointManager(ckpt, url, options=ManagerOptions(store=store)) as m:
            m.save(1).result(timeout=60)
            train_local(emb, dense, ckpt, rng)
            backend.failing = True
            with pytest.raises(SaveError, match="disk on fire"):
                m.save(2).result(timeout=60)
            with pytest.raises(SaveError):
                m.wait()
            backend.failing = False
            train_local(emb, dense, ckpt, rng)  # touches other rows than step 2
            info = m.save(3).result(timeout=60)
            assert info.kind == "delta"
            assert_restores(store, info.id, snapshot(ckpt))
    finally:
        store.close()


def test_restore_mismatch_lists_every_problem(url: str) -> None:
    ckpt, _, _ = make_local()
    with CheckpointManager(ckpt, url) as m:
        m.save(1).result(timeout=60)
    other = tf.train.Checkpoint(emb=tf.Variable(np.zeros((3000, 9), np.float32)), extra=tf.Variable(1.0))
    with CheckpointManager(other, url) as m2, pytest.raises(TensorMismatchError) as e:
        m2.restore_or_initialize()
    text = str(e.value)
    assert "emb/.ATTRIBUTES/VARIABLE_VALUE: checkpoint has (3000, 8) float32, model has (3000, 9)" in text
    assert "extra/" in text and "dense/" in text and "step/" in text


def test_max_to_keep_applies_retention(url: str) -> None:
    ckpt, emb, dense = make_local()
    rng = np.random.default_rng(6)
    with CheckpointManager(ckpt, url, max_to_keep=2, options=ManagerOptions(new_base_after=3)) as m:
        for step in range(1, 9):
            train_local(emb, dense, ckpt, rng)
            m.save(step).result(timeout=60)  # one at a time: no folding, so the chain length is known
        m.wait(60)  # and the last commit's retention, which follows its acknowledgment
        infos = m.store.checkpoints()
        # the newest two are kept, plus what they are built on; compaction started new bases on the way
        assert infos[-1].step == 8 and len(infos) <= 4
        assert any(i.kind == "full" and i.step > 1 for i in infos)
        assert_restores(m.store, infos[-1].id, snapshot(ckpt))


def test_policy_decides_when_to_save(url: str) -> None:
    ckpt, emb, dense = make_local()
    rng = np.random.default_rng(7)
    with CheckpointManager(ckpt, url, policy=Schedule(durable=EverySteps(3))) as m:
        saved = []
        for step in range(1, 10):
            train_local(emb, dense, ckpt, rng)
            h = m.maybe_save(step)
            if h is not None:
                h.result(timeout=60)
                saved.append(step)
        assert saved == [3, 6, 9]


def test_export_is_a_standard_tf_checkpoint(url: str, tmp_path: Path) -> None:
    ckpt, emb, dense = make_local()
    train_local(emb, dense, ckpt, np.random.default_rng(8))
    with CheckpointManager(ckpt, url) as m:
        info = m.save(5).result(timeout=60)
        prefix = export_checkpoint(m.store, info.id, tmp_path / "tf")
    names = {n for n, _ in tf.train.list_variables(str(tmp_path / "tf"))}
    assert {"emb/.ATTRIBUTES/VARIABLE_VALUE", "dense/.ATTRIBUTES/VARIABLE_VALUE", OBJECT_GRAPH_KEY} <= names
    fresh, _, fresh_dense = make_local(seed=42, rows=(3000,))
    tf.train.Checkpoint(emb=fresh.emb, dense=fresh.dense, step=fresh.step).restore(prefix).assert_consumed()
    assert bitwise_equal(fresh_dense.numpy(), dense.numpy())
    assert bitwise_equal(
        np.concatenate([v.numpy() for v in fresh.emb.variables]), np.concatenate([v.numpy() for v in emb.variables])
    )


def test_the_object_graph_is_walked_again_only_when_the_variables_change(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Walking TF's object graph is a part of every save's stall: done when the capture saw the variables change
    (here a variable added to the checkpoint), and the export then has the new graph."""
    import psguard.trainer.manager as manager_module

    walks: list[int] = []
    real = manager_module.object_graph_bytes

    def counted(root: Any) -> bytes:
        walks.append(1)
        return real(root)

    monkeypatch.setattr(manager_module, "object_graph_bytes", counted)
    ckpt, emb, dense = make_local()
    rng = np.random.default_rng(9)
    with CheckpointManager(ckpt, url) as m:
        for step in (1, 2, 3):
            train_local(emb, dense, ckpt, rng)
            m.save(step).result(timeout=60)
        assert len(walks) == 1
        ckpt.extra = tf.Variable(tf.fill([4], 7.0))
        info = m.save(4).result(timeout=60)
        assert len(walks) == 2
        prefix = export_checkpoint(m.store, info.id, tmp_path / "tf")
    extra = tf.Variable(tf.zeros([4]))
    tf.train.Checkpoint(extra=extra).restore(prefix).expect_partial()
    assert extra.numpy().tolist() == [7.0] * 4


# --------------------------------------------------------------------------------------------- TF's API
def _keras3_functional() -> tuple[Any, Any, tf.train.Checkpoint]:
    import keras

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(3)(inputs)))
    optimizer = keras.optimizers.Adam()
    return model, optimizer, tf.train.Checkpoint(model=model, optimizer=optimizer)


def _keras3_step(model: Any, optimizer: Any) -> None:
    x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))


def test_a_model_whose_variables_are_renamed_under_it_keeps_saving(url: str) -> None:
    """A Keras 3 functional model saved before its optimizer is built, then trained: its kernels' checkpoint
    keys move under the optimizer, and every later save failed ("a delta must list every tensor of its parent").
    TF's saver writes whole checkpoints and never minds; the save after the change is whole here."""
    model, optimizer, ckpt = _keras3_functional()
    with CheckpointManager(ckpt, url, max_to_keep=None) as m:
        before = m.save(0).result(timeout=60)
        _keras3_step(model, optimizer)
        after = m.save(1).result(timeout=60)
        _keras3_step(model, optimizer)
        delta = m.save(2).result(timeout=60)
    assert (before.kind, after.kind, delta.kind) == ("full", "full", "delta")
    trained = [v.numpy() for v in model.weights]
    # A fresh job restores step 0 (saved before its optimizer was built), trains and saves on from it.
    model2, optimizer2, ckpt2 = _keras3_functional()
    with CheckpointManager(ckpt2, url, max_to_keep=None) as m2:
        m2.restore(before.id)
        _keras3_step(model2, optimizer2)
        assert m2.save(3).result(timeout=60).kind == "full"
    model3, optimizer3, ckpt3 = _keras3_functional()
    _keras3_step(model3, optimizer3)  # built, as the trainer's was when it saved step 2
    with CheckpointManager(ckpt3, url, max_to_keep=None) as m3:
        m3.restore(delta.id)
    restored = [v.numpy() for v in model3.weights]
    assert len(restored) == len(trained) and all(map(np.array_equal, restored, trained))


def test_it_is_a_tf_checkpoint_manager_taking_tfs_positional_arguments(url: str) -> None:
    ckpt, _, _ = make_local()
    calls: list[int] = []
    m = CheckpointManager(ckpt, url, 3, None, "ckpt", ckpt.step, 2, lambda: calls.append(1))
    with m:
        assert isinstance(m, tf.train.CheckpointManager)
        assert m.checkpoint is ckpt and m.checkpoint_interval == 2 and m.max_to_keep == 3
        assert m.restore_or_initialize() is None and calls == [1], "init_fn from the constructor, as TF's"
        ckpt.step.assign(10)
        first = m.save()
        assert first is not None and first.result(timeout=60).step == 10
        ckpt.step.assign(11)
        assert m.save() is None, "within checkpoint_interval: no save, as TF's"
        ckpt.step.assign(12)
        second = m.save()
        # Waited for, as TF's synchronous save: a save asked for while the writer is busy with one job and has
        # another waiting is folded into the waiting one (sinks.py), which a loaded CI machine once did to 12.
        assert second is not None and second.result(timeout=60).step == 12
        assert m.save(check_interval=False) is None, "never twice at one step"
        ckpt.step.assign(13)
        assert m.save(check_interval=False) is not None
        m.sync()
        assert [c.step for c in m.store.checkpoints()] == [10, 12, 13]
    with pytest.raises(ConfigError, match="step_counter"):
        CheckpointManager(ckpt, url, checkpoint_interval=5)


def test_saves_are_numbered_by_save_counter_or_the_number_given(url: str) -> None:
    ckpt, _, _ = make_local()
    with CheckpointManager(ckpt, url) as m:
        steps = []
        for number in (None, None, tf.constant(40, tf.int64), tf.Variable(41, dtype=tf.int64), 7, None):
            handle = m.save(number)
            assert handle is not None
            steps.append(handle.result(timeout=60).step)
    assert steps == [1, 2, 40, 41, 7, 6], "save_counter counts every save, numbered or not, as TF's"


def test_tf_restore_idioms_restore_psguard_checkpoints_and_pass_tf_paths_through(url: str, tmp_path: Path) -> None:
    ckpt, emb, dense = make_local()
    rng = np.random.default_rng(3)
    states = []
    with CheckpointManager(ckpt, url) as m:
        for _ in range(3):
            train_local(emb, dense, ckpt, rng)
            m.save()
            states.append(snapshot(ckpt))
        m.wait()
        ids = m.checkpoints
        tf_path = tf.train.Checkpoint(emb=emb, dense=dense, step=ckpt.step).write(str(tmp_path / "tf" / "ckpt"))
    ckpt2, _, _ = make_local(seed=9)
    m2 = CheckpointManager(ckpt2, url)
    with m2:
        status = ckpt2.restore(m2.latest_checkpoint)  # the tutorial's line
        status.assert_consumed().assert_existing_objects_matched().assert_nontrivial_match().expect_partial()
        assert (status.checkpoint_id, status.step) == (ids[-1], 3)
        assert all(bitwise_equal(states[-1][n], v) for n, v in snapshot(ckpt2).items())
        status = m2.checkpoint.restore(ids[0])  # an older one, by id
        assert status.step == 1
        assert all(bitwise_equal(states[0][n], v) for n, v in snapshot(ckpt2).items())
        assert type(ckpt2.restore(tf_path)).__module__.startswith("tensorflow"), "a TF path goes to TF"
    # The manager closed: its ids are TF's problem again, with TF's error.
    with pytest.raises((tf.errors.NotFoundError, ValueError)):
        ckpt2.restore(ids[-1])


def test_values_without_a_variable_wait_for_it_and_a_wrong_model_is_still_refused(url: str) -> None:
    ckpt, _, _ = make_local()
    extra = tf.Variable(np.arange(6, dtype=np.float32))
    ckpt.extra = extra
    with CheckpointManager(ckpt, url) as m:
        m.save()
    later, _, _ = make_local(seed=5)
    with CheckpointManager(later, url) as m2:
        status = later.restore(m2.latest_checkpoint)
        status.assert_existing_objects_matched()
        with pytest.raises(AssertionError, match="extra"):
            status.assert_consumed()
        later.extra = tf.Variable(np.zeros(6, np.float32))  # created after the restore, as slots are
        assert later.extra.numpy().tolist() == [0, 1, 2, 3, 4, 5]
        status.assert_consumed()
    wrong = tf.train.Checkpoint(emb=tf.Variable(np.zeros((3000, 9), np.float32)))
    with CheckpointManager(wrong, url) as m3, pytest.raises(TensorMismatchError, match=r"model has \(3000, 9\)"):
        m3.restore_or_initialize()


# --------------------------------------------------------------------------------------------- cluster
CONFIG = ModelConfig(vocab_size=4000, embedding_dim=8, hidden=16, batch_size=64)


def fresh_model(chief: Chief, partitioning: str, optimizer: str) -> tuple[Any, Any, tf.train.Checkpoint]:
    strategy = chief.strategies[partitioning]
    with strategy.scope():
        model = RecModel(CONFIG)
        opt = make_optimizer(optimizer, "tf_keras")
        build_optimizer(opt, list(model.trainable_variables))
    return model, opt, tf.train.Checkpoint(model=model, optimizer=opt)


@pytest.fixture
def trained(chief: Chief) -> Iterator[tuple[Any, Any, tf.train.Checkpoint, Trainer]]:
    model, opt, ckpt = fresh_model(chief, "fixed2", "adagrad")
    yield model, opt, ckpt, Trainer(chief.strategies["fixed2"], chief.coordinator, model, opt)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam", "ftrl"])
def test_cluster_chain_restores_exactly_for_every_optimizer(chief: Chief, optimizer: str, url: str) -> None:
    model, opt, ckpt = fresh_model(chief, "fixed2", optimizer)
    trainer = Trainer(chief.strategies["fixed2"], chief.coordinator, model, opt)
    states = {}
    with CheckpointManager(
        ckpt, url, options=ManagerOptions(coordinator=chief.coordinator), step_counter=model.step
    ) as m:
        for _ in range(4):
            trainer.train(5, join=False)
            h = m.save()  # drains the coordinator first: weights and slots of one step
            states[h] = snapshot(ckpt)
        for h, state in states.items():
            assert_restores(m.store, h.result(timeout=120).id, state)


@pytest.mark.slow
def test_cluster_tf_arguments_are_enough_the_coordinator_is_found(chief: Chief, url: str) -> None:
    """TF's manager needs no coordinator; ours finds the one the variables' strategy registered, and drains it."""
    model, opt, ckpt = fresh_model(chief, "fixed2", "sgd")
    trainer = Trainer(chief.strategies["fixed2"], chief.coordinator, model, opt)
    with CheckpointManager(ckpt, url, max_to_keep=3) as m:
        assert isinstance(m, tf.train.CheckpointManager)
        trainer.train(20, join=False)
        handle = m.save()  # drained first: the checkpoint holds all 20 steps
        assert handle is not None
        assert m.coordinator is chief.coordinator
        info = handle.result(timeout=120)
        assert info.step == int(ckpt.save_counter.numpy()) == 1, "numbered by save_counter, as TF's manager"
        assert int(m.store.load(info.id)["model/step" + SUFFIX]) == int(model.step.numpy()) >= 20


@pytest.mark.slow
@pytest.mark.parametrize(("family", "optimizer"), [("tf_keras_legacy", "adagrad"), ("tf_keras", "adam")])
def test_cluster_slots_created_after_the_restore_get_their_saved_values(
    chief: Chief, url: str, family: str, optimizer: str
) -> None:
    """TF's tutorial restores before its optimizer exists: the slots get their saved values when created."""
    strategy = chief.strategies["min"]
    with strategy.scope():
        model = RecModel(CONFIG)
        opt = make_optimizer(optimizer, family)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    with CheckpointManager(ckpt, url) as m:
        Trainer(strategy, chief.coordinators["min"], model, opt).train(8, join=False)
        m.save()
        saved = snapshot(ckpt)
    assert any(".OPTIMIZER_SLOT" in n or "optimizer/_variables" in n for n in saved), sorted(saved)

    with strategy.scope():
        model2 = RecModel(ModelConfig(**{**CONFIG.__dict__, "seed": CONFIG.seed + 1}))
        opt2 = make_optimizer(optimizer, family)  # not built: no slots, no iterations yet
    ckpt2 = tf.train.Checkpoint(model=model2, optimizer=opt2)
    with CheckpointManager(ckpt2, url) as m2:
        status = ckpt2.restore(m2.latest_checkpoint)  # the tutorial's line
        status.assert_existing_objects_matched()
        with pytest.raises(AssertionError):
            status.assert_consumed()  # as TF's: values wait for their variables
        Trainer(strategy, chief.coordinators["min"], model2, opt2)  # builds the optimizer: the slots appear
        status.assert_consumed()
        got = snapshot(ckpt2)
        assert sorted(got) == sorted(saved)
        bad = [n for n in saved if not bitwise_equal(saved[n], got[n])]
        assert not bad, bad


@pytest.mark.slow
def test_cluster_restore_under_another_partitioning(chief: Chief, url: str) -> None:
    model, opt, ckpt = fresh_model(chief, "fixed2", "adam")
    Trainer(chief.strategies["fixed2"], chief.coordinator, model, opt).train(10)
    with CheckpointManager(ckpt, url, options=ManagerOptions(coordinator=chief.coordinator)) as m:
        m.save(10).result(timeout=120)
        want = snapshot(ckpt)
    for partitioning in ("fixed3", "min", "none"):
        model2, _, ckpt2 = fresh_model(chief, partitioning, "adam")
        with CheckpointManager(ckpt2, url, options=ManagerOptions(coordinator=chief.coordinators[partitioning])) as m2:
            assert m2.restore_or_initialize() is not None
            got = snapshot(ckpt2)
        assert all(bitwise_equal(want[n], got[n]) for n in want), partitioning
        del model2


@pytest.mark.slow
def test_cluster_async_save_overlapping_training_keeps_its_step(chief: Chief, url: str) -> None:
    model, opt, ckpt = fresh_model(chief, "fixed2", "adagrad")
    trainer = Trainer(chief.strategies["fixed2"], chief.coordinator, model, opt)
    trainer.train(5)
    gate = threading.Event()
    store = Store(GatedBackend(open_backend(url), gate))
    try:
        with CheckpointManager(
            ckpt, url, options=ManagerOptions(coordinator=chief.coordinator, store=store), policy=ASYNC
        ) as m:
            h = m.save(5)
            at_save = snapshot(ckpt)
            trainer.train(20)  # training goes on while the save is being written
            assert not h.done()
            gate.set()
            assert_restores(store, h.result(timeout=120).id, at_save)
            assert int(model.step.numpy()) >= 25
    finally:
        store.close()


EXIT_SCRIPT = """
import sys, time
import tensorflow as tf
from psguard.policy import LagBound, Schedule
from psguard.trainer.manager import CheckpointManager

v = tf.Variable(tf.reshape(tf.range(8000, dtype=tf.float32), [1000, 8]))
# durable_lag report: the save returns at the capture, so the write is still running when the script ends
report = Schedule(durable_lag=LagBound(on_exceed="report"))
manager = CheckpointManager(tf.train.Checkpoint(v=v), sys.argv[1], policy=report)
put = manager.store.backend.put

def slow_put(*args, **kwargs):  # a slow store: the write is still running when the script ends
    time.sleep(0.5)
    return put(*args, **kwargs)

manager.store.backend.put = slow_put
manager.save()
print("save returned", flush=True)
# no manager.close(): scripts written for tf.train.CheckpointManager (durable on return) end like this
"""


@pytest.mark.slow
def test_a_script_that_never_closes_the_manager_does_not_lose_its_last_save(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(EXIT_SCRIPT)
    root = ROOT
    env = {**os.environ, "PYTHONPATH": str(root), "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "save returned" in out.stdout and "waiting up to" in out.stderr, out.stderr[-3000:]
    with Store.open(str(tmp_path / "store")) as store:
        [info] = store.checkpoints()
        assert store.verify(info.id).ok
        got = store.load(info.id)
    v = next(a for name, a in got.items() if name.startswith("v/"))
    assert np.array_equal(v, np.arange(8000, dtype=np.float32).reshape(1000, 8))


@pytest.mark.slow
def test_cluster_a_fresh_jobs_first_save_finds_its_capture_traced_and_counts_what_it_waited(
    chief: Chief, url: str
) -> None:
    """A fresh job's first save traced the capture function while training waited (2-2.6 s for this model,
    against TF's 0.3 s first save) and left that out of ``stall_seconds``. ``restore_or_initialize`` finding
    nothing warms it in the background, as a restore does; whatever a save still waits for is in its stall."""
    from psguard.trainer.capture_graph import join_warming

    model, opt, ckpt = fresh_model(chief, "fixed2", "adagrad")
    trainer = Trainer(chief.strategies["fixed2"], chief.coordinator, model, opt)
    with CheckpointManager(
        ckpt, url, options=ManagerOptions(coordinator=chief.coordinator), step_counter=model.step
    ) as m:
        assert m.restore_or_initialize() is None
        capture = m.capturer._functions.capture
        trainer.train(5, join=False)
        join_warming(120)
        assert capture.experimental_get_tracing_count() == 1  # traced off the step loop, before any save
        handle = m.save()  # drains the coordinator first
        state = snapshot(ckpt)
        assert capture.experimental_get_tracing_count() == 1  # the save traced nothing more
        assert m.last_stall_seconds == handle.stall_seconds > 0
        assert_restores(m.store, handle.result(timeout=120).id, state)
