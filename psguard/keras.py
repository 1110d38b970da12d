"""``psguard.keras``: the public path of psguard's tf_keras pieces, as the user guide teaches them.

``CheckpointCallback`` (a ``model.fit`` job's one added line) with its ``CallbackOptions``, and
``SidecarEvaluator`` (an evaluator pod's one changed line: ``tf.keras.utils.SidecarEvaluator`` on a psguard store)
live on the trainer's side (:mod:`psguard.trainer.keras`, :mod:`psguard.trainer.options`,
:mod:`psguard.trainer.evaluator`); this module only names them here.
"""

from psguard.trainer.evaluator import SidecarEvaluator
from psguard.trainer.keras import CheckpointCallback, FitPosition, KerasSupportError
from psguard.trainer.options import CallbackOptions

__all__ = ["CallbackOptions", "CheckpointCallback", "FitPosition", "KerasSupportError", "SidecarEvaluator"]
