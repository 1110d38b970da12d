"""The restore's PS-side load: one TensorFlow function that reads every shard's file on its own PS, assigns the
shards the chief holds, and rebases (:func:`load_function`; :func:`run_load` calls it). One function, not three:
each is instantiated on the PS at its first call after a restart, on the recovery's path.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from psguard.handoff.mapped import map_op
from psguard.handoff.tensor_bundle import BUNDLE_KEY
from psguard.trainer.capture_graph import (
    Functions,
    Plan,
    ShardPlan,
    ShardVars,
    TensorPlan,
    nonzero_rows,
    unoptimized_calls,
)
from psguard.trainer.variables import lazy_tf

log = logging.getLogger(__name__)

_LOADS_LOCK = threading.Lock()  # Functions.loads: the loads traced per plan


def trace_load(
    fns: Functions, which: tuple[tuple[int, int], ...], given: tuple[tuple[int, int], ...], variables: Any
) -> None:
    """Trace :func:`load_function` for shards ``which``, each with its fingerprints, and ``given``; a failure is
    left for the restore to report."""
    tf = lazy_tf()
    try:
        load = load_function(fns, which, (True,) * len(which), given, (can_map(),) * len(which))
        paths = tf.TensorSpec([len(which)], tf.string)
        shard_vars = variables[0]  # (variable, fingerprints, ...) per (tensor, shard), as load_function reads it
        specs = tuple(tf.TensorSpec(shard_vars[i][j][0].shape, shard_vars[i][j][0].dtype) for i, j in given)
        with unoptimized_calls():
            load.get_concrete_function(paths, paths, specs, variables)
    except Exception as e:
        log.debug("tracing the PS-side load ahead failed: %s", e)


def load_function(
    fns: Functions,
    which: tuple[tuple[int, int], ...],
    fps_of: tuple[bool, ...],
    given: tuple[tuple[int, int], ...],
    mapped_of: tuple[bool, ...],
) -> Any:
    """The whole restore of a PS-side snapshot as one function, called with (paths, fingerprint paths, values,
    variables): reads shards ``which`` ((tensor, shard) indices in ``fns.plan``) from files on their PS (each,
    per ``fps_of``, with its rows' fingerprints kept by its agent, and per ``mapped_of`` mapped from its agent's
    tier file), assigns shards ``given`` the chief's values, rebases the rest and returns the gap. Every file is
    read and checked before anything is assigned.
    """
    plan = fns.plan
    key = (which, fps_of, given, mapped_of)
    with _LOADS_LOCK:
        fn = fns.loads.get(key)
    if fn is not None:
        return fn
    load = _PsLoad(fns, plan, which, fps_of, given, mapped_of, map_op() if any(mapped_of) else None)
    fn = lazy_tf().function(load.load, autograph=False)
    with _LOADS_LOCK:
        return fns.loads.setdefault(key, fn)


@dataclass(frozen=True, eq=False)
class _PsLoad:
    """The ops of one :func:`load_function`: the files read on their PS, then every assign, then the rebase."""

    fns: Functions
    plan: Plan
    which: tuple[tuple[int, int], ...]
    fps_of: tuple[bool, ...]
    given: tuple[tuple[int, int], ...]
    mapped_of: tuple[bool, ...]
    mapper: Any  # the zero-copy map op, when a file is mapped

    def load(self, paths: Any, fp_paths: Any, values_given: Any, variables: Any) -> Any:
        tf = lazy_tf()
        values, loaded_fps = [], []  # of shards ``which``, and the fingerprints kept beside them (None where not)
        for k, (i, j) in enumerate(self.which):
            t, s = self.plan.tensors[i], self.plan.tensors[i].shards[j]
            with tf.device(s.device):  # each read on its PS
                # A one-tensor bundle, CRC32C and dtype checked by RestoreV2 (or mapped); the reshape checks the size.
                if self.mapped_of[k] and self.mapper is not None:
                    value = self.mapper(paths[k], dtype=tf.as_dtype(t.dtype), key=BUNDLE_KEY, verify=False)
                else:
                    (value,) = tf.raw_ops.RestoreV2(
                        prefix=paths[k], tensor_names=[BUNDLE_KEY], shape_and_slices=[""], dtypes=[tf.as_dtype(t.dtype)]
                    )
                values.append(tf.reshape(value, (s.rows, *t.tail)))
                fp = None
                if self.fps_of[k] and t.by_row:
                    (fp,) = tf.raw_ops.RestoreV2(
                        prefix=fp_paths[k], tensor_names=[BUNDLE_KEY], shape_and_slices=[""], dtypes=[tf.int64]
                    )
                    fp = tf.reshape(fp, [s.rows])
                loaded_fps.append(fp)
        # Every file parsed and of the right shape before the first assign: all or nothing.
        assigns = []
        shard_vars = variables[0]
        with tf.control_dependencies(values + [f for f in loaded_fps if f is not None]):
            for value, fp, (i, j) in zip(values, loaded_fps, self.which, strict=True):
                assigns.append(
                    self.assign_read(self.plan.tensors[i], self.plan.tensors[i].shards[j], shard_vars[i][j], value, fp)
                )
            for value, (i, j) in zip(values_given, self.given, strict=True):
                with tf.device(self.plan.tensors[i].shards[j].device):
                    assigns.append(shard_vars[i][j][0].assign(value, read_value=False))
        # The shards not read from a file, hashed once their values are in (the files' were just above).
        with tf.control_dependencies(assigns):
            return self.fns.rebase_body(False, variables)

    @staticmethod
    def assign_read(t: TensorPlan, s: ShardPlan, v: ShardVars, value: Any, fp: Any) -> Any:
        """Assign a shard read from a file and rebase it: its kept fingerprints, or its rows hashed."""
        tf = lazy_tf()
        var, fp_var, dirty_rows, dirty_whole, live = v
        with tf.device(s.device):
            assigned = var.assign(value, read_value=False)
            # Hashed from the variable once assigned, so the assign takes the value's buffer instead of copying it.
            with tf.control_dependencies([assigned]):
                if fp is not None:
                    done = fp_var.assign(fp, read_value=False)
                else:
                    now = var.read_value()
                    done = fp_var.assign(tf.reshape(tf.bitcast(tf.fingerprint(now), tf.int64), [-1]), read_value=False)
                if t.marks:
                    dirty_rows.assign(tf.zeros([s.rows], tf.bool))
                    dirty_whole.assign(False)
                if t.live:
                    live.assign(nonzero_rows(var.read_value() if fp is not None else now))
            return done


_PS_WITHOUT_MAP_OP: list[bool] = []  # set once a PS lacked the op: this process maps nothing more


def can_map() -> bool:
    """Whether a load may map tier files: the op loads here and no PS was found without it."""
    return not _PS_WITHOUT_MAP_OP and map_op() is not None


def run_load(
    fns: Functions,
    shards: list[tuple[tuple[int, int], str, str | None, bool]],
    given: tuple[tuple[int, int], ...],
    values: tuple[Any, ...],
    variables: Any,
) -> tuple[Any, int]:
    """Call :func:`load_function` for ``shards`` ((tensor, shard), file, fingerprints' file or None, mappable)
    and ``given`` (their ``values``); returns its gap and how many shards the PS mapped. A PS without the map op
    fails before anything ran: the load is made again reading every file, and nothing more is mapped."""
    tf = lazy_tf()
    which = tuple(ij for ij, _, _, _ in shards)
    paths = tf.constant([p for _, p, _, _ in shards], dtype=tf.string)
    fp_paths = tf.constant([f or "" for _, _, f, _ in shards], dtype=tf.string)
    with_fps = tuple(f is not None for _, _, f, _ in shards)
    mapped = tuple(m and can_map() for _, _, _, m in shards)
    try:
        with unoptimized_calls():
            gap = load_function(fns, which, with_fps, given, mapped)(paths, fp_paths, values, variables)
    except tf.errors.OpError as e:
        if not any(mapped) or "PsguardMapBundle" not in str(e) or "registered" not in str(e):
            raise
        log.warning("event=map_op_missing_on_ps: a PS has no zero-copy restore op (%s); reading the files", e.message)
        _PS_WITHOUT_MAP_OP.append(True)
        mapped = (False,) * len(which)
        with unoptimized_calls():
            gap = load_function(fns, which, with_fps, given, mapped)(paths, fp_paths, values, variables)
    log.info("event=ps_load shards=%d mapped=%d", len(which), sum(mapped))
    return gap, sum(mapped)
