"""What a capture hands to storage: per tensor, the whole value, the changed rows, or nothing new.

These three types are the contract between the trainer-side capture (which finds changed rows on the PS)
and every tier that stores checkpoints (the memory tier applies them, the durable log writes them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Full:
    """The whole logical tensor (all shards concatenated along axis 0 for a sharded variable)."""

    value: np.ndarray


@dataclass(frozen=True)
class Rows:
    """Rows of a tensor (along axis 0) that changed since the parent checkpoint.

    ``ids`` are sorted, unique, int64 row indices; ``values[i]`` is the new content of row ``ids[i]``.
    ``shape`` and ``dtype`` describe the whole logical tensor, which is unchanged outside ``ids``.
    """

    ids: np.ndarray
    values: np.ndarray
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.ids.ndim != 1:
            raise ValueError(f"row ids must be 1-D, got shape {self.ids.shape}")
        if self.values.shape[:1] != self.ids.shape or tuple(self.values.shape[1:]) != tuple(self.shape[1:]):
            raise ValueError(
                f"rows of shape {self.values.shape} do not fit {len(self.ids)} ids of a tensor shaped {self.shape}"
            )

    @property
    def dtype(self) -> np.dtype:  # type: ignore[type-arg]
        return self.values.dtype


@dataclass(frozen=True)
class Same:
    """Unchanged since the parent checkpoint; only the description is kept."""

    shape: tuple[int, ...]
    dtype: np.dtype  # type: ignore[type-arg]


TensorUpdate = Full | Rows | Same


@dataclass(frozen=True)
class FullStream:
    """The whole tensor, like :class:`Full`, but read in row ranges: a memory tier writing a large shard to the
    durable log while training goes on can neither hand over its live array nor copy it whole, so each
    :meth:`read` returns the rows as they were when the stream was made, in a fresh array. Only the durable log's
    writers accept it."""

    shape: tuple[int, ...]
    dtype: np.dtype  # type: ignore[type-arg]
    reader: Callable[[int, int], np.ndarray] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as they were when this stream was made (a copy the caller owns)."""
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows [{start}, {stop}) outside a tensor of {self.shape[0]} rows")
        return self.reader(start, stop)


def apply_update(current: np.ndarray | None, update: TensorUpdate) -> np.ndarray:
    """Return the tensor after ``update``; ``current`` may be modified in place and returned."""
    if isinstance(update, Full):
        return update.value
    if current is None:
        raise ValueError("a row or unchanged update needs the tensor it applies to")
    if isinstance(update, Rows):
        if current.shape != update.shape:
            raise ValueError(f"row update for shape {update.shape} applied to a tensor of shape {current.shape}")
        current[update.ids] = update.values
    return current


def merge_updates(older: TensorUpdate, newer: TensorUpdate) -> TensorUpdate:
    """One update equivalent to applying ``older`` then ``newer``.

    This lets a writer that fell behind (or failed) fold a pending capture into the next one instead of
    queueing both or forcing a full capture: memory stays bounded by one update per tensor.
    """
    if isinstance(newer, Full):
        return newer
    if isinstance(newer, Same):
        return older
    if isinstance(older, Same):
        return newer
    if isinstance(older, Full):
        value = older.value.copy()
        value[newer.ids] = newer.values
        return Full(value)
    if tuple(older.shape) != tuple(newer.shape):
        raise ValueError(f"cannot merge row updates of shapes {older.shape} and {newer.shape}")
    ids = np.union1d(older.ids, newer.ids)
    values = np.empty((len(ids), *older.values.shape[1:]), dtype=newer.values.dtype)
    values[np.searchsorted(ids, older.ids)] = older.values
    values[np.searchsorted(ids, newer.ids)] = newer.values  # newer rows win
    return Rows(ids, values, newer.shape)
