"""psguard's error hierarchy.

One root (:class:`PsguardError`) so callers can catch everything psguard raises in one place, and a few
subclasses for the situations a caller reacts to differently: retry later (storage unavailable), fall back
to an older checkpoint (corrupt), start fresh (no checkpoint), fix the input (configuration).
Messages say what happened, where, and what to do.
"""

from __future__ import annotations


class PsguardError(Exception):
    """Root of every error psguard raises on purpose."""


class ConfigError(PsguardError, ValueError):
    """Bad user input: a policy file, a cluster spec, a URL, a CLI argument."""


class MissingDependencyError(PsguardError, ImportError):
    """An optional dependency (TensorFlow, matplotlib, hdfs-native, ...) is not installed; the message names the
    extra (``psguard[cpu]``, ...) that brings it."""


class StorageError(PsguardError):
    """A storage operation failed for a reason that retrying will not fix (permissions, full disk)."""


class StorageUnavailableError(StorageError):
    """Storage did not answer, or kept failing, until the retry deadline ran out."""


class UnreadableChunkError(StorageError):
    """The storage failed to read a chunk of a checkpoint (an I/O error, not bad bytes; ``checkpoint`` and
    ``chunk`` name it). A restore of the latest falls back past that checkpoint as past a corrupt one while the
    storage still answers; ``verify`` and gc stop instead of judging it (the storage may heal)."""

    def __init__(self, message: str, *, checkpoint: str, chunk: str) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.chunk = chunk


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """An object the caller asked for does not exist."""


class ObjectExistsError(StorageError, FileExistsError):
    """A create-only write found the object already there (never overwritten)."""


class CheckpointError(PsguardError):
    """Something is wrong with a particular checkpoint."""

    def __init__(self, message: str, *, checkpoint: str | None = None, chunk: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.chunk = chunk


class CorruptCheckpointError(CheckpointError):
    """A manifest or chunk failed verification (hash, CRC32C, size, JSON) or is missing."""


class UnsupportedFormatError(CheckpointError):
    """A manifest was written by a newer psguard whose format this version cannot read."""


class NoCheckpointError(CheckpointError):
    """No (usable) checkpoint exists where one was asked for."""


class TensorMismatchError(CheckpointError):
    """The checkpoint's tensors do not match the model's names, dtypes or shapes."""


class SaveError(PsguardError):
    """An asynchronous save failed; the cause is chained."""


class ParentMissingError(SaveError):
    """A delta's parent checkpoint is gone (deleted by gc or retention) or was never there.

    Nothing was committed; the caller's next save must be a full base. Writers react to this type, not to
    the wording of a message.
    """


class CrashLoopError(PsguardError):
    """A supervised task kept exiting and the restart limit was reached."""
