"""Capture the rows that changed since the last capture, finding them on the PS that holds them.

The capture is the only part of a save that stops training, and most of a PS job's state is in large tables of
which few rows change between saves. So beside every large shard, on its device, the capturer keeps one 64-bit
fingerprint per row, and a capture is one ``tf.function`` call (:mod:`psguard.trainer.capture_graph`) that sends
only the rows whose bytes changed. Hashing every row was most of the stall, so write hooks
(:mod:`psguard.trainer.write_tracking`) mark the rows each step writes, and a capture hashes only those; the
safety nets that make it hash every row are in :class:`Capturer`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from psguard.errors import ConfigError
from psguard.handoff.parts import PartCapture, ShardKey, check_restore_files, task_of_device
from psguard.tensors import TensorUpdate
from psguard.trainer.capture_graph import (
    Functions,
    Plan,
    ShardPlan,
    TensorPlan,
    capture_specs,
    functions_for,
    unoptimized_calls,
    warm_functions,
)
from psguard.trainer.capture_results import CaptureStats, assemble, capture_stats, part_files
from psguard.trainer.deferred_init import note_restored
from psguard.trainer.ps_load import run_load, trace_load
from psguard.trainer.variables import (
    Shape,
    Shard,
    TensorInfo,
    check_tensors,
    lazy_tf,
    list_tensors,
    restore,
    shard_part,
    unwrap,
)
from psguard.trainer.write_tracking import (
    DirtyRows,
    SlotGroup,
    StepCounter,
    apply_hook,
    find_optimizers,
    slot_groups,
    update_hook,
    write_hook,
)

log = logging.getLogger(__name__)

#: Below this many bytes per row a per-row fingerprint (8 bytes) costs more memory than the rows it guards.
_MIN_ROW_BYTES = 8


# --------------------------------------------------------------------------------------------- capture


@dataclass
class _Tracked:
    """Per primary tensor: how it is tracked, its fingerprint variables (one per shard, same device), and,
    when writes are tracked, its per-shard dirty marks."""

    info: TensorInfo
    by_row: bool
    fingerprints: list[Any]
    need_full: bool = True
    dirty: list[DirtyRows] | None = None
    #: Captured into files on each shard's PS node (``Capturer(spill_dirs=...)``) rather than to the chief.
    spill: bool = False


def _same_layout(a: TensorInfo, b: TensorInfo) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and len(a.shards) == len(b.shards)
        and all(x.var is y.var and x.rows == y.rows for x, y in zip(a.shards, b.shards, strict=True))
    )


class Capturer:
    """Incremental captures of everything ``root`` saves: the first (and any after :meth:`invalidate`) full,
    later ones only what changed, so the caller must apply every capture in order. Tensors under
    ``row_tracking_min_rows`` rows or 8 bytes a row are compared whole, larger ones row by row.

    With ``track_writes`` and only tf_keras 2.11+ or Keras 3 optimizers in ``root``, a capture hashes only the
    rows written through variable objects; it hashes every row when a step ran unhooked, on full captures, every
    ``verify_every``-th capture, and when ``probe_rows`` random unmarked rows changed (raw-op writers).
    """

    def __init__(
        self,
        root: Any,
        *,
        coordinator: Any = None,
        row_tracking_min_rows: int = 1024,
        hash_chunk_bytes: int = 4 << 20,
        track_writes: bool = True,
        verify_every: int = 16,
        probe_rows: int = 1024,
        spill_dirs: Mapping[str, str] | None = None,
    ) -> None:
        if row_tracking_min_rows < 1 or hash_chunk_bytes < 1 or verify_every < 1 or probe_rows < 0:
            raise ConfigError(
                "row_tracking_min_rows, hash_chunk_bytes and verify_every must be positive, probe_rows >= 0"
            )
        self.root = root
        self.hash_chunk_bytes = hash_chunk_bytes
        self.coordinator = coordinator
        self.row_tracking_min_rows = row_tracking_min_rows
        self.track_writes = track_writes
        self.verify_every = verify_every
        self.probe_rows = probe_rows
        self.spill_dirs = dict(spill_dirs or {})
        self.last_stats = CaptureStats()
        self.last_parts: list[PartCapture] = []
        self._lock = threading.RLock()
        self._infos: dict[str, TensorInfo] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._fns: Functions | None = None
        self._capture_concrete: Any = None  # the traced capture of self._fns for these variables (see _call_capture)
        self._warming: threading.Thread | None = None  # a dry call instantiating the capture (see _warm_up)
        self._load_traced: Any = None  # the functions whose usual PS-side load is traced (see _trace_load)
        # Write tracking: the optimizers' iterations, this generation's apply counter, and the value of
        # sum(iterations) - applies after the last capture (None: unknown, hash every row next time).
        self._iterations: list[Any] = []
        self._counter: StepCounter | None = None
        self._expected_gap: int | None = None
        self._since_verify = 0
        #: Changes whenever the variables under ``root`` (names, shapes, shards, the objects themselves) do.
        self.layout_version = 0
        self._sync()

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def names(self) -> set[str]:
        """The checkpoint keys of the root's variables now (variables created since the last look included)."""
        with self._lock:
            self._sync()
            return set(self._infos)

    @property
    def tracks_writes(self) -> bool:
        """Whether captures can hash only written rows (see the class docstring for when they cannot)."""
        return self._counter is not None

    @property
    def hook_generation(self) -> StepCounter | None:
        """The apply counter of the current write hooks (``None``: no tracking); new whenever variables get
        hooked anew, so a step function traced under another one must be traced again."""
        return self._counter

    # ------------------------------------------------------------------------------------------ public

    def capture(self, *, full: bool = False) -> dict[str, TensorUpdate]:
        """Drain the coordinator, then return name -> Full | Rows | Same for every tensor (a failure makes the
        next capture full). Tensors captured into files on their PS nodes (``spill_dirs``) are in
        :attr:`last_parts` instead."""
        tf = lazy_tf()
        with self._lock:
            self._sync()  # before the drain, while the workers run: only this thread creates variables
            if self.coordinator is not None:
                self.coordinator.join()
            t0 = time.perf_counter()
            primaries = list(self._tracked.values())
            force = np.array([full or tr.need_full for tr in primaries], dtype=bool)
            expected, self._expected_gap = self._expected_gap, None  # unknown until this capture succeeds
            verify = full or expected is None or self._since_verify + 1 >= self.verify_every
            for tr in primaries:
                tr.need_full = True  # until this capture has reached the caller
            outputs, hashed_all, strays, gap = [], [], [], None
            nonce = secrets.token_hex(8)
            self.last_parts = []
            if primaries:
                args = (
                    tf.constant(False),  # not dry
                    tf.constant(force),
                    tf.constant(verify),
                    tf.constant(expected or 0, tf.int64),
                    tf.constant(f"incoming/{nonce}"),
                )
                warming, self._warming = self._warming, None
                if warming is not None:
                    warming.join()
                with unoptimized_calls():
                    outputs, hashed_all, strays, gap = self._call_capture(args)
            updates, nbytes = assemble(primaries, outputs, self._infos)
            self.last_parts = part_files(primaries, outputs, nonce)
            for tr in primaries:
                tr.need_full = False
            self._expected_gap = int(gap) if self.tracks_writes and gap is not None else None
            self._since_verify = 0 if verify else self._since_verify + 1
            self.last_stats = capture_stats(self._infos, updates, time.perf_counter() - t0, nbytes)
            self.last_stats.rows_spilled = sum(s.count for p in self.last_parts for s in p.shards)
            self.last_stats.hashed_all = [
                tr.info.name for tr, h in zip(primaries, hashed_all, strict=True) if tr.by_row and bool(h)
            ]
            self.last_stats.untracked_writes = [
                tr.info.name for tr, w in zip(primaries, strays, strict=True) if bool(w)
            ]
            if self.last_stats.untracked_writes:
                log.warning(
                    "rows of %s were written without going through their variable objects (raw ops on the "
                    "handle?); this capture hashed every row and is exact, but captures between two full checks "
                    "can miss such writes",
                    ", ".join(self.last_stats.untracked_writes),
                )
            self._trace_load()
            return updates

    def rebase(self) -> None:
        """Declare the variables' current values to be what the caller already holds (e.g. just restored)."""
        with self._lock:
            self._sync()
            self._expected_gap = None
            gap = None
            if self._tracked:
                with unoptimized_calls():
                    gap = self._functions.rebase(True, self._variables())
            self._rebased(gap)

    def _rebased(self, gap: Any) -> None:
        """What a rebase leaves behind once its function ran (``gap``: its result, None without tensors)."""
        self._expected_gap = int(gap) if gap is not None and self.tracks_writes else None
        self._since_verify = 0
        for tr in self._tracked.values():
            tr.need_full = False

    def prepare(self) -> None:
        """Re-read the object graph and trace the capture function now, before the caller drains the
        coordinator: a trace (seconds; none once :meth:`warm` or a restore warmed it) overlaps the drain."""
        with self._lock:
            self._sync()
            if self._tracked and self._capture_concrete is None:
                self._capture_concrete = self._functions.capture.get_concrete_function(
                    *capture_specs(len(self._tracked)), self._variables()
                )

    def warm(self) -> None:
        """Trace and instantiate the capture function in the background now (a fresh job, before its first
        save): a restore does the same (:meth:`_warm_up`). The first save of a job otherwise paid the trace
        (2-2.6 s of Python for a 2-PS model, any size) and the first call on the PS (0.9 s) while training
        waited, against TF's 0.3 s first save. A layout that changes before that save (variables created by
        the first step) is traced again then; only the background work is wasted."""
        with self._lock:
            self._sync()
            self._warm_up()

    def _warm_up(self) -> None:
        """After a restore, instantiate the capture function on the PS by a dry call in the background, so the
        first capture does not pay it as stall. Caller holds the lock."""
        if self._tracked and self._warming is None:
            self._warming = warm_functions(self._functions, self._variables())

    def _trace_load(self) -> None:
        """Trace this layout's usual PS-side load once, after a capture, so the next generation's restore finds
        it traced (a lookup instead of 0.1 s). Not on a thread: one still tracing at exit aborts the process."""
        fns = self._functions
        if self._load_traced is fns:
            return
        self._load_traced = fns
        tracked = list(self._tracked.values())
        which = tuple((i, j) for i, tr in enumerate(tracked) if tr.spill for j in range(len(tr.info.shards)))
        if which:
            trace_load(fns, which, self._given(lambda _: True), self._variables())

    def _given(self, held: Callable[[str], bool]) -> tuple[tuple[int, int], ...]:
        """The (tensor, shard) indices of the tensors the chief passes to a PS-side load: every shard of each
        tensor not captured on its PS whose name ``held`` accepts."""
        return tuple(
            (i, j)
            for i, tr in enumerate(self._tracked.values())
            if not tr.spill and held(tr.info.name)
            for j in range(len(tr.info.shards))
        )

    def refresh(self) -> None:
        """Re-read the variables under ``root`` now, hooking those created since, before a step traces them."""
        with self._lock:
            self._sync()

    def verify_next(self) -> None:
        """Make the next capture hash every row (it still sends only the changed rows)."""
        with self._lock:
            self._expected_gap = None

    def invalidate(self) -> None:
        """Make the next capture full: the caller lost (or could not persist) a capture."""
        with self._lock:
            for tr in self._tracked.values():
                tr.need_full = True

    def restore(self, tensors: Mapping[str, np.ndarray], *, deferred: Mapping[str, Shape] | None = None) -> None:
        """:func:`restore` into this capturer's root, then :meth:`rebase` so deltas continue from it."""
        with self._lock:
            if self.coordinator is not None:
                self.coordinator.join()
            restore(self.root, tensors, deferred=deferred)
            self.rebase()
            note_restored(self._variables_of_root())
            self._warm_up()

    @property
    def spilled(self) -> dict[str, list[ShardKey]]:
        """The tensors captured into files on their PS nodes, and the shards each PS holds of them."""
        with self._lock:
            self._sync()
            return {
                tr.info.name: [ShardKey(tr.info.name, s.offset, s.rows) for s in tr.info.shards]
                for tr in self._tracked.values()
                if tr.spill
            }

    def spilled_by_task(self) -> dict[str, list[ShardKey]]:
        """The spilled shards grouped by the PS task that hosts each (what each PS's agent must load)."""
        with self._lock:
            self._sync()
            out: dict[str, list[ShardKey]] = {}
            for tr in self._tracked.values():
                if tr.spill:
                    for s in tr.info.shards:
                        task = task_of_device(str(s.device)) or ""
                        out.setdefault(task, []).append(ShardKey(tr.info.name, s.offset, s.rows))
            return out

    def restore_parts(
        self,
        tensors: Mapping[str, np.ndarray],
        files: Mapping[ShardKey, str],
        *,
        deferred: Mapping[str, Shape] | None = None,
        homes: Mapping[ShardKey, str] | None = None,
        fingerprints: Mapping[ShardKey, str] | None = None,
        mappable: Collection[ShardKey] = (),
    ) -> tuple[int, int]:
        """Restore ``tensors`` from the chief and each spilled shard from its file on its own PS node, all or
        nothing, in one function (:func:`~psguard.trainer.ps_load.load_function`); returns how many shards the
        PS mapped and how many they loaded. ``homes``: shard -> the PS task whose agent wrote its file, which
        must host it now; ``fingerprints``: shard -> its rows' fingerprints file; ``mappable``: shards whose
        file is their agent's own tier file."""
        tf = lazy_tf()
        with self._lock:
            if self.coordinator is not None:
                self.coordinator.join()
            self._sync()
            spilled = [(i, tr) for i, tr in enumerate(self._tracked.values()) if tr.spill]
            # (tensor, shard) indices in the functions' plan, and each shard's key and PS.
            placed = [
                ((i, j), ShardKey(tr.info.name, s.offset, s.rows), task_of_device(str(s.device)) or "")
                for i, tr in spilled
                for j, s in enumerate(tr.info.shards)
            ]
            check_restore_files({k: task for _, k, task in placed}, files, homes)
            elsewhere = {tr.info.name: (tr.info.shape, tr.info.dtype) for _, tr in spilled}
            infos = check_tensors(self.root, tensors, elsewhere=elsewhere, deferred=deferred)
            # The tensors the chief holds go in by the same function, shard by shard (aliases through their owner).
            given = self._given(lambda name: name in tensors and name in infos)
            infos_of = [tr.info for tr in self._tracked.values()]
            shards = [(infos_of[i], infos_of[i].shards[j]) for i, j in given]
            values = [tf.constant(shard_part(tensors[t.name], t, s), dtype=s.var.dtype) for t, s in shards]
            loads = [(ij, str(files[k]), (fingerprints or {}).get(k), k in mappable) for ij, k, _ in placed]
            gap, mapped = run_load(self._functions, loads, given, tuple(values), self._variables())
            self._rebased(gap)
            note_restored(self._variables_of_root())
            self._warm_up()
            return mapped, len(loads)

    def _variables_of_root(self) -> list[Any]:
        """Every variable object behind the root's tensors (each shard, and what wraps it)."""
        return [obj for tr in self._tracked.values() for s in tr.info.shards for obj in (s.var, *s.chain)]

    # ------------------------------------------------------------------------------------------ tracking

    def _sync(self) -> None:
        """Re-read the object graph; keep fingerprints of unchanged tensors, track new ones (full first)."""
        infos = list_tensors(self.root)
        if infos.keys() == self._infos.keys() and all(
            _same_layout(infos[n], self._infos[n]) and infos[n].alias_of == self._infos[n].alias_of for n in infos
        ):
            return
        optimizers, other = find_optimizers(self.root) if self.track_writes else ([], True)
        hooked = bool(optimizers) and not other
        new_hooks = False
        # (update key, variable shard, its slot shards) of every shard a zero-preserving optimizer updates
        # (write_tracking.slot_groups), innermost variables, the optimizer's update hooked.
        candidates = [s.var for info in infos.values() if info.alias_of is None for s in info.shards]
        groups = [
            (key, unwrap(var), [unwrap(x) for x in members])
            for opt, _ in (optimizers if hooked else [])
            if update_hook(opt)
            for key, var, members in slot_groups(opt, candidates)
        ]
        slots = {id(slot) for _, _, members in groups for slot in members}
        tracked: dict[str, _Tracked] = {}
        for name, info in infos.items():
            if info.alias_of is not None:
                continue
            tr = self._tracked.get(name)
            if tr is None or not _same_layout(tr.info, info):
                by_row = bool(info.shape) and info.dtype != np.dtype(object)
                by_row = by_row and info.shape[0] >= self.row_tracking_min_rows and info.row_bytes >= _MIN_ROW_BYTES
                tr = _Tracked(info, by_row, [self._fingerprint_var(s, by_row) for s in info.shards])
            tracked[name] = tr
            if not hooked or not tr.by_row:
                tr.dirty = None
            elif tr.dirty is None:
                new_hooks = True
                tr.dirty = [DirtyRows(s, slot=id(s.var) in slots) for s in info.shards]
                for s, d in zip(info.shards, tr.dirty, strict=True):
                    for obj in s.chain or (s.var,):
                        write_hook(obj).targets.add(d)
        self._link_groups(tracked, groups)
        aliased = {info.alias_of for info in infos.values() if info.alias_of is not None}
        for name, tr in tracked.items():
            tr.spill = (
                tr.by_row
                and name not in aliased
                and all(task_of_device(str(s.device)) in self.spill_dirs for s in tr.info.shards)
            )
        self._infos = infos
        self._tracked = tracked
        # A new apply counter only when variables got hooked or the optimizers changed: steps traced before
        # do not mark the new variables, and must not count in the new counter either.
        iterations = [unwrap(opt.iterations) for opt, _ in optimizers] if hooked else []
        same_optimizers = [id(a) for a in iterations] == [id(b) for b in self._iterations]
        if new_hooks or not same_optimizers or not hooked:
            self._iterations = iterations
            self._counter = StepCounter(str(iterations[0].device)) if hooked else None
            self._expected_gap = None
            for opt, method in optimizers if hooked else []:
                hook = apply_hook(opt, method)
                hook.counters.clear()
                if self._counter is not None:
                    hook.counters.add(self._counter)
        self.layout_version += 1
        self._build_functions()

    @staticmethod
    def _link_groups(tracked: Mapping[str, _Tracked], groups: list[tuple[tuple[int, Any], Any, list[Any]]]) -> None:
        """Give every member of a group (the variable's shard and its slots' shards) the group's live rows,
        when every slot's shard has live rows (else dense writes stay marked whole)."""
        dirty = {
            id(s.var): d for tr in tracked.values() if tr.dirty for s, d in zip(tr.info.shards, tr.dirty, strict=True)
        }
        for key, var, members in groups:
            found = [dirty.get(id(x)) for x in (var, *members)]
            if not members or any(d is None for d in found) or any(d.live is None for d in found[1:]):  # type: ignore[union-attr]
                continue
            group = SlotGroup(key, tuple(d.live for d in found[1:]))  # type: ignore[union-attr]
            for d in found:
                d.group = group  # type: ignore[union-attr]

    @staticmethod
    def _fingerprint_var(shard: Shard, by_row: bool) -> Any:
        tf = lazy_tf()
        from tensorflow.python.ops import resource_variable_ops

        n = shard.rows if by_row else 1
        with tf.init_scope(), tf.device(shard.device):
            # The class itself, not tf.Variable: a strategy scope's variable creator would otherwise wrap or
            # even partition it and move it off the shard's device.
            return resource_variable_ops.ResourceVariable(
                initial_value=tf.zeros([n], tf.int64), trainable=False, name="psguard_fingerprint"
            )

    # ------------------------------------------------------------------------------------------ graph

    def _build_functions(self) -> None:
        from tensorflow.python.eager import context

        tensors = []
        for tr in self._tracked.values():
            info, marks, live = tr.info, tr.dirty is not None, tr.dirty is not None and tr.dirty[0].live is not None
            shards = tuple(ShardPlan(str(s.device), s.rows) for s in info.shards)
            tensors.append(
                TensorPlan(tr.by_row, tr.spill, marks, live, info.row_bytes, info.dtype, info.shape[1:], shards)
            )
        counter = self._counter
        plan = Plan(
            tuple(tensors),
            str(counter.var.device) if counter is not None else None,
            len(self._iterations),
            self.hash_chunk_bytes,
            self.probe_rows,
            tuple(sorted(self.spill_dirs.items())),
            context.context().host_address_space() + "/device:CPU:0",
        )
        self._fns = functions_for(plan)
        self._capture_concrete = None

    @property
    def _functions(self) -> Functions:
        assert self._fns is not None, "built by _sync, which the constructor runs"
        return self._fns

    def _call_capture(self, args: tuple[Any, ...]) -> Any:
        """The capture function's call, through its concrete function once known: ``tf.function``'s dispatch
        computes every argument's trace type at every call (5-9 ms of stall on a 121-variable model)."""
        variables = self._variables()
        if self._capture_concrete is None:
            self._capture_concrete = self._functions.capture.get_concrete_function(*args, variables)
        try:
            return self._capture_concrete(*args, variables)
        except TypeError:  # arguments it was not traced for (raised while binding, before anything ran)
            self._capture_concrete = None
            return self._functions.capture(*args, variables)

    def _variables(self) -> Any:
        """The arguments that stand for every variable in :class:`Plan`, in its order."""
        shard_vars = []
        for tr in self._tracked.values():
            dirty: list[DirtyRows | None] = list(tr.dirty) if tr.dirty is not None else [None] * len(tr.info.shards)
            shard_vars.append(
                tuple(
                    (s.var, fp, d.rows if d else None, d.whole if d else None, d.live if d else None)
                    for s, fp, d in zip(tr.info.shards, tr.fingerprints, dirty, strict=True)
                )
            )
        counter = self._counter.var if self._counter is not None else None
        return tuple(shard_vars), counter, tuple(self._iterations)
