"""``psguard.keras.SidecarEvaluator``: tf_keras' SidecarEvaluator on a psguard store, followed by deltas.

The reference is TF's own: one tf_keras training saves each checkpoint twice, through psguard to a store and
through ``tf.train.CheckpointManager`` to a folder (``checkpoint_number`` = the step), and TF's
``SidecarEvaluator`` on the folder runs beside the drop-in on the store, each with a ``TensorBoard`` callback.
Both must evaluate every checkpoint to the same metrics and write the same summaries. No cluster.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf
import tf_keras

import psguard.keras
from psguard.trainer.evaluator import SidecarEvaluator
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.options import ManagerOptions
from tests.support.evaluators import SAVES, STEPS_PER_SAVE, Seen, build, data, in_thread, next_evaluation, summaries


@pytest.mark.slow
def test_it_evaluates_every_checkpoint_as_tfs_sidecar_evaluator_does_on_tfs_own_checkpoints(tmp_path: Path) -> None:
    trainer = build(0, trainer=True)
    root = tf.train.Checkpoint(model=trainer, optimizer=trainer.optimizer)
    tf_manager = tf.train.CheckpointManager(root, str(tmp_path / "tf"), max_to_keep=None)
    last = SAVES * STEPS_PER_SAVE
    seen_tf, seen_ps = Seen(), Seen()
    step = 0
    tf_evaluator = tf_keras.utils.SidecarEvaluator(
        build(1, trainer=False),
        data(),
        str(tmp_path / "tf"),
        max_evaluations=last,
        callbacks=[tf_keras.callbacks.TensorBoard(str(tmp_path / "logs-tf")), seen_tf],
    )
    evaluator = psguard.keras.SidecarEvaluator(
        build(2, trainer=False),
        data(),
        str(tmp_path / "store"),
        max_evaluations=last,
        callbacks=[tf_keras.callbacks.TensorBoard(str(tmp_path / "logs-psguard")), seen_ps],
        poll_interval=0.05,
    )
    threads = [in_thread(tf_evaluator.start, seen_tf), in_thread(evaluator.start, seen_ps)]
    with CheckpointManager(root, str(tmp_path / "store"), options=ManagerOptions(new_base_after=0)) as manager:
        try:
            for _ in range(SAVES):
                trainer.fit(data().repeat(), steps_per_epoch=STEPS_PER_SAVE, epochs=1, verbose=0)
                step = int(trainer.optimizer.iterations.numpy())
                manager.save(step).result(timeout=60)
                tf_manager.save(checkpoint_number=step)
                want = {k: float(v) for k, v in trainer.evaluate(data(), return_dict=True, verbose=0).items()}
                assert next_evaluation(seen_tf) == (step, want)  # TF's, on its own checkpoint
                assert next_evaluation(seen_ps) == (step, want), f"step {step}: the drop-in evaluated otherwise"
        finally:
            if any(t.is_alive() for t in threads) and step < last:  # failed early: a last checkpoint stops both
                manager.save(last).result(timeout=60)
                tf_manager.save(checkpoint_number=last)
            for thread in threads:
                thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "an evaluator did not stop after max_evaluations"
    assert seen_tf.evaluations.empty() and seen_ps.evaluations.empty()
    written = summaries(tmp_path / "logs-psguard")
    assert written == summaries(tmp_path / "logs-tf")
    assert {tag for tag, _, _ in written} >= {"evaluation_loss_vs_iterations", "evaluation_auc_vs_iterations"}
    assert [step for tag, step, _ in written if tag == "evaluation_loss_vs_iterations"] == [2, 4, 6]
    assert evaluator.follower is not None
    stats = evaluator.follower.stats
    assert stats.applied == SAVES and stats.full_loads == 1  # the later checkpoints by their deltas


@pytest.mark.slow
def test_a_store_of_the_model_itself_is_restored_as_tf_loads_its_weights(tmp_path: Path) -> None:
    """A checkpoint without ``model`` (the model as the root, as ``ModelCheckpoint(save_weights_only=True)``
    writes): TF then restores with ``model.load_weights``; a legacy optimizer's iterations come with it."""
    trainer = build(0, trainer=True, legacy=True)
    trainer.fit(data().repeat(), steps_per_epoch=3, epochs=1, verbose=0)
    with CheckpointManager(trainer, str(tmp_path / "store")) as manager:
        manager.save(3).result(timeout=60)
    seen = Seen()
    psguard.keras.SidecarEvaluator(
        build(1, trainer=False, legacy=True), data(), str(tmp_path / "store"), max_evaluations=3, callbacks=[seen]
    ).start()
    want = {k: float(v) for k, v in trainer.evaluate(data(), return_dict=True, verbose=0).items()}
    assert next_evaluation(seen) == (3, want)


def test_a_legacy_optimizer_without_iterations_in_the_checkpoint_is_refused_as_tf_refuses_it(tmp_path: Path) -> None:
    trainer = build(0, trainer=True, legacy=True)
    with CheckpointManager(tf.train.Checkpoint(model=trainer), str(tmp_path / "store")) as manager:
        manager.save(1).result(timeout=60)
    evaluator = SidecarEvaluator(build(1, trainer=False, legacy=True), data(), str(tmp_path / "store"))
    with pytest.raises(RuntimeError, match="Variable `iterations` cannot be loaded from the checkpoint"):
        evaluator.start()
