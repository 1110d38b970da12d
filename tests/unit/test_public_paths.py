"""The old public import paths are the same objects as their new homes (README documents both)."""

from __future__ import annotations


def test_psguard_keras_and_recovery_are_the_trainers_own() -> None:
    import psguard.keras
    import psguard.recovery
    from psguard.trainer import keras, recovery

    assert psguard.keras.CheckpointCallback is keras.CheckpointCallback
    assert psguard.recovery.run_with_recovery is recovery.run_with_recovery
