"""Big variables created without values while a restore is about to overwrite them (in-process recovery).

A rebuilt model computes every initial value and sends it to the PS (5.9 s of a 13.4 s recovery of the 1 GB bench
job), only for the restore to replace it. During such a rebuild, variables of ``min_bytes`` or more are created
without values; the restore reports every variable it assigned (:func:`note_restored`), and when one was not
(no checkpoint, a variable outside it) :attr:`DeferredInit.complete` is false and the caller builds again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from psguard.trainer.variables import lazy_tf

#: Variables (each shard of a sharded one) smaller than this are initialised as the model says: cheap, and
#: small ones (metrics, counters) are the ones a checkpoint may not cover.
MIN_BYTES = 16 << 20

_lock = threading.Lock()
_active: DeferredInit | None = None


class DeferredInit:
    """The variables created without values during one build, until a restore assigns them."""

    def __init__(self, min_bytes: int = MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self._pending: dict[int, Any] = {}  # id -> variable (kept alive: ids must not be reused meanwhile)
        self.deferred = 0
        self.deferred_bytes = 0

    def creator(self, next_creator: Any, **kwargs: Any) -> Any:
        tf = lazy_tf()
        init: Any = kwargs.get("initial_value")
        shape, dtype = kwargs.get("shape"), kwargs.get("dtype")
        if not callable(init) and hasattr(init, "shape") and hasattr(init, "dtype"):
            shape, dtype = shape if shape is not None else init.shape, dtype or init.dtype
        if init is None or shape is None or dtype is None:
            return next_creator(**kwargs)
        shape, dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
        if not shape.is_fully_defined() or not (dtype.is_floating or dtype.is_integer or dtype.is_bool):
            return next_creator(**kwargs)
        if (nbytes := shape.num_elements() * dtype.size) < self.min_bytes:
            return next_creator(**kwargs)
        # Allocated and never written: the restore's assign replaces the buffer whole.
        kwargs["initial_value"] = lambda: tf.raw_ops.Empty(shape=shape, dtype=dtype, init=False)
        kwargs["dtype"] = dtype
        var = next_creator(**kwargs)
        with _lock:
            self._pending[id(var)] = var
            self.deferred += 1
            self.deferred_bytes += nbytes
        return var

    def restored(self, variables: Iterable[Any]) -> None:
        with _lock:
            for v in variables:
                self._pending.pop(id(v), None)

    def forget(self) -> None:
        """Drop the references to the variables (a build being thrown away must be freed)."""
        with _lock:
            self._pending.clear()

    @property
    def complete(self) -> bool:
        """Whether every variable created without values has been assigned by a restore since."""
        with _lock:
            return not self._pending


@contextlib.contextmanager
def deferred_initial_values(min_bytes: int = MIN_BYTES) -> Iterator[DeferredInit]:
    """Inside: big variables are created without values; restores report what they assigned to the record."""
    global _active
    tf = lazy_tf()
    record = DeferredInit(min_bytes)
    with _lock:
        if _active is not None:
            raise RuntimeError("deferred_initial_values() does not nest")
        _active = record
    try:
        with tf.variable_creator_scope(record.creator):
            yield record
    finally:
        with _lock:
            _active = None


def note_restored(variables: Iterable[Any]) -> None:
    """A restore assigned ``variables`` (the manager calls this; a no-op outside :func:`deferred_initial_values`)."""
    with _lock:
        record = _active
    if record is not None:
        record.restored(variables)
