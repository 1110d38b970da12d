"""Written-row tracking: hooks on variables and optimizers that mark, on the PS, the rows a step wrote.

A capture then hashes only marked rows. The hooks see writes made through a variable object (or a wrapper
around it) and the optimizers' apply; what they cannot see (raw ops on a handle) is caught by the capturer's
safety nets (see :class:`psguard.trainer.capture.Capturer`).
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

from psguard.trainer.variables import Shard, lazy_tf

__all__ = ["DirtyRows", "StepCounter", "apply_hook", "find_optimizers", "write_hook"]

log = logging.getLogger(__name__)

#: Variable methods that write the rows named by their first argument (an ``IndexedSlices``).
_ROW_WRITES = (
    "scatter_add",
    "scatter_sub",
    "scatter_mul",
    "scatter_div",
    "scatter_min",
    "scatter_max",
    "scatter_update",
)
#: Variable methods that write the rows named by ``indices[..., 0]`` of their first argument.
_ND_WRITES = ("scatter_nd_add", "scatter_nd_sub", "scatter_nd_update", "scatter_nd_max", "scatter_nd_min")
#: Variable methods that may write any row: a call marks the whole shard.
_DENSE_WRITES = ("assign", "assign_add", "assign_sub", "batch_scatter_update", "_strided_slice_assign")


class DirtyRows:
    """Which rows of one shard were written since the last capture: a bool per row and a whole-shard flag.

    Both live on the shard's PS, set by the write hooks inside the training step itself, so marking costs
    a small scatter on the PS per sparse write and nothing travels to the chief.
    """

    def __init__(self, shard: Shard) -> None:
        tf = lazy_tf()
        from tensorflow.python.ops import resource_variable_ops

        with tf.init_scope(), tf.device(shard.device):
            self.rows = resource_variable_ops.ResourceVariable(
                tf.zeros([shard.rows], tf.bool), trainable=False, name="psguard_dirty_rows"
            )
            self.whole = resource_variable_ops.ResourceVariable(False, trainable=False, name="psguard_dirty_all")

    def mark_rows(self, indices: Any) -> Any:
        from tensorflow.python.ops import gen_resource_variable_ops

        tf = lazy_tf()
        ids = tf.reshape(tf.cast(indices, tf.int64), [-1])
        # Raw ops on the handles: the marks must not go through (hooked) variable methods themselves.
        return gen_resource_variable_ops.resource_scatter_update(self.rows.handle, ids, tf.ones_like(ids, tf.bool))

    def mark_whole(self) -> Any:
        from tensorflow.python.ops import gen_resource_variable_ops

        return gen_resource_variable_ops.assign_variable_op(self.whole.handle, lazy_tf().constant(True))


class _WriteHook:
    """Installed once per resource variable: its write methods mark every registered :class:`DirtyRows` first.

    Instance attributes shadow the class's methods, so every caller that writes through the variable object
    (or a wrapper that delegates to it: ``ShardedVariable``, the PS strategy's caching and aggregating
    variables, Keras 3 variables, every tf_keras and Keras 3 optimizer) is seen, eagerly and while a
    ``tf.function`` is traced. Marks are made before the write (control dependencies), so a step that dies
    half-way leaves marks for at least the rows it wrote.
    """

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
                for target in list(self.targets):
                    if name in _ROW_WRITES and isinstance(first, tf.IndexedSlices):
                        marks.append(target.mark_rows(first.indices))
                    elif name in _ND_WRITES and first is not None:
                        marks.append(target.mark_rows(tf.convert_to_tensor(first)[..., 0]))
                    else:
                        marks.append(target.mark_whole())
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
    """Wraps an optimizer's apply method: each call increments every registered :class:`StepCounter` first.

    A step traced before the hook (or before the counter's generation) increments ``iterations`` but not the
    counter: the capture sees the two disagree and hashes every row, so such a step can never hide a write.
    """

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


def _apply_method(obj: Any) -> str | None:
    """The method through which ``obj`` (an optimizer) applies updates, if it writes only through variable
    methods and increments ``iterations`` once per call; ``None`` for any other optimizer.

    tf_keras (2.11+) and Keras 3 optimizers qualify. tf_keras legacy ``OptimizerV2`` writes with raw
    training ops on the variables' handles (``ResourceSparseApplyAdagradV2``...), which no hook sees.
    """
    if "LossScale" in type(obj).__name__:
        return None  # skips steps on non-finite gradients: iterations and applies would not move together
    tfk = sys.modules.get("tf_keras.src.optimizers.optimizer")
    if tfk is not None and isinstance(obj, tfk.Optimizer):
        return "apply_gradients"
    k3 = sys.modules.get("keras.src.optimizers.base_optimizer")
    if k3 is not None and isinstance(obj, k3.BaseOptimizer):
        return "apply"
    return None


def find_optimizers(root: Any) -> tuple[list[tuple[Any, str]], bool]:
    """(optimizers that can be hooked, with their apply method), and whether ``root`` holds any other one."""
    from tensorflow.python.checkpoint import graph_view, util

    objects = util.objects_ids_and_slot_variables_and_paths(graph_view.ObjectGraphView(root))[0]
    known: list[tuple[Any, str]] = []
    other = False
    for obj in objects:
        if not (hasattr(obj, "apply_gradients") or hasattr(obj, "apply")) or not hasattr(obj, "iterations"):
            continue
        method = _apply_method(obj)
        if method is None:
            other = True
        else:
            known.append((obj, method))
    return known, other
