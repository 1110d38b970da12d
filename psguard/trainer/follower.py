"""A follower of a job's durable log: an evaluator or a server keeps its variables at the newest checkpoint.

An evaluator beside a PS job traditionally reloads the whole model for every checkpoint
(``tf.train.checkpoints_iterator``): gigabytes read for a 1% change. psguard's log already is a change feed:
each delta names the rows that changed. A :class:`Follower` holds one checkpoint's state in its own variables
(a ``tf.train.Checkpoint`` over a model on one machine or on its own PS cluster, partitioned however it likes)
and moves to a newer checkpoint by applying only the deltas on the way, row by row in place; it reads a full
checkpoint only when it holds nothing yet, when the chain it holds was compacted away, or when the deltas would
cost more bytes than the whole.

Guarantees: checkpoints are applied in step order and all-or-nothing. Every chunk of every checkpoint on the
way is read and verified, and every name, shape and dtype checked against the follower's variables, before the
first variable is written; a checkpoint that fails verification is skipped with a logged reason (an older one
that does not depend on it is tried) and never half-applied.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from psguard.errors import CorruptCheckpointError, NoCheckpointError, TensorMismatchError, UnsupportedFormatError
from psguard.store import CheckpointInfo, Store
from psguard.store.dtypes import dtype_from_name
from psguard.store.manifest import Manifest
from psguard.tensors import Full, Rows, Same, TensorUpdate
from psguard.trainer.export import OBJECT_GRAPH_KEY
from psguard.trainer.variables import TensorInfo, lazy_tf, list_tensors, restore

__all__ = ["FollowStats", "Follower"]

log = logging.getLogger(__name__)


@dataclass
class FollowStats:
    """What a follower did: checkpoints applied, bytes read from the store, and how fresh it is.

    ``lag_seconds``: from the commit of the checkpoint last applied to the moment it was applied.
    """

    applied: int = 0
    bytes_read: int = 0
    full_loads: int = 0
    skipped: int = 0
    lag_seconds: float | None = None
    step: int | None = None


class Follower:
    """Keep ``checkpoint``'s variables at the newest committed checkpoint of the store at ``url``.

    ``ignore_missing``: names of path components (``("optimizer",)``) whose tensors the follower may lack
    (a serving model without optimizer slots); anything else in the checkpoint but not in the follower, or
    in the follower but not in the checkpoint, is a :class:`TensorMismatchError`.
    """

    def __init__(
        self,
        checkpoint: Any,
        url: str | Store,
        *,
        poll_interval: float = 5.0,
        ignore_missing: Sequence[str] = (),
        storage_options: Mapping[str, Any] | None = None,
        verify_hash: bool = False,
    ) -> None:
        self._checkpoint = checkpoint
        getattr(checkpoint, "save_counter", None)  # tf.train.Checkpoint creates it lazily; the trainer's has it
        self.store = url if isinstance(url, Store) else Store.open(url, storage_options)
        self._owns_store = not isinstance(url, Store)
        self.poll_interval = poll_interval
        self.ignore_missing = tuple(ignore_missing)
        self.verify_hash = verify_hash
        self.stats = FollowStats()
        self.held: CheckpointInfo | None = None
        self._bad: dict[str, str] = {}  # checkpoint id -> why it was skipped (not tried again)

    # ------------------------------------------------------------------------------------------ public
    def poll(self) -> CheckpointInfo | None:
        """Apply the newest committed checkpoint newer than the one held; its info, or ``None`` if none is."""
        held_step = self.held.step if self.held is not None else -1
        candidates = [
            c
            for c in reversed(self.store.checkpoints())
            if c.step > held_step and c.id not in self._bad and (self.held is None or c.id != self.held.id)
        ]
        for info in candidates:
            try:
                self._apply(info)
            except (CorruptCheckpointError, UnsupportedFormatError, NoCheckpointError) as e:
                self._bad[info.id] = str(e)
                self.stats.skipped += 1
                log.warning("follower: skipping checkpoint %s (step %d): %s", info.id, info.step, e)
                continue
            return info
        return None

    def run(
        self,
        on_checkpoint: Callable[[CheckpointInfo], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """Poll until ``stop`` is set; call ``on_checkpoint`` after each checkpoint applied."""
        stop = stop or threading.Event()
        while not stop.is_set():
            info = self.poll()
            if info is not None and on_checkpoint is not None:
                on_checkpoint(info)
            if info is None:
                stop.wait(self.poll_interval)

    def close(self) -> None:
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ applying
    def _apply(self, info: CheckpointInfo) -> None:
        chain = self.store.chain(info.id)
        ids = [m.id for m in chain]
        on_the_way = chain[ids.index(self.held.id) + 1 :] if self.held is not None and self.held.id in ids else None
        if on_the_way is not None and _delta_bytes(on_the_way) <= _full_bytes(chain):
            self._apply_deltas(info, on_the_way)
        else:
            self._apply_full(info, chain)
        self.held = info
        self.stats.applied += 1
        self.stats.step = info.step
        self.stats.lag_seconds = max(0.0, time.time() - info.committed_at)
        log.info(
            "follower: at step %d (%s) via %s; lag %.2fs",
            info.step,
            info.id,
            "deltas" if on_the_way is not None else "a full read",
            self.stats.lag_seconds,
        )

    def _apply_full(self, info: CheckpointInfo, chain: Sequence[Manifest]) -> None:
        infos = list_tensors(self._checkpoint)
        self._check(infos, _described(chain[-1]), info.id)  # before reading a byte
        wanted = [n for n in chain[-1].tensors if n != OBJECT_GRAPH_KEY and (n in infos or not self._ignorable(n))]
        tensors = self.store.load(info.id, wanted, verify_hash=self.verify_hash)
        restore(self._checkpoint, tensors)  # checks every name, shape and dtype before assigning anything
        self.stats.bytes_read += _full_bytes(chain, wanted)
        self.stats.full_loads += 1

    def _apply_deltas(self, info: CheckpointInfo, manifests: Sequence[Manifest]) -> None:
        infos = list_tensors(self._checkpoint)
        steps: list[dict[str, TensorUpdate]] = []
        nbytes = 0
        for m in manifests:
            self._check(infos, _described(m), m.id)  # names, shapes and dtypes before reading a byte
        for m in manifests:  # read and verify everything first: nothing is assigned from a bad checkpoint
            updates, read = self.store.updates(m.id, verify_hash=self.verify_hash)
            nbytes += read
            updates.pop(OBJECT_GRAPH_KEY, None)
            steps.append({n: u for n, u in updates.items() if n in infos})
        for updates in steps:
            for name, update in updates.items():
                _assign(infos[name], update)
        self.stats.bytes_read += nbytes

    def _ignorable(self, name: str) -> bool:
        return any(part in self.ignore_missing for part in name.split("/"))

    def _check(self, infos: Mapping[str, TensorInfo], updates: Mapping[str, TensorUpdate], cid: str) -> None:
        problems: list[str] = []
        for name, info in infos.items():
            update = updates.get(name)
            if update is None:
                problems.append(f"{name}: in the follower, not in checkpoint {cid}")
                continue
            shape, dtype = _shape_dtype(update)
            if shape != info.shape or dtype != info.dtype:
                problems.append(f"{name}: checkpoint has {shape} {dtype}, follower has {info.shape} {info.dtype}")
        for name in updates:
            if name not in infos and not self._ignorable(name):
                problems.append(f"{name}: in checkpoint {cid}, not in the follower (ignore_missing=... to skip it)")
        if problems:
            raise TensorMismatchError(
                f"{len(problems)} tensor(s) do not match between checkpoint {cid} and the follower:\n  "
                + "\n  ".join(problems)
            )


def _described(m: Manifest) -> dict[str, TensorUpdate]:
    """A manifest's tensors as ``Same`` updates: names, shapes and dtypes, for checks before any read."""
    out: dict[str, TensorUpdate] = {}
    for name, entry in m.tensors.items():
        if name == OBJECT_GRAPH_KEY:
            continue
        try:
            out[name] = Same(tuple(entry.shape), dtype_from_name(entry.dtype))
        except ValueError as e:
            raise CorruptCheckpointError(f"checkpoint {m.id}: tensor {name!r}: {e}", checkpoint=m.id) from None
    return out


def _shape_dtype(update: TensorUpdate) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if isinstance(update, Full):
        return tuple(int(d) for d in update.value.shape), update.value.dtype
    if isinstance(update, Rows):
        return tuple(update.shape), update.values.dtype
    return tuple(update.shape), update.dtype


def _assign(info: TensorInfo, update: TensorUpdate) -> None:
    """Write one update into the follower's variables, whatever their partitioning (rows in place)."""
    if info.alias_of is not None or isinstance(update, Same):
        return
    if isinstance(update, Full):
        value = update.value
        for s in info.shards:
            part = value[s.offset : s.offset + s.rows] if info.shape else value
            s.var.assign(part.reshape(tuple(int(d) for d in s.var.shape)))
        return
    tf = lazy_tf()
    for s in info.shards:
        mask = (update.ids >= s.offset) & (update.ids < s.offset + s.rows)
        if not mask.any():
            continue
        local = tf.constant(update.ids[mask] - s.offset, dtype=tf.int64)
        s.var.scatter_update(tf.IndexedSlices(tf.constant(update.values[mask]), local))


def _delta_bytes(manifests: Sequence[Manifest]) -> int:
    return sum(ref.size for m in manifests for name, e in m.tensors.items() for ref in e.refs())


def _full_bytes(chain: Sequence[Manifest], names: Sequence[str] | None = None) -> int:
    """Bytes a full read of the newest checkpoint of ``chain`` reads: each tensor from its newest whole value."""
    total = 0
    target = chain[-1]
    for name in names if names is not None else list(target.tensors):
        for m in reversed(chain):
            entry = m.tensors.get(name)
            if entry is None:
                break
            total += sum(ref.size for ref in entry.refs())
            if entry.whole:  # full, or (format version 2) sharded with every part full
                break
    return total
