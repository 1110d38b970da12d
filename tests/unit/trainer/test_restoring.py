"""The manager's restore side (psguard.trainer.restoring): TF's restore line on the checkpoint object reaches the
manager for its own ids and TF for every other path, and only while the manager is open."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow as tf

from psguard.trainer.manager import CheckpointManager
from psguard.trainer.restoring import RestoreSide


def test_checkpoint_restore_takes_the_managers_ids_and_leaves_other_paths_to_tf(tmp_path: Path) -> None:
    v = tf.Variable(np.array([1.0, 2.0], np.float32))
    ckpt = tf.train.Checkpoint(v=v)
    tf_path = ckpt.write(str(tmp_path / "tf" / "ckpt"))  # a checkpoint of TF's own
    with CheckpointManager(ckpt, str(tmp_path / "store")) as manager:
        assert isinstance(manager, RestoreSide)
        v.assign([7.0, 8.0])
        manager.save(1).result(timeout=60)
        own = manager.latest_checkpoint
        assert own is not None and not own.startswith(str(tmp_path / "tf"))

        v.assign([0.0, 0.0])
        ckpt.restore(tf_path).expect_partial()  # not the manager's: TF reads its own file (no save_counter in it)
        assert v.numpy().tolist() == [1.0, 2.0]

        status = ckpt.restore(own)  # the manager's id: psguard restores it, with TF's status methods
        status.assert_existing_objects_matched()
        assert v.numpy().tolist() == [7.0, 8.0] and status.step == 1
    # closed: the hook is gone, every path is TF's again (and the store's id is no TF checkpoint)
    with pytest.raises((tf.errors.NotFoundError, ValueError)):
        ckpt.restore(own).assert_consumed()
