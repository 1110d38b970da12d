"""A follower of a job's durable log: an evaluator or a server keeps its variables at the newest checkpoint.

Rather than reloading the whole model per checkpoint (``tf.train.checkpoints_iterator``), a :class:`Follower`
moves its variables to a newer checkpoint by applying only the deltas on the way, row by row in place; it reads a
full checkpoint only when it holds nothing, its chain was compacted away, or the deltas cost more bytes. Applied in
step order and all or nothing: every chunk on the way is verified and every name, shape and dtype checked before
the first write; a checkpoint that fails is skipped with a logged reason. Variables bind to checkpoint tensors
along the saved object graph, as TF's restore does; what the checkpoint lacks is left alone
(``Follower.left_alone``), a checkpoint tensor nothing takes is an error unless ``ignore_missing`` names it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from psguard.codec.dtypes import dtype_from_name
from psguard.errors import CorruptCheckpointError, NoCheckpointError, TensorMismatchError, UnsupportedFormatError
from psguard.store import CheckpointInfo, Store
from psguard.store.manifest import Manifest
from psguard.tensors import Full, Same, TensorUpdate
from psguard.trainer.export import OBJECT_GRAPH_KEY
from psguard.trainer.variables import TensorInfo, gather_variables, lazy_tf, list_tensors, shard_part

log = logging.getLogger(__name__)

_SHOWN = 5  # names of tensors left alone in the log line (all of them are in ``Follower.left_alone``)


@dataclass
class FollowStats:
    """What a follower did; ``lag_seconds``: from the last applied checkpoint's commit to its application."""

    applied: int = 0
    bytes_read: int = 0
    full_loads: int = 0
    skipped: int = 0
    lag_seconds: float | None = None
    step: int | None = None


class Follower:
    """Keep ``checkpoint``'s variables at the newest committed checkpoint of the store at ``url``.

    ``ignore_missing``: path components (``("optimizer",)``) whose tensors the follower may lack, or ``True`` for
    any (TF's ``expect_partial()``); anything else unmatched is a :class:`TensorMismatchError`.
    """

    def __init__(
        self,
        checkpoint: Any,
        url: str | Store,
        *,
        poll_interval: float = 5.0,
        ignore_missing: Sequence[str] | bool = (),
        storage_options: Mapping[str, Any] | None = None,
        verify_hash: bool = False,
    ) -> None:
        self._checkpoint = checkpoint
        getattr(checkpoint, "save_counter", None)  # tf.train.Checkpoint creates it lazily; the trainer's has it
        self.store = url if isinstance(url, Store) else Store.open(url, storage_options)
        self._owns_store = not isinstance(url, Store)
        self.poll_interval = poll_interval
        self.ignore_missing: tuple[str, ...] | bool = (
            ignore_missing if isinstance(ignore_missing, bool) else tuple(ignore_missing)
        )
        self.verify_hash = verify_hash
        self.stats = FollowStats()
        self.held: CheckpointInfo | None = None
        #: The follower's tensors the checkpoint held does not have, left at their values (sorted names).
        self.left_alone: list[str] = []
        self._graph: Any = None  # the object graph of the checkpoint held (a TrackableObjectGraph)
        self._binding: dict[str, str] | None = None  # its checkpoint key of each tensor of the follower it holds
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

    def checkpoints(
        self, *, timeout: float | None = None, stop: threading.Event | None = None
    ) -> Iterator[CheckpointInfo]:
        """Each newest checkpoint once the follower's variables hold it (psguard's ``checkpoints_iterator``), never
        one twice or an older one; ends when ``stop`` is set or ``timeout`` seconds pass without a newer one."""
        stop = stop or threading.Event()
        waited_since = time.monotonic()
        while not stop.is_set():
            info = self.poll()
            if info is not None:
                yield info
                waited_since = time.monotonic()
                continue
            left = None if timeout is None else waited_since + timeout - time.monotonic()
            if left is not None and left <= 0:
                return
            stop.wait(self.poll_interval if left is None else min(self.poll_interval, left))

    def run(
        self, on_checkpoint: Callable[[CheckpointInfo], None] | None = None, stop: threading.Event | None = None
    ) -> None:
        """Poll until ``stop`` is set; call ``on_checkpoint`` after each checkpoint applied."""
        for info in self.checkpoints(stop=stop):
            if on_checkpoint is not None:
                on_checkpoint(info)

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
        graph = self._graph_of(chain)
        binding = _binding(self._checkpoint, graph)
        infos = list_tensors(self._checkpoint)
        bound, left_alone = self._check(infos, binding, _described(chain[-1]), info.id)  # before reading a byte
        # Only the bound tensors' chunks are read; deltas apply only when every variable is bound as before.
        held = self.held.id if self.held is not None and binding == self._binding else None
        on_the_way = deltas_on_the_way(chain, held, list(bound))
        if on_the_way is not None:
            self._apply_deltas(infos, on_the_way, binding)
        else:
            tensors = self.store.load(info.id, list(bound), verify_hash=self.verify_hash)
            for key, tensor in bound.items():
                _assign(tensor, Full(tensors[key]))
            self.stats.bytes_read += full_bytes(chain, list(bound))
            self.stats.full_loads += 1
        self.held = info
        self._graph, self._binding = graph, binding
        self.left_alone = left_alone
        self.stats.applied += 1
        self.stats.step = info.step
        self.stats.lag_seconds = max(0.0, time.time() - info.committed_at)
        via = "deltas" if on_the_way is not None else "a full read"
        log.info("follower: at step %d (%s) via %s; lag %.2fs", info.step, info.id, via, self.stats.lag_seconds)
        if left_alone:
            more = f" and {len(left_alone) - _SHOWN} more" if len(left_alone) > _SHOWN else ""
            what = f"{len(left_alone)} tensor(s) of the model alone, not in checkpoint {info.id} (step {info.step})"
            log.info("follower: left %s: %s", what, ", ".join(left_alone[:_SHOWN]) + more)

    def _graph_of(self, chain: Sequence[Manifest]) -> Any:
        """The object graph of the newest checkpoint of ``chain`` (``None``: written without one); not read again
        while it is the held checkpoint's."""
        from google.protobuf.message import DecodeError
        from tensorflow.core.protobuf import trackable_object_graph_pb2

        ids = [m.id for m in chain]
        for i in range(len(chain) - 1, -1, -1):
            entry = chain[i].tensors.get(OBJECT_GRAPH_KEY)
            if entry is None:
                return None
            if not entry.whole:
                continue
            if self._graph is not None and self.held is not None and self.held.id in ids[i:]:
                return self._graph
            raw = self.store.load(chain[i].id, [OBJECT_GRAPH_KEY], verify_hash=self.verify_hash)[OBJECT_GRAPH_KEY]
            self.stats.bytes_read += sum(ref.size for ref in entry.refs())
            graph = trackable_object_graph_pb2.TrackableObjectGraph()
            try:
                graph.ParseFromString(bytes(np.asarray(raw).item()))
            except DecodeError as e:
                raise CorruptCheckpointError(
                    f"checkpoint {chain[i].id}: its object graph does not parse ({e})", checkpoint=chain[i].id
                ) from None
            return graph
        return None

    def _apply_deltas(
        self, infos: Mapping[str, TensorInfo], manifests: Sequence[Manifest], binding: Mapping[str, str]
    ) -> None:
        steps: list[list[tuple[TensorInfo, TensorUpdate]]] = []
        nbytes = 0
        checked = [self._check(infos, binding, _described(m), m.id) for m in manifests]  # before reading a byte
        for m, (bound, _) in zip(manifests, checked, strict=True):  # read and verify everything first
            updates, read = self.store.updates(m.id, list(bound), verify_hash=self.verify_hash)
            nbytes += read
            steps.append([(bound[n], u) for n, u in updates.items()])
        for step in steps:  # nothing is assigned from a bad checkpoint
            for tensor, update in step:
                _assign(tensor, update)
        self.stats.bytes_read += nbytes

    def _check(
        self, infos: Mapping[str, TensorInfo], binding: Mapping[str, str], updates: Mapping[str, Same], cid: str
    ) -> tuple[dict[str, TensorInfo], list[str]]:
        """The follower's tensors that checkpoint ``cid`` holds, by checkpoint key, and the names of those it
        does not (left alone); :class:`TensorMismatchError` for every shape or dtype that differs and every
        tensor of the checkpoint no variable takes (unless ``ignore_missing`` names it)."""
        problems: list[str] = []
        bound: dict[str, TensorInfo] = {}
        for name, info in infos.items():
            key = binding.get(name)
            update = updates.get(key) if key is not None else None
            if key is None or update is None:
                continue
            bound[key] = info
            shape, dtype = tuple(update.shape), update.dtype
            if shape != info.shape or dtype != info.dtype:
                at = "" if key == name else f" (as {key})"
                problems.append(f"{name}: checkpoint has {shape} {dtype}{at}, follower has {info.shape} {info.dtype}")
        ignore = self.ignore_missing
        for key in updates:
            if key not in bound and not (ignore if isinstance(ignore, bool) else set(key.split("/")) & set(ignore)):
                problems.append(f"{key}: in checkpoint {cid}, not in the follower (ignore_missing=... to skip it)")
        if problems:
            raise TensorMismatchError(
                f"{len(problems)} tensor(s) do not match between checkpoint {cid} and the follower:\n  "
                + "\n  ".join(problems)
            )
        held = {info.name for info in bound.values()}
        return bound, sorted(n for n, i in infos.items() if n not in held and (i.alias_of or n) not in held)


def _binding(root: Any, graph: Any) -> dict[str, str]:
    """The checkpoint key of each of ``root``'s tensors that the saved object graph ``graph`` holds, found as TF's
    restore finds it: from the root along edges of the same names (without a graph: each tensor's own name)."""
    if graph is None:
        return {name: name for name, _ in gather_variables(root)}
    from tensorflow.python.checkpoint import graph_view, util

    view = graph_view.ObjectGraphView(root)
    objects, _, _, slot_variables, _ = util.objects_ids_and_slot_variables_and_paths(view)
    node_of: dict[int, int] = {id(view.root): 0}  # id(follower object) -> its node in the saved graph
    queue = [(view.root, 0)]
    while queue:
        obj, at = queue.pop(0)
        children = view.children(obj)
        for ref in graph.nodes[at].children:
            child = children.get(ref.local_name)
            if child is not None and id(child) not in node_of:
                node_of[id(child)] = ref.node_id
                queue.append((child, ref.node_id))
    for optimizer, slots in slot_variables.items():  # a legacy optimizer's slots: off it and their variable
        if id(optimizer) not in node_of:
            continue
        saved = {
            (s.original_variable_node_id, s.slot_name): s.slot_variable_node_id
            for s in graph.nodes[node_of[id(optimizer)]].slot_variables
        }
        for slot in slots:
            original = node_of.get(id(objects[slot.original_variable_node_id]), -1)
            if (original, slot.slot_name) in saved:
                node_of[id(objects[slot.slot_variable_node_id])] = saved[original, slot.slot_name]
    keys: dict[str, str] = {}
    for name, obj in gather_variables(root):
        attributes = graph.nodes[node_of[id(obj)]].attributes if id(obj) in node_of else ()
        if saved_keys := [a.checkpoint_key for a in attributes if a.name == "VARIABLE_VALUE"]:
            keys[name] = saved_keys[0]
    return keys


def _described(m: Manifest) -> dict[str, Same]:
    """A manifest's tensors as ``Same`` updates: names, shapes and dtypes, for checks before any read."""
    out: dict[str, Same] = {}
    for name, entry in m.tensors.items():
        if name == OBJECT_GRAPH_KEY:
            continue
        try:
            out[name] = Same(tuple(entry.shape), dtype_from_name(entry.dtype))
        except ValueError as e:
            raise CorruptCheckpointError(f"checkpoint {m.id}: tensor {name!r}: {e}", checkpoint=m.id) from None
    return out


def _assign(info: TensorInfo, update: TensorUpdate) -> None:
    """Write one update into the follower's variables, whatever their partitioning (rows in place)."""
    if info.alias_of is not None or isinstance(update, Same):
        return
    if isinstance(update, Full):
        for s in info.shards:
            s.var.assign(shard_part(update.value, info, s))
        return
    tf = lazy_tf()
    for s in info.shards:
        mask = (update.ids >= s.offset) & (update.ids < s.offset + s.rows)
        if not mask.any():
            continue
        local = tf.constant(update.ids[mask] - s.offset, dtype=tf.int64)
        s.var.scatter_update(tf.IndexedSlices(tf.constant(update.values[mask]), local))


def deltas_on_the_way(chain: Sequence[Manifest], held: str | None, names: Collection[str]) -> list[Manifest] | None:
    """The checkpoints of ``chain`` after ``held``, when reading their changes to ``names`` costs no more bytes
    than a full read of the newest; ``None``: read it whole (``held`` not in the chain, or ``None``)."""
    ids = [m.id for m in chain]
    if held not in ids:
        return None
    on_the_way = list(chain[ids.index(held) + 1 :])
    changes = sum(r.size for m in on_the_way for name, e in m.tensors.items() if name in names for r in e.refs())
    return on_the_way if changes <= full_bytes(chain, list(names)) else None


def full_bytes(chain: Sequence[Manifest], names: Sequence[str]) -> int:
    """Bytes a full read of the newest checkpoint of ``chain`` reads: each tensor from its newest whole value."""
    total = 0
    for name in names:
        for m in reversed(chain):
            entry = m.tensors.get(name)
            if entry is None:
                break
            total += sum(ref.size for ref in entry.refs())
            if entry.whole:  # full, or (format version 2) sharded with every part full
                break
    return total
