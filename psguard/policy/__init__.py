"""When to save and what to keep: the policy engine, policy files (YAML presets), the simulator, their CLI.

Pure decisions over a context and a clock: nothing here does IO on checkpoints or imports TensorFlow.
"""

from psguard.policy import engine, lag
from psguard.policy.engine import *  # noqa: F403 (its __all__ is the one list of these names)
from psguard.policy.lag import *  # noqa: F403

__all__ = [*engine.__all__, *lag.__all__]
