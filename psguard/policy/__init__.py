"""When to save and what to keep: the policy engine, policy files (YAML presets), the simulator, their CLI.

Pure decisions over a context and a clock: nothing here does IO on checkpoints or imports TensorFlow.
"""

from psguard.policy.engine import (
    AnyOf,
    ChainLimit,
    Continuous,
    Cron,
    Decision,
    EveryInterval,
    EverySteps,
    OnPreemption,
    Retention,
    SaveContext,
    SavePolicy,
    Schedule,
    TierState,
    Verdict,
    YoungDaly,
    young_daly_interval,
)
from psguard.policy.lag import LagBound

__all__ = [
    "AnyOf",
    "ChainLimit",
    "Continuous",
    "Cron",
    "Decision",
    "EveryInterval",
    "EverySteps",
    "LagBound",
    "OnPreemption",
    "Retention",
    "SaveContext",
    "SavePolicy",
    "Schedule",
    "TierState",
    "Verdict",
    "YoungDaly",
    "young_daly_interval",
]
