"""``psguard.keras.CheckpointCallback``: the public path of the Keras callback, as the user guide teaches it.

The callback lives on the trainer's side (:mod:`psguard.trainer.keras`); this module only names it here, so that
``import psguard.keras`` is the one line a ``model.fit`` job adds.
"""

from psguard.trainer.keras import CheckpointCallback, FitPosition, KerasSupportError

__all__ = ["CheckpointCallback", "FitPosition", "KerasSupportError"]
