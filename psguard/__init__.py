"""psguard: fault-tolerant checkpointing and recovery for TensorFlow parameter-server training.

The public API is small on purpose: the manager users switch to, the store for tools, and the errors.
Importing psguard imports neither TensorFlow nor either side's machinery: the manager (and through it the
trainer's side) loads on first use of ``psguard.CheckpointManager``, so an agent that imports
``psguard.agent`` never loads the trainer's modules. TensorFlow is an optional dependency (``psguard[cpu]`` or
``psguard[gpu]``): without it, ``psguard.CheckpointManager`` raises :class:`MissingDependencyError` naming them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psguard.dependencies import import_optional
from psguard.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    MissingDependencyError,
    NoCheckpointError,
    PsguardError,
    SaveError,
    StorageUnavailableError,
    TensorMismatchError,
)
from psguard.store import Store

if TYPE_CHECKING:
    from psguard.trainer.follower import Follower
    from psguard.trainer.manager import CheckpointManager, SaveHandle

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ConfigError",
    "CorruptCheckpointError",
    "Follower",
    "MissingDependencyError",
    "NoCheckpointError",
    "PsguardError",
    "SaveError",
    "SaveHandle",
    "StorageUnavailableError",
    "Store",
    "TensorMismatchError",
]

_LAZY = {
    "CheckpointManager": "psguard.trainer.manager",
    "SaveHandle": "psguard.trainer.manager",
    "Follower": "psguard.trainer.follower",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psguard' has no attribute {name!r}")
    value = getattr(import_optional(module), name)
    globals()[name] = value
    return value
