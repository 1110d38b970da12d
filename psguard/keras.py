"""Kept for imports of earlier versions: the Keras callback lives in :mod:`psguard.trainer.keras`."""

from psguard.trainer.keras import CheckpointCallback, FitPosition, KerasSupportError

__all__ = ["CheckpointCallback", "FitPosition", "KerasSupportError"]
