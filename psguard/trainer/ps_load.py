"""The restore's PS-side load: one TensorFlow function, called once, that reads every shard's file on its own PS,
assigns the shards the chief holds, and rebases (:func:`load_function`; :func:`run_load` calls it, mapping the
agents' tier files where it can).

One function rather than a load, eager assigns and a rebase: each function is traced and instantiated on the PS at
its first call in a new generation, and after a PS restart that was 0.08 s of a 0.47 s restore for the rebase alone
at 1 GB (0.007 s once instantiated). It ends with the rebase of :mod:`psguard.trainer.capture_graph`, whose
functions it is kept beside (``Functions.loads``, per plan).
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

__all__ = ["can_map", "load_function", "run_load", "trace_load"]

_LOADS_LOCK = threading.Lock()  # Functions.loads: the loads traced per plan


def trace_load(
    fns: Functions,
    which: tuple[tuple[int, int], ...],
    given: tuple[tuple[int, int], ...],
    variables: Any,
) -> None:
    """Trace :func:`load_function` for shards ``which``, each with its fingerprints, and ``given`` on
    ``variables`` (:meth:`Capturer._trace_load` says why). A failure is left for the restore to report (it
    traces then)."""
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
    with_fps: tuple[bool, ...] | None = None,
    given: tuple[tuple[int, int], ...] = (),
    mapped: tuple[bool, ...] | None = None,
) -> Any:
    """The whole restore of a PS-side snapshot as one function, called with (paths, fingerprint paths, values,
    variables): it reads shards ``which`` ((tensor, shard) indices in ``fns.plan``) from files on their PS,
    assigns shards ``given`` the values the chief passes (the tensors it holds), then rebases every shard not
    read from a file, and returns the gap :meth:`Capturer.rebase` keeps.

    One function rather than a load, eager assigns and a rebase: each function is traced and instantiated on the
    PS at its first call in a new generation, and after a PS restart that was 0.08 s of a 0.47 s restore for the
    rebase alone at 1 GB (0.007 s once instantiated). All or nothing as before: every file is read and of the right
    shape before anything is assigned.

    ``with_fps`` (per shard of ``which``): its agent kept the rows' fingerprints (a bundle of int64, one per
    row), which are loaded into the shard's fingerprint variable instead of hashing every row after the assign.
    The values are exact either way; a wrong fingerprint only makes the next capture send that row again, or,
    equal to the row's next hash by a 2**-64 chance, miss it until the next full capture.

    ``mapped`` (per shard of ``which``): its file is its agent's own tier file, which the PS maps instead of
    reading (:mod:`psguard.handoff.mapped`; the op must be loaded in this process and on the PS).
    """
    plan = fns.plan
    fps_of = with_fps or (False,) * len(which)
    mapped_of = mapped or (False,) * len(which)
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
        values, loaded_fps = self.read(paths, fp_paths)
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

    def read(self, paths: Any, fp_paths: Any) -> tuple[list[Any], list[Any]]:
        """The values of shards ``which`` and the fingerprints kept beside them (None where not), each read on
        its PS."""
        tf = lazy_tf()
        values = []
        loaded_fps: list[Any] = []
        for k, (i, j) in enumerate(self.which):
            t, s = self.plan.tensors[i], self.plan.tensors[i].shards[j]
            with tf.device(s.device):
                # A one-tensor bundle (psguard.handoff.tensor_bundle): RestoreV2 reads the values straight into
                # the tensor and checks their CRC32C and dtype; a tier file is mapped instead, no copy. The reshape
                # checks the size, before any assign.
                if self.mapped_of[k] and self.mapper is not None:
                    value = self.mapper(paths[k], dtype=tf.as_dtype(t.dtype), key=BUNDLE_KEY, verify=False)
                else:
                    (value,) = tf.raw_ops.RestoreV2(
                        prefix=paths[k], tensor_names=[BUNDLE_KEY], shape_and_slices=[""], dtypes=[tf.as_dtype(t.dtype)]
                    )
                values.append(tf.reshape(value, (s.rows, *t.tail)))
                if self.fps_of[k] and t.by_row:
                    (fp,) = tf.raw_ops.RestoreV2(
                        prefix=fp_paths[k], tensor_names=[BUNDLE_KEY], shape_and_slices=[""], dtypes=[tf.int64]
                    )
                    loaded_fps.append(tf.reshape(fp, [s.rows]))
                else:
                    loaded_fps.append(None)
        return values, loaded_fps

    @staticmethod
    def assign_read(t: TensorPlan, s: ShardPlan, v: ShardVars, value: Any, fp: Any) -> Any:
        """Assign a shard read from a file and rebase it: its kept fingerprints, or its rows hashed."""
        tf = lazy_tf()
        var, fp_var, dirty_rows, dirty_whole, live = v
        with tf.device(s.device):
            assigned = var.assign(value, read_value=False)
            # The rebase, hashed from the variable once assigned: the assign is then the value's only reader and
            # takes its buffer instead of copying it (1 GB over 2 PS: 2.1 s against 2.5 s).
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
    """Call :func:`load_function` for ``shards`` ((tensor, shard), file, fingerprints' file or None, its agent's
    own tier file) and ``given`` (their ``values``); returns its gap and how many shards the PS mapped.

    A tier file is mapped when :func:`can_map`. A PS started without the op (a PS psguard did not start, or an
    older psguard's) fails the function's instantiation, before anything ran: the load is made again reading
    every file, and this process maps nothing more.
    """
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
