"""TF's restore idioms on psguard checkpoints: the status object, and deferred restoration done by TF itself.

Jobs written from TensorFlow's tutorials restore with ``checkpoint.restore(manager.latest_checkpoint)`` and
check the returned status (``assert_consumed``, ``assert_existing_objects_matched``...), and they do not build
their optimizer first: a tf_keras legacy optimizer creates its slots and hyperparameters at the first
``apply_gradients``, a tf_keras or Keras 3 one at its lazy ``build``, a subclassed layer at its first call. TF
restores those variables when they are created (*deferred restoration*: each trackable looks for pending
checkpoint positions when it adds a dependency or a slot). psguard's restore keeps every tensor it can assign
now on its own fast paths (memory tier, each PS loading its own shards) and hands what has no variable yet to
TF's own machinery, so the semantics are TF's by construction, not a re-implementation:

1. the checkpoint's object graph (stored with every psguard checkpoint under ``_CHECKPOINTABLE_OBJECT_GRAPH``)
   is copied with the attributes of every tensor psguard already assigned removed, so TF binds those objects
   (and counts them as matched) without reading or assigning anything;
2. the tensors still pending are written with that graph as a small TF checkpoint in a private folder
   (``SaveV2``; only the pending tensors, so a job that builds its optimizer first pays for the graph alone);
3. TF's ``Checkpoint.restore`` reads it with its IO on the chief (``experimental_io_device``): a variable
   created later gets its value from that file, on whichever PS it is placed, and the status TF returns
   answers the assertions exactly as it would for a TF checkpoint, deferred values included.

The folder lives until nothing is pending any more (checked at each save) or the manager closes.
Cost: the pending tensors cross the chief once, at the restore (on the PS-side data path they are read from
the PS nodes' restore files); a job that builds its optimizer before restoring has none.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from psguard.handoff.tensor_bundle import BUNDLE_KEY
from psguard.trainer.export import OBJECT_GRAPH_KEY
from psguard.trainer.variables import VARIABLE_SUFFIX, gather_variables, lazy_tf, list_tensors, unwrap

__all__ = ["DeferredRestore", "RestoreStatus", "chief_io_device", "strip_restored"]

log = logging.getLogger(__name__)


def strip_restored(graph: bytes, pending: Mapping[str, Any], *, not_slots: Collection[str] = ()) -> bytes:
    """TF's object graph ``graph`` with every attribute removed but those whose checkpoint key is ``pending``.

    ``has_checkpoint_values`` is cleared too (TF then looks at what each node still holds), so a node whose
    values were all assigned by psguard is bound by TF's restore (it counts as matched) and read from nowhere.
    Slot references to the keys ``not_slots`` are dropped: TF would create those slots itself, wrongly
    (:class:`ShardedSlots`).
    """
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    proto = trackable_object_graph_pb2.TrackableObjectGraph()
    proto.ParseFromString(graph)
    dropped = {i for i, node in enumerate(proto.nodes) if any(a.checkpoint_key in not_slots for a in node.attributes)}
    for node in proto.nodes:
        keep = [a for a in node.attributes if a.checkpoint_key in pending and a.checkpoint_key not in not_slots]
        del node.attributes[:]
        node.attributes.extend(keep)
        node.ClearField("has_checkpoint_values")
        slots = [sv for sv in node.slot_variables if sv.slot_variable_node_id not in dropped]
        del node.slot_variables[:]
        node.slot_variables.extend(slots)
    data: bytes = proto.SerializeToString(deterministic=True)
    return data


def chief_io_device() -> str:
    """The chief's host CPU: where the deferred file is read, since only the chief's node has it (a PS of a
    real cluster reads its own file system, not the chief's)."""
    from tensorflow.python.eager import context

    return f"{context.context().host_address_space()}/device:CPU:0"


class DeferredRestore:
    """A private folder holding the pending tensors as a TF checkpoint, and TF's restore of it.

    ``restore`` is TF's own ``Checkpoint.restore`` (unbound), called with the stripped graph: the psguard
    manager replaces the checkpoint's ``restore`` attribute, and TF's must be reached past it.
    """

    def __init__(self, root: Any, graph: bytes, pending: Mapping[str, np.ndarray], restore: Any) -> None:
        tf = lazy_tf()
        self.pending = tuple(sorted(pending))
        self.sharded_slots = ShardedSlots(root, pending)
        for_tf = [n for n in self.pending if n not in self.sharded_slots.keys]
        self._folder: Path | None = Path(tempfile.mkdtemp(prefix="psguard-deferred-"))  # 0700
        prefix = str(self._folder / "ckpt")
        names = [OBJECT_GRAPH_KEY, *for_tf]
        stripped = strip_restored(graph, pending, not_slots=self.sharded_slots.keys)
        values = [tf.constant(stripped), *(tf.constant(pending[n]) for n in for_tf)]
        device = chief_io_device()
        with tf.device(device):
            tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=values)
        self.status = restore(root, prefix, options=tf.train.CheckpointOptions(experimental_io_device=device))

    def close(self) -> None:
        """Delete the file: values not restored by now are not restored (TF's status says which)."""
        self.sharded_slots.close()
        folder, self._folder = self._folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


#: ``<variable>/.OPTIMIZER_SLOT/<optimizer>/<slot>/.ATTRIBUTES/VARIABLE_VALUE``: a legacy optimizer's slot key.
_SLOT_KEY = re.compile(r"^(?P<var>.+)/\.OPTIMIZER_SLOT/(?P<opt>.+)/(?P<slot>[^/]+)/\.ATTRIBUTES/VARIABLE_VALUE$")


class ShardedSlots:
    """Saved slots of partitioned variables for a tf_keras legacy optimizer that has not created them yet.

    TF gets these wrong (TF 2.21, tf_keras 2.21): its restore creates the slot eagerly for the
    ``ShardedVariable`` (its restoring initializer gives every shard the tensor's first rows), and the
    optimizer, which keys slots by each shard when ``apply_gradients`` or ``_create_all_weights`` gets the
    shards, then creates new slots at their initial values and trains with those: the saved accumulators are
    silently lost, with ``tf.train.CheckpointManager`` as well. So psguard keeps these values out of TF's
    hands and gives each shard's slot its rows when the optimizer creates it (the optimizer's
    ``_restore_slot_variable``, which ``add_slot`` calls for every new slot, is wrapped for that object only).
    """

    def __init__(self, root: Any, pending: Mapping[str, np.ndarray]) -> None:
        # (the optimizer's key of a shard, slot name) -> (checkpoint key, shard, its rows)
        self._waiting: dict[tuple[Any, str], tuple[str, Any, np.ndarray]] = {}
        self._key_of: Any = None
        self._wrapped: list[Any] = []
        slots = {k: m for k in pending if (m := _SLOT_KEY.match(k)) is not None}
        if not slots:
            self.keys: frozenset[str] = frozenset()
            return
        objects = dict(gather_variables(root))
        infos = list_tensors(root)
        optimizers = _objects_by_path(root)
        keys = set()
        for key, m in slots.items():
            var_key = m["var"] + VARIABLE_SUFFIX
            optimizer = optimizers.get(m["opt"])
            info = infos.get(var_key)
            if var_key not in objects or info is None or len(info.shards) < 2 or optimizer is None:
                continue
            var_key_of = _slot_key_function(optimizer)
            if var_key_of is None or not hasattr(unwrap(objects[var_key]), "variables"):
                continue
            value = np.asarray(pending[key])
            for shard in info.shards:
                rows = value[shard.offset : shard.offset + shard.rows]
                self._waiting[(var_key_of(shard.var), m["slot"])] = (key, shard.var, rows)
            keys.add(key)
            self._key_of = var_key_of
            self._wrap(optimizer)
        self.keys = frozenset(keys)

    def _wrap(self, optimizer: Any) -> None:
        if any(o is optimizer for o in self._wrapped):
            return
        original = optimizer._restore_slot_variable

        def restore_slot_variable(slot_name: str, variable: Any, slot_variable: Any) -> None:
            original(slot_name=slot_name, variable=variable, slot_variable=slot_variable)
            waiting = self._waiting.pop((self._key_of(variable), slot_name), None)
            if waiting is not None:
                slot_variable.assign(waiting[2])

        object.__setattr__(optimizer, "_restore_slot_variable", restore_slot_variable)
        self._wrapped.append(optimizer)

    @property
    def unresolved(self) -> list[str]:
        """The keys some of whose shards have not had their slot created yet."""
        return sorted({key for key, _, _ in self._waiting.values()})

    def close(self) -> None:
        """Forget the values and give the optimizers their own method back."""
        self._waiting.clear()
        for optimizer in self._wrapped:
            vars(optimizer).pop("_restore_slot_variable", None)
        self._wrapped.clear()


def _slot_key_function(optimizer: Any) -> Any:
    """The legacy optimizer's own ``_var_key`` (how it files a variable's slots), ``None`` for other kinds."""
    import sys

    if not hasattr(optimizer, "_restore_slot_variable"):
        return None
    for cls in type(optimizer).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "_var_key", None)
        if callable(fn):
            return fn
    return None


def _objects_by_path(root: Any) -> dict[str, Any]:
    """Every trackable under ``root`` by its path in the checkpoint's object graph (``optimizer``, ...)."""
    from tensorflow.python.checkpoint import graph_view, util

    view = graph_view.ObjectGraphView(root)
    objects, _, _, _, names = util.objects_ids_and_slot_variables_and_paths(view)
    return {names[obj]: obj for obj in objects}


class RestoreStatus:
    """What ``checkpoint.restore(psguard_id)`` returns: TF's load status over the tensors TF restores (the
    deferred ones), after psguard assigned every tensor whose variable exists (all or nothing, verified).

    The assertions behave as TF's for a TF checkpoint of the same state: ``assert_consumed`` fails while a
    saved value waits for its variable, ``assert_existing_objects_matched`` fails for a variable of the model
    that the checkpoint does not have. ``checkpoint_id``, ``step`` and ``source`` ("memory" or "durable") say
    what was restored.
    """

    def __init__(self, deferred: DeferredRestore, *, checkpoint_id: str, step: int, source: str) -> None:
        self._status = deferred.status
        self._sharded = deferred.sharded_slots
        self.checkpoint_id = checkpoint_id
        self.step = step
        self.source = source

    def assert_consumed(self) -> RestoreStatus:
        self._status.assert_consumed()
        unresolved = self._sharded.unresolved
        if unresolved:
            raise AssertionError(f"Unresolved slot restorations (partitioned variables): {unresolved}")
        return self

    def assert_existing_objects_matched(self) -> RestoreStatus:
        self._status.assert_existing_objects_matched()
        return self

    def assert_nontrivial_match(self) -> RestoreStatus:
        self._status.assert_nontrivial_match()
        return self

    def expect_partial(self) -> RestoreStatus:
        self._status.expect_partial()
        return self

    def run_restore_ops(self, session: Any = None) -> None:
        """Nothing to run: TF 2 restores eagerly (kept for code written against TF 1's status)."""
        self._status.run_restore_ops(session)

    def initialize_or_restore(self, session: Any = None) -> None:
        self._status.initialize_or_restore(session)

    def __repr__(self) -> str:
        return f"RestoreStatus({self.checkpoint_id!r}, step={self.step}, source={self.source!r})"


def read_pending_parts(files: Mapping[Any, str], homes: Mapping[Any, tuple[str, str]]) -> dict[str, np.ndarray]:
    """The logical tensors of shards that have no variable yet, each shard's restore file read on its own PS
    (``homes``: shard -> (task, dtype)) and sent to the chief; shards of a tensor concatenated by offset.

    The files are one-tensor bundles (:mod:`psguard.handoff.tensor_bundle`): ``RestoreV2`` checks their CRC32C
    and dtype, so a damaged file fails here, before anything is handed to TF.
    """
    tf = lazy_tf()
    by_name: dict[str, list[tuple[int, np.ndarray]]] = {}
    for key, path in files.items():
        task, dtype = homes.get(key, ("", ""))
        job, _, index = task.partition(":")
        if not job or not index.isdigit() or not dtype:
            raise ValueError(f"the snapshot does not say which PS holds {key.label} or its dtype")
        with tf.device(f"/job:{job}/replica:0/task:{index}/device:CPU:0"):
            (value,) = tf.raw_ops.RestoreV2(
                prefix=path, tensor_names=[BUNDLE_KEY], shape_and_slices=[""], dtypes=[tf.as_dtype(dtype)]
            )
        by_name.setdefault(key.name, []).append((key.offset, value.numpy()))
    out: dict[str, np.ndarray] = {}
    for name, pieces in by_name.items():
        pieces.sort(key=lambda p: p[0])
        out[name] = pieces[0][1] if len(pieces) == 1 else np.concatenate([p for _, p in pieces], axis=0)
    return out
