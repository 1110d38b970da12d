"""The memory tier: the sidecar's one materialised latest snapshot, and what the durable log still lacks of it.

One lock keeps consistent the state (name -> array, step, metadata, token), updated by :meth:`MemoryTier.apply`
(``Full`` replaces, ``Rows`` assigns in place, ``Same`` does nothing), and the changes since the last *durable*
commit (a row bitmap per tensor that got rows, a whole-tensor flag for the others, the committed layout).

Tokens: every state has its writer's token, and a delta names the token of the state it applies to. Over any
other state the answer is ``need_full`` and nothing changes (rows applied to the wrong base would corrupt it
silently); a capture without a parent must be whole.

Persisting: :meth:`MemoryTier.take_dirty` returns, atomically with respect to applies, the update from the last
durable checkpoint to now and moves the dirty marks into the :class:`DirtyTake`; ``commit()`` drops them,
``abort()`` merges them back, so a failed persist loses nothing.

No whole tensor is copied for a persist or an export; arrays handed out are *leased*: an apply copies an export's
leased array before writing it, and writes a persist's streamed one in place after saving the rows it overwrites.
Given a ``home`` (:class:`~psguard.agent.tiers.tier_files.TierFiles`) every array the tier takes moves into it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import numpy as np

from psguard.codec.dtypes import dtype_name
from psguard.errors import ConfigError, PsguardError, TensorMismatchError
from psguard.tensors import Full, FullStream, Rows, Same, TensorUpdate

if TYPE_CHECKING:
    from typing import Self

    from psguard.agent.tiers.tier_files import TierFiles

Layout = dict[str, tuple[str, tuple[int, ...]]]

#: A Rows update is used for a persist while ids + rows cost less than this fraction of the whole tensor.
ROWS_MAX_FRACTION = 0.5
#: Whole values at least this big are compared row by row with the old one: a full capture re-sent after
#: ``need_full`` becomes a small delta in the durable log.
DIFF_MIN_BYTES = 64 << 10
_DIFF_BLOCK_BYTES = 4 << 20
#: A persist streams whole tensors at least this big (captures during the write then copy rows, not the tensor).
STREAM_MIN_BYTES = 16 << 20


def limit_malloc_retention() -> bool:
    """Have glibc give large freed buffers back to the system at once; True when it took the settings.

    A tier moves data through MB-sized buffers on many threads, and glibc's per-thread arenas and rising mmap
    threshold kept the freed memory (a PS agent held 0.5 GB over its shards). Process-wide; a no-op off glibc.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process runs on
    except (OSError, AttributeError):
        return False
    return bool(mallopt(-3, 1 << 20)) and bool(mallopt(-8, 2))  # M_MMAP_THRESHOLD 1 MB, M_ARENA_MAX 2


@dataclass(frozen=True)
class ApplyResult:
    """The tier's answer to a capture: ``ok`` (applied) or ``need_full`` (nothing changed; send it whole)."""

    status: Literal["ok", "need_full"]
    step: int | None
    token: str | None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class MemoryTierStatus:
    step: int | None
    token: str | None
    tensors: int
    nbytes: int
    dirty_tensors: int
    dirty_rows: int
    leased_arrays: int
    copy_on_write_bytes: int


def _layout_of(arrays: Mapping[str, np.ndarray]) -> Layout:
    return {name: (dtype_name(a.dtype), tuple(int(x) for x in a.shape)) for name, a in arrays.items()}


def _row_tracked(a: np.ndarray) -> bool:
    return a.ndim >= 1 and a.dtype.kind not in ("O", "S", "U") and a.shape[0] > 0


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


def _changed_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray | None:
    """Rows whose bytes differ (so -0.0/+0.0 and NaN payloads count), or None when not comparable."""
    if old.shape != new.shape or old.dtype != new.dtype or not _row_tracked(old) or old.size == 0:
        return None
    rows = old.shape[0]
    o = np.ascontiguousarray(old).reshape(rows, -1).view(np.uint8)
    n = np.ascontiguousarray(new).reshape(rows, -1).view(np.uint8)
    out = np.empty(rows, dtype=bool)
    per = max(1, _DIFF_BLOCK_BYTES // max(1, o.shape[1]))
    for start in range(0, rows, per):
        stop = min(start + per, rows)
        np.any(o[start:stop] != n[start:stop], axis=1, out=out[start:stop])
    return out


@dataclass(eq=False)
class _Lease:
    """Arrays handed out together: an apply copies them before writing, or (``rows_saved``) saves the old rows."""

    arrays: list[np.ndarray]
    rows_saved: bool
    saved: dict[int, _SavedRows] = field(default_factory=dict)  # id(array) -> the rows overwritten since the lease
    released: bool = False


class _SavedRows:
    """The old values of the rows of one array overwritten while it is leased (first write wins)."""

    def __init__(self, rows: int) -> None:
        self.seen = np.zeros(rows, dtype=bool)
        self.batches: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted ids, their old rows)

    def save(self, arr: np.ndarray, ids: np.ndarray) -> int:
        new = ids[~self.seen[ids]]
        if not new.size:
            return 0
        old = arr[new]
        self.batches.append((new, old))
        self.seen[new] = True
        return int(old.nbytes + new.nbytes)

    def patch(self, out: np.ndarray, start: int, stop: int) -> None:
        for ids, old in self.batches:
            lo, hi = np.searchsorted(ids, (start, stop))
            if hi > lo:
                out[ids[lo:hi] - start] = old[lo:hi]


T = TypeVar("T")


@dataclass
class _View(Generic[T]):
    """The tier at one moment, its arrays leased (later applies do not write under it) until :meth:`release`."""

    _tier: MemoryTier
    step: int | None
    metadata: dict[str, Any]
    token: str | None
    tensors: Mapping[str, T]
    _lease: _Lease
    also: list[_View[Any]] = field(default_factory=list)  # views released with this one

    @property
    def empty(self) -> bool:
        return self.step is None

    def release(self, *, hand_off: bool = False) -> None:
        """Let the tier write the arrays again. ``hand_off``: never in place, though: their files went to a restore
        whose PS may have mapped them (:mod:`psguard.handoff.mapped`); the tier copies each on its next write."""
        self._tier._release(self._lease, hand_off=hand_off)
        for view in self.also:
            view.release(hand_off=hand_off)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Snapshot(_View[np.ndarray]):
    """Read-only views of the tier's own arrays (leased: later applies copy before writing)."""


class StreamSnapshot(_View[FullStream]):
    """The tier read in row ranges: a write while it is held saves the rows it overwrites, not the whole array."""


@dataclass
class DirtyTake:
    """What one persist must write (every tensor, whole when ``base``; big ones as a FullStream), and the dirty
    marks it carries until it commits or aborts. ``payload_bytes``: what the log receives, row ids included."""

    tier: MemoryTier = field(repr=False)
    step: int
    metadata: dict[str, Any]
    metrics: dict[str, float]
    token: str | None
    updates: dict[str, TensorUpdate | FullStream]
    base: bool
    payload_bytes: int
    layout: Layout = field(repr=False)
    _all: set[str] = field(repr=False, default_factory=set)
    _rows: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    _leases: list[_Lease] = field(repr=False, default_factory=list)
    _state: Literal["open", "committed", "aborted"] = "open"

    @property
    def changed(self) -> bool:
        """False when nothing but possibly step/metadata differs from the last durable checkpoint."""
        return self.base or any(not isinstance(u, Same) for u in self.updates.values())

    def commit(self) -> None:
        """The persist committed: its marks are durable, and its layout is the durable log's."""
        self.tier._finish(self, committed=True)

    def abort(self) -> None:
        """The persist failed: merge its marks back so the next persist writes them too."""
        self.tier._finish(self, committed=False)


class MemoryTier:
    """One materialised latest snapshot; thread-safe (one lock, applies are short)."""

    def __init__(
        self,
        *,
        diff_min_bytes: int = DIFF_MIN_BYTES,
        stream_min_bytes: int = STREAM_MIN_BYTES,
        home: TierFiles | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self.home = home
        self._arrays: dict[str, np.ndarray] = {}
        self._step: int | None = None
        self._metadata: dict[str, Any] = {}
        self._metrics: dict[str, float] = {}  # the capture's metrics (retention's keep-best), passed to the log
        self._token: str | None = None
        self._all: set[str] = set()  # whole tensor changed since the durable commit
        self._rows: dict[str, np.ndarray] = {}  # row bitmap of changes since the durable commit
        self._durable_layout: Layout | None = None
        self._leases: dict[int, list[_Lease]] = {}  # id(array) -> its leases (a lease keeps its arrays alive)
        self._handed: dict[int, weakref.ref[np.ndarray]] = {}  # id(array) -> the arrays never written in place again
        self._take_open = False
        self._cow_bytes = 0
        self.diff_min_bytes = diff_min_bytes
        self.stream_min_bytes = stream_min_bytes

    # ------------------------------------------------------------------------------------------- reading
    @property
    def step(self) -> int | None:
        return self._step

    @property
    def token(self) -> str | None:
        return self._token

    @property
    def empty(self) -> bool:
        return self._step is None

    def names(self) -> list[str]:
        with self._lock:
            return list(self._arrays)

    def status(self) -> MemoryTierStatus:
        with self._lock:
            return MemoryTierStatus(
                step=self._step,
                token=self._token,
                tensors=len(self._arrays),
                nbytes=sum(a.nbytes for a in self._arrays.values()),
                dirty_tensors=len(self._all | set(self._rows)),
                dirty_rows=sum(int(np.count_nonzero(b)) for b in self._rows.values()),
                leased_arrays=len(self._leases),
                copy_on_write_bytes=self._cow_bytes,
            )

    def gather(self, name: str, ids: np.ndarray) -> np.ndarray | None:
        """A copy of rows ``ids`` of tensor ``name`` (``None``: no such tensor, or the ids do not fit)."""
        with self._lock:
            arr = self._arrays.get(name)
            if arr is None or (ids.size and (ids.min() < 0 or ids.max() >= arr.shape[0])):
                return None
            out: np.ndarray = arr[ids]
            return out

    def revert(
        self, rows: Mapping[str, tuple[np.ndarray, np.ndarray]], *, step: int, token: str
    ) -> tuple[ApplyResult, dict[str, TensorUpdate]]:
        """Write back the rows (``name -> (ids, old values)``) the last delta overwrote, back to state ``token`` at
        ``step``, all or nothing: the result and the updates applied (a delta, for whoever follows this tier)."""
        with self._lock:
            current = self._token
            updates: dict[str, TensorUpdate] = {
                n: Rows(rows[n][0], rows[n][1], tuple(a.shape)) if n in rows else Same(tuple(a.shape), a.dtype)
                for n, a in self._arrays.items()
            }
        if current is None:
            return ApplyResult("need_full", self._step, None, "the tier is empty"), updates
        return self.apply(updates, step=step, token=token, parent=current), updates

    def take_array(self, name: str) -> np.ndarray | None:
        """Remove tensor ``name`` and hand its array over to be reused (``None`` if absent or leased)."""
        with self._lock:
            arr = self._arrays.get(name)
            if arr is None or id(arr) in self._leases or self._is_handed(arr):
                return None
            del self._arrays[name]
            self._all.discard(name)
            self._rows.pop(name, None)
            return arr

    def stream_export(self) -> StreamSnapshot:
        """A consistent snapshot read in row ranges (rows saved on write instead of whole copies)."""
        with self._lock:
            arrays = dict(self._arrays)
            lease = self._lease(arrays.values(), rows_saved=True)
            streams = {n: self._stream(a, lease) for n, a in arrays.items()}
            return StreamSnapshot(self, self._step, dict(self._metadata), self._token, streams, lease)

    def export(self) -> Snapshot:
        """A consistent snapshot for a restore, without copying: release it when written out."""
        with self._lock:
            arrays = dict(self._arrays)
            lease = self._lease(arrays.values(), rows_saved=False)
            tensors = {n: _readonly(a) for n, a in arrays.items()}
            return Snapshot(self, self._step, dict(self._metadata), self._token, tensors, lease)

    # ------------------------------------------------------------------------------------------- writing
    def seed(
        self,
        step: int,
        tensors: Mapping[str, np.ndarray],
        *,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        token: str | None = None,
        durable: bool = True,
    ) -> None:
        """Replace the state wholesale, taking the arrays (into its home). ``durable``: the state *is* the last
        durable checkpoint, so nothing is dirty and the next persist may be a delta over it."""
        arrays = {n: self._own(a, copy=False) for n, a in tensors.items()}
        with self._lock:
            self._arrays = arrays
            self._step = step
            self._metadata = dict(metadata or {})
            self._metrics = dict(metrics or {})
            self._token = token
            self._all = set() if durable else set(self._arrays)
            self._rows = {}
            self._durable_layout = _layout_of(self._arrays) if durable else None

    def apply(
        self,
        updates: Mapping[str, TensorUpdate],
        *,
        step: int,
        token: str,
        parent: str | None,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> ApplyResult:
        """Apply one capture, all or nothing, over the state ``parent`` (None: a whole capture that replaces the
        state). Whole values become the tier's own arrays: the caller must not write to them afterwards. Invalid
        captures raise (:class:`TensorMismatchError`, :class:`ConfigError`) before anything changes."""
        with self._lock:
            if self._step is not None and token == self._token:
                # Processed again after the answer was lost (e.g. the agent could not write its ack): same state.
                return ApplyResult("ok", self._step, self._token, "already applied")
            if parent is None:
                partial = [n for n, u in updates.items() if not isinstance(u, Full)]
                if partial:
                    raise ConfigError(
                        f"a capture without a parent token must be whole; {partial[:5]} are not Full "
                        "(send a full capture, or name the state the delta applies to)"
                    )
            elif self._step is None or parent != self._token:
                have = "empty" if self._step is None else f"at token {self._token} (step {self._step})"
                return ApplyResult(
                    "need_full",
                    self._step,
                    self._token,
                    f"delta for step {step} is relative to {parent}, but the memory tier is {have}; send a full "
                    "capture",
                )
            self._validate(updates, delta=parent is not None)
            if parent is None:
                self._replace(updates)
            else:
                for name, update in updates.items():
                    self._apply_one(name, update)
            self._step = step
            self._token = token
            self._metadata = dict(metadata or {})
            self._metrics = dict(metrics or {})
            return ApplyResult("ok", step, token)

    def _validate(self, updates: Mapping[str, TensorUpdate], *, delta: bool) -> None:
        if delta:
            missing = sorted(set(self._arrays) - set(updates))
            if missing:
                raise ConfigError(f"a delta must list every tensor of the state; missing: {missing[:10]}")
        for name, update in updates.items():
            if isinstance(update, Full):
                continue
            cur = self._arrays.get(name)
            if cur is None:
                raise TensorMismatchError(
                    f"tensor {name!r}: a {type(update).__name__} update for a tensor the memory tier does not have"
                )
            shape = tuple(int(x) for x in update.shape)
            if cur.shape != shape or cur.dtype != np.dtype(update.dtype):
                raise TensorMismatchError(
                    f"tensor {name!r}: a {type(update).__name__} update of {np.dtype(update.dtype)}{list(shape)} "
                    f"does not fit the memory tier's {cur.dtype}{list(cur.shape)}; send it whole"
                )
            if isinstance(update, Rows):
                ids = update.ids
                if ids.dtype.kind not in ("i", "u"):
                    raise TensorMismatchError(f"tensor {name!r}: row ids must be integers, got {ids.dtype}")
                if ids.size and (ids[0] < 0 or ids[-1] >= shape[0] or np.any(np.diff(ids) <= 0)):
                    raise TensorMismatchError(
                        f"tensor {name!r}: row ids must be sorted, unique and within [0, {shape[0]})"
                    )

    def _replace(self, updates: Mapping[str, TensorUpdate]) -> None:
        # Keep the old arrays of the names that stay, so whole values can be diffed against them.
        self._arrays = {n: a for n, a in self._arrays.items() if n in updates}
        self._all &= set(updates)
        self._rows = {n: b for n, b in self._rows.items() if n in updates}
        for name, update in updates.items():
            self._apply_one(name, update)

    def _apply_one(self, name: str, update: TensorUpdate) -> None:
        if isinstance(update, Same):
            return
        if isinstance(update, Full):
            value = self._own(update.value, copy=False)
            old = self._arrays.get(name)
            self._arrays[name] = value
            if name in self._all:
                return
            changed = _changed_rows(old, value) if old is not None and value.nbytes >= self.diff_min_bytes else None
            if changed is None:
                self._all.add(name)
                self._rows.pop(name, None)
            elif changed.any():
                self._mark_rows(name, value.shape[0], changed)
            return
        arr = self._writable(name, update.ids)
        arr[update.ids] = update.values
        if name not in self._all and update.ids.size:
            bitmap = self._rows.get(name)
            if bitmap is None:
                bitmap = self._rows[name] = np.zeros(arr.shape[0], dtype=bool)
            bitmap[update.ids] = True

    def _own(self, value: np.ndarray, *, copy: bool) -> np.ndarray:
        """``value`` as an array the tier may keep: in its home when it has one; a C-order copy when ``copy``."""
        if self.home is not None:
            return self.home.adopt(value, copy=copy)
        return np.array(value, copy=True, order="C") if copy else value

    def _mark_rows(self, name: str, rows: int, changed: np.ndarray) -> None:
        bitmap = self._rows.get(name)
        if bitmap is None or bitmap.shape[0] != rows:
            self._rows[name] = changed
        else:
            bitmap |= changed

    def _writable(self, name: str, ids: np.ndarray) -> np.ndarray:
        """The array of ``name``, ready for rows ``ids`` to be written into it: copied first if an export
        holds it (or it is not ours to write), else with the old rows saved for each persist that holds it."""
        arr = self._arrays[name]
        leases = self._leases.get(id(arr), ())
        if (
            any(not lease.rows_saved for lease in leases)
            or self._is_handed(arr)
            or not arr.flags.writeable
            or not arr.flags.c_contiguous
        ):
            self._handed.pop(id(arr), None)
            arr = self._own(arr, copy=True)
            self._arrays[name] = arr
            self._cow_bytes += arr.nbytes
            return arr
        for lease in leases:
            saved = lease.saved.get(id(arr))
            if saved is None:
                saved = lease.saved[id(arr)] = _SavedRows(arr.shape[0])
            self._cow_bytes += saved.save(arr, ids)
        return arr

    # ------------------------------------------------------------------------------------------- leases
    def _is_handed(self, arr: np.ndarray) -> bool:
        ref = self._handed.get(id(arr))
        return ref is not None and ref() is arr

    def _lease(self, arrays: Iterable[np.ndarray], *, rows_saved: bool) -> _Lease:
        lease = _Lease(list(arrays), rows_saved)
        for a in lease.arrays:
            self._leases.setdefault(id(a), []).append(lease)
        return lease

    def _release(self, lease: _Lease, *, hand_off: bool = False) -> None:
        with self._lock:
            if lease.released:
                return
            lease.released = True
            if hand_off and self.home is not None:
                current = {id(a) for a in self._arrays.values()}
                self._handed = {k: r for k, r in self._handed.items() if r() is not None}
                for a in lease.arrays:
                    # Only a home's arrays were linked; one replaced since is written by no one.
                    if id(a) in current and self.home.owns(a):
                        self._handed[id(a)] = weakref.ref(a)
            for a in lease.arrays:
                holders = self._leases.get(id(a), [])
                if lease in holders:
                    holders.remove(lease)
                if not holders:
                    self._leases.pop(id(a), None)
            lease.saved.clear()

    def _stream(self, arr: np.ndarray, lease: _Lease) -> FullStream:
        def read(start: int, stop: int) -> np.ndarray:
            with self._lock:
                if lease.released:
                    raise PsguardError("this persist take was closed: its tensors cannot be read any more")
                out = np.array(arr[start:stop], copy=True)
                saved = lease.saved.get(id(arr))
                if saved is not None:
                    saved.patch(out, start, stop)
                return out

        return FullStream(tuple(int(x) for x in arr.shape), arr.dtype, read)

    # ------------------------------------------------------------------------------------------- persisting
    def take_dirty(self, *, base: bool = False) -> DirtyTake | None:
        """The update from the last durable checkpoint to now, with the dirty marks moved into it (None: the tier
        is empty): a full base when asked, before the first commit, or after a layout change. One at a time."""
        with self._lock:
            if self._step is None:
                return None
            if self._take_open:
                raise PsguardError("a persist is already in progress on this memory tier (one take at a time)")
            layout = _layout_of(self._arrays)
            base = base or self._durable_layout is None or self._durable_layout != layout
            updates: dict[str, TensorUpdate | FullStream] = {}
            leased: list[np.ndarray] = []
            streamed: dict[str, np.ndarray] = {}
            payload = 0
            for name, arr in self._arrays.items():
                bitmap = self._rows.get(name)
                if bitmap is not None and not base and name not in self._all and _row_tracked(arr):
                    ids = np.flatnonzero(bitmap).astype(np.int64)
                    cost = ids.size * (arr.nbytes // arr.shape[0] + 8)
                    if cost < ROWS_MAX_FRACTION * arr.nbytes:
                        updates[name] = Rows(ids, arr[ids], tuple(arr.shape))
                        payload += cost
                        continue
                if base or name in self._all or bitmap is not None:  # string rows too: the log takes them whole
                    if arr.nbytes >= self.stream_min_bytes and _row_tracked(arr) and arr.flags.c_contiguous:
                        streamed[name] = arr
                        updates[name] = Same(tuple(arr.shape), arr.dtype)  # a place in the order; replaced below
                    else:
                        updates[name] = Full(_readonly(arr))
                        leased.append(arr)
                    payload += arr.nbytes
                else:
                    updates[name] = Same(tuple(arr.shape), arr.dtype)
            leases = [self._lease(leased, rows_saved=False)]
            if streamed:
                leases.append(self._lease(streamed.values(), rows_saved=True))
                for name, arr in streamed.items():
                    updates[name] = self._stream(arr, leases[1])
            take = DirtyTake(
                tier=self,
                step=self._step,
                metadata=dict(self._metadata),
                metrics=dict(self._metrics),
                token=self._token,
                updates=updates,
                base=base,
                payload_bytes=payload,
                layout=layout,
                _all=self._all,
                _rows=self._rows,
                _leases=leases,
            )
            self._all = set()
            self._rows = {}
            self._take_open = True
            return take

    def _finish(self, take: DirtyTake, *, committed: bool) -> None:
        with self._lock:
            if take._state != "open":
                raise PsguardError(f"this persist take was already {take._state}")
            take._state = "committed" if committed else "aborted"
            self._take_open = False
            if committed:
                self._durable_layout = take.layout
            else:
                self._merge_back(take)
        for lease in take._leases:
            self._release(lease)
        take._leases = []
        take.updates = {}

    def _merge_back(self, take: DirtyTake) -> None:
        for name in take._all:
            if name in self._arrays:
                self._all.add(name)
                self._rows.pop(name, None)
        for name, bitmap in take._rows.items():
            arr = self._arrays.get(name)
            if arr is None or name in self._all:
                continue
            if arr.ndim == 0 or arr.shape[0] != bitmap.shape[0]:
                self._all.add(name)
                self._rows.pop(name, None)
            else:
                self._mark_rows(name, arr.shape[0], bitmap)
