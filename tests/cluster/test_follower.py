"""psguard.Follower: an evaluator's variables follow a job's log, reading only the deltas on the way.

The trainer here is a CheckpointManager over local variables (no cluster); the follower is a fresh model in
this process or in a fresh one (the end-to-end check), partitioned differently.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf
from tensorflow.python.distribute import sharded_variable

from psguard.errors import TensorMismatchError
from psguard.store import Store
from psguard.store.manifest import chunk_key
from psguard.trainer.export import OBJECT_GRAPH_KEY
from psguard.trainer.follower import Follower
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.options import ManagerOptions
from psguard.trainer.variables import bitwise_equal, read_tensors
from tests.support.paths import ROOT

ROWS, DIM = 20_000, 16


def model(parts: tuple[int, ...], *, seed: int = 0, slots: bool = False) -> tf.train.Checkpoint:
    """An embedding of sum(parts) x DIM in ``parts`` shards, a dense layer, a step (and an Adagrad-like slot)."""
    rng = np.random.default_rng(seed)
    rows = sum(parts)
    table = rng.standard_normal((rows, DIM)).astype(np.float32)
    bounds = np.cumsum([0, *parts])

    def sharded(value: np.ndarray, name: str) -> Any:
        return sharded_variable.ShardedVariable(
            [tf.Variable(value[a:b], name=f"{name}/part_{i}") for i, (a, b) in enumerate(itertools.pairwise(bounds))]
        )

    objects: dict[str, Any] = {
        "emb": sharded(table, "emb"),
        "dense": tf.Variable(rng.standard_normal((DIM, 4)).astype(np.float32)),
        "step": tf.Variable(0, dtype=tf.int64),
    }
    if slots:
        objects["optimizer"] = tf.train.Checkpoint(accum=sharded(np.full((rows, DIM), 0.1, np.float32), "accum"))
    return tf.train.Checkpoint(**objects)


def train(ckpt: tf.train.Checkpoint, rng: np.random.Generator, fraction: float = 0.01) -> None:
    """Change about ``fraction`` of the embedding rows (and their slot rows), the dense layer and the step."""
    rows = int(ckpt.emb.shape[0])
    ids = np.unique(rng.integers(0, rows, size=int(rows * fraction)))
    for table in [ckpt.emb] + ([ckpt.optimizer.accum] if hasattr(ckpt, "optimizer") else []):
        offset = 0
        for var in table.variables:
            local = ids[(ids >= offset) & (ids < offset + int(var.shape[0]))] - offset
            if local.size:
                rows = tf.gather(var, local) + 1.0
                var.scatter_update(tf.IndexedSlices(rows, tf.constant(local)))
            offset += int(var.shape[0])
    ckpt.dense.assign_add(tf.ones_like(ckpt.dense))
    ckpt.step.assign_add(1)


def values(ckpt: tf.train.Checkpoint, prefix: str = "") -> dict[str, np.ndarray]:
    return {n: v for n, v in read_tensors(ckpt).items() if n.startswith(prefix) and "save_counter" not in n}


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(bitwise_equal(a[n], b[n]) for n in a)


def test_deltas_are_applied_in_place_and_end_bit_identical(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    trainer = model((10_000, 10_000))
    rng = np.random.default_rng(1)
    with CheckpointManager(trainer, url, options=ManagerOptions(new_base_after=0)) as m:
        m.save(0).result(timeout=60)
        follower_ckpt = model((7_000, 7_000, 6_000), seed=9)  # another partitioning, other initial values
        with Follower(follower_ckpt, url, poll_interval=0.05) as f:
            first = f.poll()
            assert first is not None and first.step == 0 and f.stats.full_loads == 1
            full_read = f.stats.bytes_read
            for step in range(1, 6):
                train(trainer, rng)
                m.save(step).result(timeout=60)
                before = f.stats.bytes_read
                got = f.poll()
                assert got is not None and got.step == step
                per_checkpoint = f.stats.bytes_read - before
                assert per_checkpoint <= full_read / 10, (per_checkpoint, full_read)
                assert same(values(follower_ckpt), values(trainer))
            assert f.poll() is None  # nothing newer
            assert f.stats.applied == 6 and f.stats.full_loads == 1 and f.stats.lag_seconds is not None


def test_it_jumps_several_deltas_at_once_and_reads_whole_when_the_chain_was_compacted(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    trainer = model((10_000, 10_000))
    rng = np.random.default_rng(2)
    with (
        CheckpointManager(trainer, url, options=ManagerOptions(new_base_after=0)) as m,
        Follower(model((ROWS,), seed=3), url) as f,
    ):
        m.save(0).result(timeout=60)
        assert f.poll() is not None
        for step in range(1, 4):
            train(trainer, rng)
            m.save(step).result(timeout=60)
        got = f.poll()  # three deltas in one go, in step order
        assert got is not None and got.step == 3 and f.stats.full_loads == 1
        assert same(values(f._checkpoint), values(trainer))
        m.new_base_after = 1  # the next delta is folded into a new base: the chain the follower holds ends
        train(trainer, rng)
        m.save(4).result(timeout=60)
        train(trainer, rng)
        m.save(5).result(timeout=60)
        m.store.gc(keep_last=1)  # the old chain is gone
        assert f.held is not None and f.held.id not in [c.id for c in m.store.chain(m.latest_checkpoint or "")]
        got = f.poll()
        assert got is not None and got.step == 5 and f.stats.full_loads == 2
        assert same(values(f._checkpoint), values(trainer))


def test_a_corrupt_checkpoint_is_skipped_and_never_half_applied(tmp_path: Path, caplog: Any) -> None:
    url = str(tmp_path / "store")
    trainer = model((10_000, 10_000))
    rng = np.random.default_rng(4)
    with (
        CheckpointManager(trainer, url, options=ManagerOptions(new_base_after=0)) as m,
        Follower(model((ROWS,), seed=5), url) as f,
    ):
        m.save(0).result(timeout=60)
        train(trainer, rng)
        good = m.save(1).result(timeout=60)
        assert f.poll() is not None
        held = values(f._checkpoint)
        train(trainer, rng)
        bad = m.save(2).result(timeout=60)
        store = Store.open(url)
        entry = next(e for n, e in store.manifest(bad.id).tensors.items() if e.encoding == "rows")
        ref = entry.segments[-1].values  # the last rows read: earlier tensors would already be decoded
        data = bytearray(store.backend.get(chunk_key(ref.hash)))
        data[len(data) // 2] ^= 0x10
        store.backend.put(chunk_key(ref.hash), bytes(data))
        store.close()
        caplog.set_level("WARNING", logger="psguard.trainer.follower")
        assert f.poll() is None  # step 2 is corrupt; nothing newer that does not depend on it
        assert f.held is not None and f.held.id == good.id
        assert same(values(f._checkpoint), held)  # untouched
        assert bad.id in caplog.text and f.stats.skipped == 1


def test_serving_without_optimizer_slots_needs_ignore_missing(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    trainer = model((10_000, 10_000), slots=True)
    rng = np.random.default_rng(6)
    with CheckpointManager(trainer, url, options=ManagerOptions(new_base_after=0)) as m:
        m.save(0).result(timeout=60)
        train(trainer, rng)
        m.save(1).result(timeout=60)
    with Follower(model((ROWS,), seed=7), url) as f, pytest.raises(TensorMismatchError, match="ignore_missing"):
        f.poll()
    serving = model((ROWS,), seed=7)
    with Follower(serving, url, ignore_missing=("optimizer",)) as f:
        got = f.poll()
        assert got is not None and got.step == 1
    want = {n: v for n, v in values(trainer).items() if not n.startswith("optimizer")}
    assert same(values(serving), want)


def keras_model(framework: str, seed: int, width: int = 16) -> tuple[Any, Any]:
    """The Keras module and a small functional model, built as a job's trainer and its evaluator both build it."""
    keras = importlib.import_module(framework)
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(width, activation="relu")(inputs)
    return keras, keras.Model(inputs, keras.layers.Dense(1)(hidden))


def fit_step(model: Any, optimizer: Any, x: np.ndarray, y: np.ndarray) -> None:
    """One step of a custom training loop (the trainer's model is never compiled)."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)[:, 0] - y))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))


def same_weights(a: Any, b: Any) -> bool:
    return all(bitwise_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights(), strict=True))


@pytest.mark.parametrize("framework", ["tf_keras", "keras"])
def test_a_compiled_evaluator_restores_what_the_checkpoint_has_and_reports_what_it_left_alone(
    tmp_path: Path, caplog: Any, framework: str
) -> None:
    """``model.compile`` gives the evaluator an optimizer that a custom loop's checkpoint does not hold under the
    model: TF's ``expect_partial`` restores the rest and leaves it alone. (Keras 3 names a functional model's
    kernel ``optimizer/_trainable_variables/0`` in the trainer's checkpoint, the shorter path there: bound
    through the saved object graph, as TF's restore binds it.)"""
    url = str(tmp_path / "store")
    rng = np.random.default_rng(13)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.float32)
    keras, trainer = keras_model(framework, seed=0)
    optimizer = keras.optimizers.Adam(0.01)
    _, evaluator = keras_model(framework, seed=1)
    evaluator.compile(loss="binary_crossentropy", metrics=["accuracy", keras.metrics.AUC()])
    unbuilt = [v.numpy() for v in evaluator.optimizer.variables]
    caplog.set_level("INFO", logger="psguard.trainer.follower")
    want = sorted(f"model/optimizer/{n}/.ATTRIBUTES/VARIABLE_VALUE" for n in ("_iterations", "_learning_rate"))
    with (
        CheckpointManager(
            tf.train.Checkpoint(model=trainer, optimizer=optimizer), url, options=ManagerOptions(new_base_after=0)
        ) as m,
        Follower(tf.train.Checkpoint(model=evaluator), url, ignore_missing=("optimizer",)) as f,
    ):
        for step in range(4):
            fit_step(trainer, optimizer, x, y)
            m.save(step).result(timeout=60)
            caplog.clear()
            got = f.poll()
            assert got is not None and got.step == step
            assert same_weights(evaluator, trainer), f"step {step}: the evaluator's weights are not the trainer's"
            assert f.left_alone == want
            assert f"left 2 tensor(s) of the model alone, not in checkpoint {got.id}" in caplog.text
            assert want[0] in caplog.text
        assert f.stats.applied == 4 and f.stats.full_loads == 1
    assert all(bitwise_equal(v.numpy(), u) for v, u in zip(evaluator.optimizer.variables, unbuilt, strict=True))
    evaluator.evaluate(x, y, verbose=0)  # what the evaluator is for


@pytest.mark.parametrize("framework", ["tf_keras", "keras"])
def test_an_evaluator_whose_layer_has_another_shape_is_refused_and_left_untouched(
    tmp_path: Path, framework: str
) -> None:
    url = str(tmp_path / "store")
    keras, trainer = keras_model(framework, seed=0)
    optimizer = keras.optimizers.Adam(0.01)
    fit_step(trainer, optimizer, np.ones((4, 8), np.float32), np.ones(4, np.float32))
    with CheckpointManager(tf.train.Checkpoint(model=trainer, optimizer=optimizer), url) as m:
        m.save(0).result(timeout=60)
    _, evaluator = keras_model(framework, seed=1, width=32)
    evaluator.compile(loss="binary_crossentropy")
    before = evaluator.get_weights()
    follower = Follower(tf.train.Checkpoint(model=evaluator), url, ignore_missing=("optimizer",))
    with (
        follower as f,
        pytest.raises(TensorMismatchError, match=r"checkpoint has \(8, 16\) float32.*follower has \(8, 32\)"),
    ):
        f.poll()
    assert follower.held is None
    assert all(bitwise_equal(a, b) for a, b in zip(evaluator.get_weights(), before, strict=True))


FOLLOWER = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[3])
from tests.cluster.test_follower import model, values
import psguard

last = int(sys.argv[2])
ckpt = model((300_000, 700_000), seed=11)  # another partitioning than the trainer's
with psguard.Follower(ckpt, sys.argv[1], poll_interval=0.05) as f:
    step = -1
    while step < last:
        before = f.stats.bytes_read
        info = f.poll()
        if info is None:
            continue
        step = info.step
        sha = {n: hashlib.sha256(v.tobytes()).hexdigest() for n, v in values(ckpt).items()}
        print(json.dumps({"step": step, "read": f.stats.bytes_read - before, "sha": sha}), flush=True)
"""


@pytest.mark.slow
def test_a_fresh_process_follows_a_1m_row_table_reading_a_tenth_of_a_full_restore(tmp_path: Path) -> None:
    """The check at the size users asked about: 1,000,000 x 16, a full then deltas of about 1% rows each;
    the follower, in its own process with its own partitioning, applies each as it lands."""
    import hashlib

    url = str(tmp_path / "store")
    trainer = model((500_000, 500_000))
    rng = np.random.default_rng(12)
    script = tmp_path / "follower.py"
    script.write_text(FOLLOWER)
    last = 5
    argv = [sys.executable, str(script), url, str(last), str(ROOT)]
    with CheckpointManager(trainer, url, options=ManagerOptions(new_base_after=0)) as m:
        m.save(0).result(timeout=120)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            seen = []
            for step in range(last + 1):
                assert proc.stdout is not None
                ready, _, _ = select.select([proc.stdout], [], [], 240)
                assert ready, f"the follower applied nothing for step {step}"
                doc = json.loads(proc.stdout.readline())
                assert doc["step"] == step
                want = {n: hashlib.sha256(v.tobytes()).hexdigest() for n, v in values(trainer).items()}
                assert doc["sha"] == want, f"step {step}: the follower's variables differ from the trainer's"
                seen.append(doc["read"])
                if step < last:
                    train(trainer, rng)
                    m.save(step + 1).result(timeout=120)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    full_read, per_delta = seen[0], seen[1:]
    assert full_read >= 64_000_000  # the whole table at least
    assert max(per_delta) <= full_read / 10, (full_read, per_delta)


def test_psguard_follow_prints_each_commit_as_it_lands(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    trainer = model((10_000, 10_000))
    rng = np.random.default_rng(8)
    with CheckpointManager(trainer, url, options=ManagerOptions(new_base_after=0)) as m:
        m.save(0).result(timeout=60)
        argv = [sys.executable, "-m", "psguard.cli", "follow", url, "--json", "--interval", "0.05", "--exit-after", "3"]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = []
            for step in (1, 2):
                ready, _, _ = select.select([proc.stdout], [], [], 60)
                assert ready, "psguard follow printed nothing"
                assert proc.stdout is not None
                lines.append(json.loads(proc.stdout.readline()))
                train(trainer, rng)
                m.save(step).result(timeout=60)
            out, err = proc.communicate(timeout=60)
            lines += [json.loads(line) for line in out.splitlines()]
            assert proc.returncode == 0, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [doc["step"] for doc in lines] == [0, 1, 2]
    assert all(doc["kind"] in ("full", "delta") and doc["id"] for doc in lines)


def test_a_follower_reads_only_the_deltas_of_the_tensors_it_takes(tmp_path: Path) -> None:
    """An evaluator ignoring the optimizer's slots (``ignore_missing``) reads none of their changed rows: with
    an Adagrad-like slot as large as the table, the slot's deltas were half of every delta read."""
    url = str(tmp_path / "store")
    trainer = model((10_000, 10_000), slots=True)
    rng = np.random.default_rng(14)
    with (
        CheckpointManager(trainer, url, options=ManagerOptions(new_base_after=0)) as m,
        Follower(model((ROWS,), seed=15), url, ignore_missing=("optimizer",)) as f,
    ):
        m.save(0).result(timeout=60)
        assert f.poll() is not None
        train(trainer, rng)
        delta = m.save(1).result(timeout=60)
        before = f.stats.bytes_read
        assert f.poll() is not None
        read = f.stats.bytes_read - before
        taken = sum(
            ref.size
            for name, entry in m.store.manifest(delta.id).tensors.items()
            if not name.startswith("optimizer/")
            for ref in entry.refs()
        )
    assert read == taken, (read, taken)
    assert same(values(f._checkpoint), {n: v for n, v in values(trainer).items() if not n.startswith("optimizer")})


def test_the_checkpoints_iterator_yields_each_commit_once_in_step_order(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    trainer = model((10_000, 10_000))
    rng = np.random.default_rng(16)
    with (
        CheckpointManager(trainer, url, options=ManagerOptions(new_base_after=0)) as m,
        Follower(model((ROWS,)), url, poll_interval=0.02) as f,
    ):
        it = f.checkpoints(timeout=0.3)
        m.save(0).result(timeout=60)
        assert next(it).step == 0
        for step in (1, 2, 3):
            train(trainer, rng)
            saved = m.save(step).result(timeout=60)
            got = next(it)
            assert (got.id, got.step) == (saved.id, step)
            assert same(values(f._checkpoint), values(trainer))  # yielded once the variables hold it
        assert list(it) == []  # no commit within the timeout: it ends, nothing yielded again
        assert f.stats.applied == 4


def test_the_checkpoints_iterator_yields_the_newest_of_commits_that_landed_together(tmp_path: Path) -> None:
    """As ``tf.train.checkpoints_iterator``: the newest each time (the deltas on the way applied in step order)."""
    url = str(tmp_path / "store")
    trainer = model((10_000, 10_000))
    rng = np.random.default_rng(17)
    stop = threading.Event()
    with (
        CheckpointManager(trainer, url, options=ManagerOptions(new_base_after=0)) as m,
        Follower(model((ROWS,)), url, poll_interval=0.02) as f,
    ):
        for step in range(3):
            train(trainer, rng)
            m.save(step).result(timeout=60)
        it = f.checkpoints(stop=stop)
        assert next(it).step == 2 and f.stats.full_loads == 1
        train(trainer, rng)
        m.save(3).result(timeout=60)
        train(trainer, rng)
        m.save(4).result(timeout=60)
        assert next(it).step == 4 and f.stats.full_loads == 1
        assert same(values(f._checkpoint), values(trainer))
        stop.set()
        assert list(it) == []


def test_ignore_missing_true_takes_what_the_follower_holds_and_reads_nothing_else(tmp_path: Path) -> None:
    """TF's ``expect_partial()`` both ways (as SidecarEvaluator restores): the checkpoint's slots and dense layer
    without a variable here are neither an error nor read; the follower's own extra variable is left alone."""
    url = str(tmp_path / "store")
    trainer = model((10_000, 10_000), slots=True)
    emb = "emb/.ATTRIBUTES/VARIABLE_VALUE"
    with CheckpointManager(trainer, url, options=ManagerOptions(new_base_after=0)) as m:
        tensors = m.store.manifest(m.save(0).result(timeout=60).id).tensors
        read = (emb, "save_counter/.ATTRIBUTES/VARIABLE_VALUE", OBJECT_GRAPH_KEY)  # both roots have a save counter
        taken = sum(r.size for name in read for r in tensors[name].refs())
    extra = tf.Variable(7.0)
    follower = tf.train.Checkpoint(emb=tf.Variable(tf.zeros((ROWS, DIM))), extra=extra)
    with Follower(follower, url, ignore_missing=True) as f:
        assert f.poll() is not None
        assert f.stats.bytes_read == taken
    assert bitwise_equal(follower.emb.numpy(), values(trainer)[emb])
    assert f.left_alone == ["extra/.ATTRIBUTES/VARIABLE_VALUE"] and float(extra.numpy()) == 7.0
