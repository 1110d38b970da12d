"""The TensorFlow functions a capture and a rebase run: one call each for the whole model.

On each PS the capture hashes the candidate rows, compares them with the stored fingerprints, stores the new ones
and sends only the changed rows to the chief (a spilled shard: to files beside its PS, with the rows' new
fingerprints). Rows are compared by their bytes (``-0.0`` and NaN payloads included), so a restore is
bit-identical; a change is missed only when farmhash64 collides (2**-64 per changed row), until the next full
capture. The functions are traced per :class:`Plan` (the layout), so a new generation of the model reuses them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from psguard.handoff.parts import task_of_device
from psguard.handoff.tensor_bundle import BUNDLE_KEY
from psguard.trainer.variables import lazy_tf

log = logging.getLogger(__name__)

#: Bytes a row id costs on the wire and in a delta; part of the Rows-or-Full decision.
_ID_BYTES = 8


@dataclass(frozen=True)
class ShardPlan:
    device: str
    rows: int


@dataclass(frozen=True)
class TensorPlan:
    by_row: bool
    spill: bool
    marks: bool  # written rows are marked beside each shard (write tracking)
    live: bool  # a slot of a SlotGroup: its shards' live rows are refreshed whenever every row is hashed
    row_bytes: int  # bytes of one row (of the whole tensor when not tracked by row)
    dtype: Any  # numpy dtype
    tail: tuple[int, ...]  # the shape of a row
    shards: tuple[ShardPlan, ...]


@dataclass(frozen=True)
class Plan:
    """What the capture functions are traced from; the variables are their arguments, so a new generation of
    the same model runs the functions already traced and instantiated (2.2 s of a recovery otherwise)."""

    tensors: tuple[TensorPlan, ...]
    counter_device: str | None
    iterations: int
    chunk_bytes: int
    probe_rows: int
    spill_dirs: tuple[tuple[str, str], ...]
    local: str


#: Per shard, the variables the functions work on: (the shard, its fingerprints, dirty rows, dirty-all flag,
#: live rows); the last three are None without write tracking, the last one for all but group slots.
ShardVars = tuple[Any, Any, Any, Any, Any]

#: A load function's shards read from files, whether each has a fingerprints file, the shards assigned from
#: values the chief passes (each a (tensor, shard) index in the plan), and whether each file is mapped.
LoadKey = tuple[tuple[tuple[int, int], ...], tuple[bool, ...], tuple[tuple[int, int], ...], tuple[bool, ...]]


@dataclass
class Functions:
    plan: Plan
    capture: Any
    rebase: Any
    #: The rebase's body, for another function to end with (the PS-side load: one function, one instantiation).
    rebase_body: Callable[[bool, Any], Any]
    #: The PS-side loads traced for this plan (:func:`psguard.trainer.ps_load.load_function`).
    loads: dict[LoadKey, Any] = field(default_factory=dict)


_FUNCTIONS: OrderedDict[Plan, Functions] = OrderedDict()
_FUNCTIONS_LOCK = threading.Lock()
#: Plans kept: a model's layout changes a few times (slots appear after the first step), generations repeat it.
_FUNCTIONS_KEPT = 8


#: A shard hashed in at most this many slices is hashed by one op per slice; more go through a loop.
_UNROLLED_SLICES = 8
#: Slices of one shard hashed at once (``tf.fingerprint`` uses one thread per call).
_PARALLEL_SLICES = 8


def functions_for(plan: Plan) -> Functions:
    with _FUNCTIONS_LOCK:
        fns = _FUNCTIONS.get(plan)
        if fns is None:
            tf, graph = lazy_tf(), _Graph(plan)
            capture, rebase = (tf.function(f, autograph=False) for f in (graph.capture, graph.rebase))
            fns = _FUNCTIONS[plan] = Functions(plan, capture=capture, rebase=rebase, rebase_body=graph.rebase)
            while len(_FUNCTIONS) > _FUNCTIONS_KEPT:
                _FUNCTIONS.popitem(last=False)
        _FUNCTIONS.move_to_end(plan)
        return fns


def nonzero_rows(rows: Any) -> Any:
    """Per row, whether any of its bytes is not 0 (so -0.0 counts: a slot holding it is not at rest)."""
    tf = lazy_tf()
    flat = tf.reshape(rows, [tf.shape(rows)[0], -1])
    if flat.dtype.is_floating:
        flat = tf.bitcast(flat, {2: tf.int16, 4: tf.int32, 8: tf.int64}[flat.dtype.size])
    return tf.reduce_any(tf.not_equal(flat, tf.zeros([], flat.dtype)), axis=1)


def _fingerprints(t: TensorPlan, parts: list[Any]) -> Any:
    """farmhash64 of each row's bytes (of the whole shard when not tracked by row)."""
    tf = lazy_tf()
    if not t.by_row:
        return tf.reshape(tf.bitcast(tf.fingerprint(tf.reshape(parts[0], [1, -1])), tf.int64), [-1])
    hashes = [tf.fingerprint(p) for p in parts]
    joined = hashes[0] if len(hashes) == 1 else tf.concat(hashes, axis=0)
    return tf.reshape(tf.bitcast(joined, tf.int64), [-1])


class _Graph:
    """The ops of a plan's capture and rebase, built while TensorFlow traces them: how a shard is read and
    hashed, which of its rows changed, what is sent to the chief or spilled beside the PS."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.spill_dirs = dict(plan.spill_dirs)

    # ------------------------------------------------------------------------------------------ hashing
    def slice_rows(self, t: TensorPlan) -> int:
        """Rows per slice a shard is read and hashed in (:meth:`read_rows`)."""
        return max(1, self.plan.chunk_bytes // max(t.row_bytes, 1))

    def read_rows(self, t: TensorPlan, s: ShardPlan, var: Any) -> list[Any]:
        """The shard's value, row-tracked ones as gathered slices: a plain read of a sparsely updated variable
        copies the whole shard (5x the hashing), and slices hash in parallel."""
        tf = lazy_tf()
        if not t.by_row:
            return [var.read_value()]
        bounds = [*range(0, s.rows, self.slice_rows(t)), s.rows]
        return [var.sparse_read(tf.range(a, b, dtype=tf.int64)) for a, b in itertools.pairwise(bounds)]

    def all_fingerprints(self, t: TensorPlan, s: ShardPlan, var: Any, *, live: bool = False) -> tuple[Any, Any]:
        """Every row's fingerprint (the whole shard's when not tracked by row) and, with ``live``, each row's
        :func:`nonzero_rows`. Many slices go through a loop: unrolled, the graph grew with the table."""
        tf = lazy_tf()
        step = self.slice_rows(t)
        slices = -(-s.rows // step)
        if not t.by_row or slices <= _UNROLLED_SLICES:
            parts = self.read_rows(t, s, var)
            nonzero = None
            if live:
                found = [nonzero_rows(p) for p in parts]
                nonzero = found[0] if len(found) == 1 else tf.concat(found, axis=0)
            return _fingerprints(t, parts), nonzero

        def body(k: Any, out: Any, nz: Any) -> tuple[Any, Any, Any]:
            with tf.device(s.device):  # a loop body's graph starts without a device
                a = k * step
                rows = var.sparse_read(tf.range(a, tf.minimum(a + step, s.rows), dtype=tf.int64))
                fp = tf.reshape(tf.bitcast(tf.fingerprint(rows), tf.int64), [-1])
                if live:
                    nz = nz.write(tf.cast(k, tf.int32), nonzero_rows(rows))
                return k + 1, out.write(tf.cast(k, tf.int32), fp), nz

        with tf.device(s.device):
            out = tf.TensorArray(tf.int64, size=slices, infer_shape=False, element_shape=tf.TensorShape([None]))
            nz = tf.TensorArray(tf.bool, size=slices if live else 0, infer_shape=False, element_shape=[None])
            _, out, nz = tf.while_loop(
                lambda k, *_: k < slices,
                body,
                (tf.constant(0, tf.int64), out, nz),
                parallel_iterations=_PARALLEL_SLICES,
            )
            return out.concat(), (nz.concat() if live else None)

    # ------------------------------------------------------------------------------------ changed rows
    def changed_all_rows(self, t: TensorPlan, s: ShardPlan, v: ShardVars) -> tuple[Any, Any]:
        """Ids of the rows whose bytes changed and their new fingerprints, hashing every row; stores the new
        fingerprints (and for a group slot its live rows: the rows non-zero now)."""
        tf = lazy_tf()
        var, fp_var, live = v[0], v[1], v[4]
        with tf.device(s.device):  # also inside a tf.cond branch, whose graph starts without a device
            fp, nonzero = self.all_fingerprints(t, s, var, live=t.live)
            changed = tf.not_equal(fp, fp_var.read_value())
            with tf.control_dependencies([changed]):
                fp_var.assign(fp)
                if t.live:
                    live.assign(nonzero)
            ids = tf.where(changed)[:, 0]
            return ids, tf.gather(fp, ids)

    def changed_marked_rows(self, t: TensorPlan, s: ShardPlan, v: ShardVars) -> tuple[Any, Any]:
        """The same, hashing only the rows marked as written (their fingerprints alone are updated)."""
        tf = lazy_tf()
        var, fp_var, dirty_rows = v[0], v[1], v[2]
        with tf.device(s.device):
            marked = tf.where(dirty_rows.read_value())[:, 0]
            fp = _fingerprints(t, [var.sparse_read(marked)])
            changed = tf.not_equal(fp, fp_var.sparse_read(marked))
            with tf.control_dependencies([changed]):
                fp_var.scatter_update(tf.IndexedSlices(fp, marked))
            return tf.boolean_mask(marked, changed), tf.boolean_mask(fp, changed)

    def gap_now(self, counter: Any, iterations: tuple[Any, ...]) -> Any:
        """sum(iterations) - hooked applies: unchanged since the last capture iff every apply was hooked."""
        tf = lazy_tf()
        if self.plan.counter_device is None:
            return tf.constant(0, tf.int64)
        with tf.device(self.plan.counter_device):
            total = tf.add_n([tf.cast(it.read_value(), tf.int64) for it in iterations])
            return total - counter.read_value()

    def changed_ids(self, t: TensorPlan, s: ShardPlan, v: ShardVars, hash_all: Any) -> Any:
        """(changed ids, their new fingerprints, whether every row was hashed, whether stray writes were seen)."""
        tf = lazy_tf()
        if not t.marks:
            return (*self.changed_all_rows(t, s, v), tf.constant(True), tf.constant(False))
        dirty_rows, dirty_whole = v[2], v[3]
        # Probed only when the marks are current and no write marked the whole shard.
        whole = dirty_whole.read_value()
        unmarked = tf.logical_not(tf.logical_or(hash_all, whole))
        stray = tf.constant(False)
        if self.plan.probe_rows:  # some of probe_rows random rows changed unmarked: a writer the hooks miss
            sample = tf.random.uniform([self.plan.probe_rows], maxval=s.rows, dtype=tf.int64)
            moved = tf.not_equal(_fingerprints(t, [v[0].sparse_read(sample)]), v[1].sparse_read(sample))
            stray = tf.reduce_any(tf.logical_and(moved, tf.logical_not(dirty_rows.sparse_read(sample))))
        stray = tf.logical_and(stray, unmarked)
        use_all = tf.logical_or(tf.logical_or(hash_all, whole), stray)
        ids, fps = tf.cond(use_all, lambda: self.changed_all_rows(t, s, v), lambda: self.changed_marked_rows(t, s, v))
        with tf.control_dependencies([ids]):
            dirty_rows.assign(tf.zeros([s.rows], tf.bool))
            dirty_whole.assign(False)
        return ids, fps, use_all, stray

    # ----------------------------------------------------------------------------------------- capture
    def capture(self, dry: Any, force: Any, verify: Any, expected_gap: Any, folder: Any, variables: Any) -> Any:
        return self.unless_dry(dry, lambda: self.capture_body(force, verify, expected_gap, folder, variables))

    def capture_body(self, force: Any, verify: Any, expected_gap: Any, folder: Any, variables: Any) -> Any:
        tf = lazy_tf()
        local = self.plan.local
        shard_vars, counter, iterations = variables
        gap = self.gap_now(counter, iterations)
        # Every row is hashed when asked, or when some apply went unhooked since the last capture.
        hash_all = tf.logical_or(verify, tf.not_equal(gap, expected_gap))
        results, hashed_all, strays = [], [], []
        for i, (t, vs) in enumerate(zip(self.plan.tensors, shard_vars, strict=True)):
            outs: list[tuple[Any, ...]] = []
            all_flags, stray_flags = [], []
            for j, (s, v) in enumerate(zip(t.shards, vs, strict=True)):
                # Everything for one shard happens on its PS and depends on nothing from other devices
                # but the flags, so all PS work in parallel and the chief waits for one call.
                if t.by_row:
                    out, used_all, stray = self.capture_rows(t, s, v, (force, i), hash_all, (folder, f"{i}-{j}"))
                    all_flags.append(used_all)
                    stray_flags.append(stray)
                else:
                    out = self.capture_whole(t, s, v, (force, i))
                outs.append(out)
            results.append(outs)
            with tf.device(local):
                hashed_all.append(tf.reduce_any(tf.stack(all_flags)) if all_flags else tf.constant(False))
                strays.append(tf.reduce_any(tf.stack(stray_flags)) if stray_flags else tf.constant(False))
        with tf.device(local):
            gap = tf.identity(gap)
        return results, hashed_all, strays, gap

    def capture_rows(
        self, t: TensorPlan, s: ShardPlan, v: ShardVars, force: tuple[Any, int], hash_all: Any, spill: tuple[Any, str]
    ) -> tuple[tuple[Any, ...], Any, Any]:
        """A row-tracked shard's changed rows, or all of it when that is smaller or forced (``force``: the flags
        and this tensor's index); a spilled shard's go to files (``spill``: folder, stem), only counts to the
        chief. Returns the outputs, whether every row was hashed, whether stray writes were seen."""
        tf = lazy_tf()
        var, fp_var = v[0], v[1]
        flags, i = force
        with tf.device(s.device):
            changed, changed_fps, used_all, stray = self.changed_ids(t, s, v, tf.logical_or(flags[i], hash_all))
            count = tf.size(changed, out_type=tf.int64)
            send_all = tf.logical_or(flags[i], count * (t.row_bytes + _ID_BYTES) >= s.rows * t.row_bytes)
            ids = changed[: tf.where(send_all, tf.constant(0, tf.int64), count)]
            rows = var.sparse_read(ids)
            # A computed length rather than tf.cond: nothing the size of the shard is read unless it is sent.
            every = tf.range(tf.where(send_all, tf.constant(s.rows, tf.int64), tf.constant(0, tf.int64)))
            whole = var.sparse_read(every)
            if t.spill:
                # The new fingerprints of what is sent, which the agent keeps for a restore to load.
                fps = tf.concat([fp_var.sparse_read(every), changed_fps[: tf.size(ids, out_type=tf.int64)]], axis=0)
                self.spill(s, *spill, {"full": whole, "ids": ids, "rows": rows, "fps": fps})
                with tf.device(self.plan.local):
                    return (tf.identity(send_all), tf.identity(tf.size(ids, out_type=tf.int64))), used_all, stray
            whole = tf.reshape(whole, [-1])
        with tf.device(self.plan.local):
            # Outputs land on the chief inside the call, not as remote handles fetched afterwards (2-3x faster).
            out = (tf.identity(send_all), tf.identity(whole), tf.identity(ids), tf.identity(rows))
            return out, used_all, stray

    def capture_whole(self, t: TensorPlan, s: ShardPlan, v: ShardVars, force: tuple[Any, int]) -> tuple[Any, ...]:
        """A shard not tracked by row: sent whole when its one fingerprint changed or when forced."""
        tf = lazy_tf()
        var, fp_var = v[0], v[1]
        flags, i = force
        with tf.device(s.device):
            parts = self.read_rows(t, s, var)
            fp = _fingerprints(t, parts)
            changed = tf.not_equal(fp, fp_var.read_value())
            fp_var.assign(fp)
            send_all = tf.logical_or(flags[i], changed[0])
            flat = tf.reshape(parts[0], [-1])
            whole = flat[: tf.where(send_all, tf.shape(flat, out_type=tf.int64)[0], tf.constant(0, tf.int64))]
        with tf.device(self.plan.local):
            return (tf.identity(send_all), tf.identity(whole))

    def spill(self, s: ShardPlan, folder: Any, stem: str, tensors: dict[str, Any]) -> None:
        """Write a shard's capture next to its PS: the whole shard as a one-tensor bundle (``SaveV2`` writes its
        bytes once; the agent reads it without TensorFlow), the rest as small tensor files."""
        tf = lazy_tf()
        base = self.spill_dirs[task_of_device(s.device) or ""]
        with tf.device(s.device):
            written = [
                tf.io.write_file(tf.strings.join([base, "/", folder, f"/{stem}.{ext}"]), tf.io.serialize_tensor(value))
                for ext, value in tensors.items()
                if ext != "full"
            ]
            # After a write_file: it creates the capture's folder, SaveV2 does not.
            with tf.control_dependencies(written):
                path = tf.strings.join([base, "/", folder, f"/{stem}.full"])
                tf.raw_ops.SaveV2(
                    prefix=path, tensor_names=[BUNDLE_KEY], shape_and_slices=[""], tensors=[tensors["full"]]
                )

    def unless_dry(self, dry: Any, body: Callable[[], Any]) -> Any:
        """``body()``'s outputs, or with ``dry`` empty ones of the same structure, nothing read or written: a dry call
        instantiates the whole function on the PS (a first call's cost) without running it."""
        tf = lazy_tf()
        traced: list[Any] = []

        def live() -> Any:
            out = body()
            traced.append(out)
            return out

        def idle() -> Any:
            if not traced:  # tf.cond traces its true branch first; without it the structure is unknown
                raise AssertionError("the live branch was not traced before the dry one")
            with tf.device(self.plan.local):
                return tf.nest.map_structure(
                    lambda t: tf.zeros([0] * (t.shape.rank if t.shape.rank is not None else 1), t.dtype), traced[0]
                )

        return tf.cond(tf.logical_not(dry), live, idle)

    # ------------------------------------------------------------------------------------------ rebase
    def rebase(self, spilled_too: bool, variables: Any) -> Any:
        """Every shard's fingerprints (and marks, live rows) made current from its value, after a restore."""
        tf = lazy_tf()
        shard_vars, counter, iterations = variables
        for t, vs in zip(self.plan.tensors, shard_vars, strict=True):
            if t.spill and not spilled_too:
                continue  # restore_parts fingerprinted them from the values it loaded
            for s, v in zip(t.shards, vs, strict=True):
                with tf.device(s.device):
                    fp, nonzero = self.all_fingerprints(t, s, v[0], live=t.live)
                    v[1].assign(fp)
                    if t.marks:
                        v[2].assign(tf.zeros([s.rows], tf.bool))
                        v[3].assign(False)
                    if t.live:
                        v[4].assign(nonzero)
        with tf.device(self.plan.local):
            return tf.identity(self.gap_now(counter, iterations))


def capture_specs(tensors: int) -> tuple[Any, ...]:
    """The capture function's arguments but the variables, for a plan of ``tensors`` tensors."""
    tf = lazy_tf()
    return (
        tf.TensorSpec([], tf.bool),  # dry: instantiate only
        tf.TensorSpec([tensors], tf.bool),  # force, per primary tensor
        tf.TensorSpec([], tf.bool),  # verify
        tf.TensorSpec([], tf.int64),  # expected gap
        tf.TensorSpec([], tf.string),  # spill folder
    )


_WARMING: set[threading.Thread] = set()  # started by warm_functions, not yet joined by join_warming
_WARMING_LOCK = threading.Lock()


def join_warming(timeout: float) -> None:
    """Wait up to ``timeout`` seconds in all for :func:`warm_functions`' threads (the exit hook calls it): one
    still in TensorFlow's C++ code at finalization aborts the process."""
    deadline = time.monotonic() + timeout
    with _WARMING_LOCK:
        threads = list(_WARMING)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning("the capture function's warm-up was still running at exit (a PS unreachable?)")


def warm_functions(fns: Functions, variables: Any) -> threading.Thread:
    """A started thread that instantiates ``fns``' capture by a dry call; a failure is left to the real call."""
    tf = lazy_tf()
    n = len(fns.plan.tensors)

    def warm() -> None:
        try:
            with unoptimized_calls():
                concrete = fns.capture.get_concrete_function(*capture_specs(n), variables)
                off = (tf.zeros([n], tf.bool), tf.constant(False), tf.constant(0, tf.int64), tf.constant(""))
                concrete(tf.constant(True), *off, variables)
        except Exception as e:
            log.debug("warming the capture function up failed: %s", e)
        finally:
            with _WARMING_LOCK:
                _WARMING.discard(threading.current_thread())

    thread = threading.Thread(target=warm, name="psguard-capture-warm", daemon=True)
    with _WARMING_LOCK:
        _WARMING.add(thread)
    thread.start()
    return thread


@contextlib.contextmanager
def unoptimized_calls() -> Iterator[None]:
    """Call psguard's functions without Grappler's optimisations (this thread only): a few reads, hashes and
    writes per shard gain nothing, and optimising again on new PS is on the recovery's path."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    before = ctx.function_call_options
    config = config_pb2.ConfigProto()
    config.ParseFromString(before.config_proto_serialized)
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    ctx.function_call_options = context.FunctionCallOptions(executor_type=before.executor_type, config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = before
