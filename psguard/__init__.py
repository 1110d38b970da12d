"""psguard: fault-tolerant checkpointing and recovery for TensorFlow parameter-server training.

The public API is small on purpose: the manager users switch to, the store for tools, and the errors.
Importing psguard does not import TensorFlow; the manager does when it is created.
"""

from psguard.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    PsguardError,
    SaveError,
    StorageUnavailableError,
    TensorMismatchError,
)
from psguard.manager import CheckpointManager, SaveHandle
from psguard.store import Store

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ConfigError",
    "CorruptCheckpointError",
    "NoCheckpointError",
    "PsguardError",
    "SaveError",
    "SaveHandle",
    "StorageUnavailableError",
    "Store",
    "TensorMismatchError",
]
