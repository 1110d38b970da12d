"""psguard: fault-tolerant checkpointing and recovery for TensorFlow parameter-server training.

The public API is small on purpose: the manager and its options, the Keras callback (``psguard.keras``), the
in-process recovery calls, the follower, the store for tools, and the errors a caller catches
(``tests/test_public_api.py`` keeps them in step with the user guide). Importing psguard imports neither
TensorFlow nor either side's machinery: each name loads on first use, and without TensorFlow
``psguard.CheckpointManager`` raises :class:`MissingDependencyError` naming the extra to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psguard.dependencies import import_optional
from psguard.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    CrashLoopError,
    MissingDependencyError,
    NoCheckpointError,
    ObjectExistsError,
    ObjectNotFoundError,
    ParentMissingError,
    PsguardError,
    SaveError,
    StorageError,
    StorageUnavailableError,
    TensorMismatchError,
    UnreadableChunkError,
    UnsupportedFormatError,
)

if TYPE_CHECKING:
    from psguard.handoff.client import restart_ps_servers
    from psguard.store import Store
    from psguard.trainer.follower import Follower
    from psguard.trainer.manager import CheckpointManager, SaveHandle
    from psguard.trainer.options import ManagerOptions
    from psguard.trainer.recovery import exit_for_restart, is_cluster_failure, run_with_recovery

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ConfigError",
    "CorruptCheckpointError",
    "CrashLoopError",
    "Follower",
    "ManagerOptions",
    "MissingDependencyError",
    "NoCheckpointError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "ParentMissingError",
    "PsguardError",
    "SaveError",
    "SaveHandle",
    "StorageError",
    "StorageUnavailableError",
    "Store",
    "TensorMismatchError",
    "UnreadableChunkError",
    "UnsupportedFormatError",
    "exit_for_restart",
    "is_cluster_failure",
    "restart_ps_servers",
    "run_with_recovery",
]

#: Names resolved on first use, and the module each comes from (each loads TensorFlow or the trainer's side,
#: except ``restart_ps_servers``, the trainer's HTTP call to its agent).
_LAZY = {
    "CheckpointManager": "psguard.trainer.manager",
    "SaveHandle": "psguard.trainer.manager",
    "ManagerOptions": "psguard.trainer.options",  # no TensorFlow: options can be built before it loads
    "Follower": "psguard.trainer.follower",
    "run_with_recovery": "psguard.trainer.recovery",
    "exit_for_restart": "psguard.trainer.recovery",
    "is_cluster_failure": "psguard.trainer.recovery",
    "restart_ps_servers": "psguard.handoff.client",
    "Store": "psguard.store",  # numpy and the log's modules: a worker's or PS's agent starts its task first
}

#: Submodules reachable as attributes of ``psguard`` without importing them first (``psguard.keras`` after a
#: plain ``import psguard``), also loaded on first use.
_SUBMODULES = ("keras",)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return import_optional(f"{__name__}.{name}")  # the import binds it as an attribute of this package
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psguard' has no attribute {name!r}")
    value = getattr(import_optional(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})
