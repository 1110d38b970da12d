"""TF's restore idioms on psguard checkpoints: the status object, and deferred restoration done by TF itself.

Jobs restore with ``checkpoint.restore(manager.latest_checkpoint)``, check the status, and often create some
variables only later (optimizer slots, layers built at their first call), which TF restores when they are created.
psguard assigns what it can now on its own paths and hands the rest to TF's own machinery: the checkpoint's object
graph, stripped of every tensor psguard assigned, is written with the pending tensors as a small TF checkpoint in a
private folder, which TF's ``Checkpoint.restore`` reads on the chief. The folder lives until nothing is pending
(checked at each save) or the manager closes.
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
from psguard.trainer.variables import VARIABLE_SUFFIX, gather_variables, graph_objects, lazy_tf, list_tensors, unwrap

log = logging.getLogger(__name__)


def strip_restored(graph: bytes, pending: Mapping[str, Any], *, not_slots: Collection[str] = ()) -> bytes:
    """TF's object graph ``graph`` with only the attributes of ``pending`` keys (and ``has_checkpoint_values``
    cleared), so TF binds what psguard assigned and reads it from nowhere; slots of ``not_slots`` dropped."""
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
    return bytes(proto.SerializeToString(deterministic=True))


class DeferredRestore:
    """A private folder holding the pending tensors as a TF checkpoint, and TF's restore of it (``restore``: TF's
    own ``Checkpoint.restore``, unbound, past the manager's)."""

    def __init__(self, root: Any, graph: bytes, pending: Mapping[str, np.ndarray], restore: Any) -> None:
        from tensorflow.python.eager import context

        tf = lazy_tf()
        self.pending = tuple(sorted(pending))
        self.sharded_slots = ShardedSlots(root, pending)
        for_tf = [n for n in self.pending if n not in self.sharded_slots.keys]
        self._folder: Path | None = Path(tempfile.mkdtemp(prefix="psguard-deferred-"))  # 0700
        prefix = str(self._folder / "ckpt")
        names = [OBJECT_GRAPH_KEY, *for_tf]
        stripped = strip_restored(graph, pending, not_slots=self.sharded_slots.keys)
        values = [tf.constant(stripped), *(tf.constant(pending[n]) for n in for_tf)]
        device = f"{context.context().host_address_space()}/device:CPU:0"  # only the chief's node has the file
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

    TF 2.21 loses these (its restore makes one slot for the ``ShardedVariable``, the optimizer then makes new
    ones per shard), so psguard gives each shard's slot its rows when the optimizer creates it, by wrapping that
    optimizer's ``_restore_slot_variable``.
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
        optimizers = {path: obj for obj, path in graph_objects(root)}
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


class RestoreStatus:
    """What ``checkpoint.restore(psguard_id)`` returns: TF's status over the deferred tensors, whose assertions
    behave as for a TF checkpoint of the same state; ``checkpoint_id``, ``step`` and ``source`` say what was
    restored."""

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

    def __getattr__(self, name: str) -> Any:
        """TF's other status methods (``expect_partial``, ``assert_existing_objects_matched``...), chaining on this."""
        method = getattr(self._status, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return self if result is self._status else result

        return call

    def __repr__(self) -> str:
        return f"RestoreStatus({self.checkpoint_id!r}, step={self.step}, source={self.source!r})"


def read_pending_parts(files: Mapping[Any, str], homes: Mapping[Any, tuple[str, str]]) -> dict[str, np.ndarray]:
    """The logical tensors of shards that have no variable yet, each shard's bundle read (CRC32C checked) on its
    own PS (``homes``: shard -> (task, dtype)) and concatenated on the chief."""
    tf = lazy_tf()
    by_name: dict[str, list[np.ndarray]] = {}
    for key, path in sorted(files.items(), key=lambda kv: kv[0].offset):
        task, dtype = homes.get(key, ("", ""))
        job, _, index = task.partition(":")
        if not job or not index.isdigit() or not dtype:
            raise ValueError(f"the snapshot does not say which PS holds {key.label} or its dtype")
        with tf.device(f"/job:{job}/replica:0/task:{index}/device:CPU:0"):
            (value,) = tf.raw_ops.RestoreV2(
                prefix=path, tensor_names=[BUNDLE_KEY], shape_and_slices=[""], dtypes=[tf.as_dtype(dtype)]
            )
        by_name.setdefault(key.name, []).append(value.numpy())
    return {name: p[0] if len(p) == 1 else np.concatenate(p, axis=0) for name, p in by_name.items()}
