"""Written-row tracking: hooks on variables and optimizers that mark, on the PS, the rows a step wrote, so a
capture hashes only those. Writes they cannot see (raw ops) are the capturer's safety nets' job."""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from psguard.trainer.variables import Shard, graph_objects, lazy_tf

log = logging.getLogger(__name__)

#: Variable methods that write the rows named by their first argument (an ``IndexedSlices``).
_ROW_WRITES = tuple(f"scatter_{op}" for op in ("add", "sub", "mul", "div", "min", "max", "update"))
#: Variable methods that write the rows named by ``indices[..., 0]`` of their first argument.
_ND_WRITES = tuple(f"scatter_nd_{op}" for op in ("add", "sub", "update", "max", "min"))
#: Variable methods that may write any row: a call marks the whole shard.
_DENSE_WRITES = ("assign", "assign_add", "assign_sub", "batch_scatter_update", "_strided_slice_assign")


@dataclass(frozen=True)
class SlotGroup:
    """A variable's shard and its slots' shards, updated together by one ``update_step`` (``key``) whose dense
    writes change only rows where a slot is non-zero; ``lives``: the slots' :attr:`DirtyRows.live`."""

    key: tuple[int, Any]
    lives: tuple[Any, ...]


class DirtyRows:
    """Which rows of one shard were written since the last capture (a bool per row, a whole-shard flag), on the
    shard's PS, set by the hooks inside the training step.

    A slot of a :class:`SlotGroup` (``slot=True``) also has ``live``: the rows where it may be non-zero (its
    sparse writes add rows, a capture hashing every row resets it, any other write makes it every row), which a
    dense write of its group's update marks instead of the whole shard (:meth:`mark_group`).
    """

    def __init__(self, shard: Shard, *, slot: bool = False) -> None:
        tf = lazy_tf()
        from tensorflow.python.ops import resource_variable_ops

        with tf.init_scope(), tf.device(shard.device):
            self.rows = resource_variable_ops.ResourceVariable(
                tf.zeros([shard.rows], tf.bool), trainable=False, name="psguard_dirty_rows"
            )
            self.whole = resource_variable_ops.ResourceVariable(False, trainable=False, name="psguard_dirty_all")
            # Every row until a capture has looked: the slot may already hold non-zero rows.
            self.live = (
                resource_variable_ops.ResourceVariable(
                    tf.ones([shard.rows], tf.bool), trainable=False, name="psguard_live_rows"
                )
                if slot
                else None
            )
        self.group: SlotGroup | None = None

    def mark_rows(self, indices: Any) -> list[Any]:
        from tensorflow.python.ops import gen_resource_variable_ops

        tf = lazy_tf()
        ids = tf.reshape(tf.cast(indices, tf.int64), [-1])
        # Raw ops on the handles: the marks must not go through (hooked) variable methods themselves.
        targets = [self.rows] if self.live is None else [self.rows, self.live]
        return [
            gen_resource_variable_ops.resource_scatter_update(v.handle, ids, tf.ones_like(ids, tf.bool))
            for v in targets
        ]

    def mark_whole(self) -> list[Any]:
        from tensorflow.python.ops import gen_resource_variable_ops

        tf = lazy_tf()
        marks = [gen_resource_variable_ops.assign_variable_op(self.whole.handle, tf.constant(True))]
        if self.live is not None:
            shape = gen_resource_variable_ops.variable_shape(self.live.handle)
            marks.append(gen_resource_variable_ops.assign_variable_op(self.live.handle, tf.ones(shape, tf.bool)))
        return marks

    def mark_group(self) -> list[Any]:
        """Mark every row where a slot of this shard's group may be non-zero (a dense write of its update)."""
        from tensorflow.python.ops import gen_resource_variable_ops

        tf = lazy_tf()
        assert self.group is not None
        marked = gen_resource_variable_ops.read_variable_op(self.rows.handle, tf.bool)
        for v in self.group.lives:
            marked = tf.logical_or(marked, gen_resource_variable_ops.read_variable_op(v.handle, tf.bool))
        return [gen_resource_variable_ops.assign_variable_op(self.rows.handle, marked)]


#: ``(id(optimizer), var_key)`` of the ``update_step`` calls running in this thread (see :func:`update_hook`).
_updating = threading.local()


@contextmanager
def _in_update(key: tuple[int, Any]) -> Iterator[None]:
    stack: list[tuple[int, Any]] = _updating.__dict__.setdefault("stack", [])
    stack.append(key)
    try:
        yield
    finally:
        stack.pop()


class _WriteHook:
    """Installed once per resource variable: instance attributes shadowing its write methods mark every
    registered :class:`DirtyRows` first (before the write, so a step that dies half-way leaves its marks)."""

    def __init__(self, var: Any) -> None:
        self.targets: weakref.WeakSet[DirtyRows] = weakref.WeakSet()
        for name in (*_ROW_WRITES, *_ND_WRITES, *_DENSE_WRITES):
            original = getattr(var, name, None)
            if original is not None:
                object.__setattr__(var, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            tf = lazy_tf()
            marks: list[Any] = []
            if self.targets:
                first = args[0] if args else next(iter(kwargs.values()), None)
                stack: list[tuple[int, Any]] | None = getattr(_updating, "stack", None)
                update = stack[-1] if stack else None
                for target in list(self.targets):
                    if name in _ROW_WRITES and isinstance(first, tf.IndexedSlices):
                        marks += target.mark_rows(first.indices)
                    elif name in _ND_WRITES and first is not None:
                        marks += target.mark_rows(tf.convert_to_tensor(first)[..., 0])
                    elif update is not None and target.group is not None and target.group.key == update:
                        marks += target.mark_group()
                    else:
                        marks += target.mark_whole()
            with tf.control_dependencies([] if tf.executing_eagerly() else marks):
                return original(*args, **kwargs)

        return hooked


def write_hook(var: Any) -> _WriteHook:
    hook: _WriteHook | None = var.__dict__.get("_psguard_write_hook")
    if hook is None:
        hook = _WriteHook(var)
        object.__setattr__(var, "_psguard_write_hook", hook)
    return hook


class StepCounter:
    """Counts ``apply`` calls of hooked optimizers (one variable per hook generation, beside ``iterations``)."""

    def __init__(self, device: str) -> None:
        tf = lazy_tf()
        from tensorflow.python.ops import resource_variable_ops

        with tf.init_scope(), tf.device(device):
            self.var = resource_variable_ops.ResourceVariable(
                tf.constant(0, tf.int64), trainable=False, name="psguard_applies"
            )

    def increment(self) -> Any:
        from tensorflow.python.ops import gen_resource_variable_ops

        tf = lazy_tf()
        return gen_resource_variable_ops.assign_add_variable_op(self.var.handle, tf.constant(1, tf.int64))


class _ApplyHook:
    """Wraps an optimizer's apply method: each call increments every registered :class:`StepCounter` first (a
    step traced before moves ``iterations`` alone, and the capture then hashes every row)."""

    def __init__(self, optimizer: Any, method: str) -> None:
        self.counters: weakref.WeakSet[StepCounter] = weakref.WeakSet()
        original = getattr(optimizer, method)

        def hooked(*args: Any, **kwargs: Any) -> Any:
            tf = lazy_tf()
            increments = [c.increment() for c in list(self.counters)]
            with tf.control_dependencies([] if tf.executing_eagerly() else increments):
                return original(*args, **kwargs)

        object.__setattr__(optimizer, method, hooked)


def apply_hook(optimizer: Any, method: str) -> _ApplyHook:
    hook: _ApplyHook | None = optimizer.__dict__.get("_psguard_apply_hook")
    if hook is None:
        hook = _ApplyHook(optimizer, method)
        object.__setattr__(optimizer, "_psguard_apply_hook", hook)
    return hook


#: tf_keras optimizers whose ``update_step`` for a sparse gradient writes densely only in ways that leave rows
#: whose slots are all 0 as they were (slots decay, ``0`` stays ``+0``; the step is ``+0`` where ``m`` is), given
#: finite positive hyperparameters (else the probe of unmarked rows catches it). Module, class, slot attributes.
_ZERO_PRESERVING = (
    ("tf_keras.src.optimizers.adam", "Adam", ("_momentums", "_velocities", "_velocity_hats")),
    ("tf_keras.src.optimizers.adamw", "AdamW", ("_momentums", "_velocities", "_velocity_hats")),
    ("tf_keras.src.optimizers.adamax", "Adamax", ("_m", "_u")),
)


def _slot_attrs(optimizer: Any) -> tuple[str, ...] | None:
    """The slot attributes of ``optimizer`` when it is one of :data:`_ZERO_PRESERVING`, with its update unchanged
    (a subclass that overrides ``update_step`` may write anything)."""
    for module, name, attrs in _ZERO_PRESERVING:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(optimizer, cls) and type(optimizer).update_step is cls.update_step:
            return attrs
    return None


def slot_groups(optimizer: Any, variables: list[Any]) -> list[tuple[tuple[int, Any], Any, list[Any]]]:
    """For each of ``variables`` (shard objects) that ``optimizer`` updates as a :data:`_ZERO_PRESERVING` one:
    (the key :func:`update_hook` marks its updates with, the variable, its slot variables)."""
    attrs = _slot_attrs(optimizer)
    if attrs is None:
        return []
    index: dict[Any, int] = getattr(optimizer, "_index_dict", {})
    out: list[tuple[tuple[int, Any], Any, list[Any]]] = []
    for var in variables:
        try:
            key = optimizer._var_key(var)
        except (AttributeError, TypeError):
            continue
        i = index.get(key)
        if i is None:
            continue
        slots = [getattr(optimizer, a)[i] for a in attrs if len(getattr(optimizer, a, ())) > i]
        out.append(((id(optimizer), key), var, slots))
    return out


def update_hook(optimizer: Any) -> bool:
    """Wrap a :data:`_ZERO_PRESERVING` optimizer's ``update_step`` so its writes for a sparse gradient run with
    the update's key current (the hooks then mark the group's live rows); whether ``optimizer`` is hooked."""
    if "_psguard_update_hook" in optimizer.__dict__:
        return True
    if _slot_attrs(optimizer) is None:
        return False
    original = optimizer.update_step
    owner = id(optimizer)

    def hooked(gradient: Any, variable: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(gradient, lazy_tf().IndexedSlices):
            return original(gradient, variable, *args, **kwargs)  # dense: every row may move, marked whole
        with _in_update((owner, original.__self__._var_key(variable))):
            return original(gradient, variable, *args, **kwargs)

    object.__setattr__(optimizer, "update_step", hooked)
    object.__setattr__(optimizer, "_psguard_update_hook", True)
    return True


def find_optimizers(root: Any) -> tuple[list[tuple[Any, str]], bool]:
    """(optimizers that can be hooked, with their apply method), and whether ``root`` holds any other one."""
    known: list[tuple[Any, str]] = []
    other = False
    for obj, _ in graph_objects(root):
        if not (hasattr(obj, "apply_gradients") or hasattr(obj, "apply")) or not hasattr(obj, "iterations"):
            continue
        # The method through which a tf_keras 2.11+ or Keras 3 optimizer applies updates; others (legacy
        # OptimizerV2 writes with raw ops no hook sees; a loss scale skips steps on non-finite gradients, so
        # iterations and applies would not move together) cannot be hooked.
        tfk = sys.modules.get("tf_keras.src.optimizers.optimizer")
        k3 = sys.modules.get("keras.src.optimizers.base_optimizer")
        if "LossScale" in type(obj).__name__:
            other = True
        elif tfk is not None and isinstance(obj, tfk.Optimizer):
            known.append((obj, "apply_gradients"))
        elif k3 is not None and isinstance(obj, k3.BaseOptimizer):
            known.append((obj, "apply"))
        else:
            other = True
    return known, other
