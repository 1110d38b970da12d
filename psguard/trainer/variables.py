"""The variables of a checkpoint's object graph, as ``tf.train.Checkpoint`` names them, and their logical values.

Names are the keys ``tf.train.Checkpoint`` uses for the same object graph
(``model/embedding/.ATTRIBUTES/VARIABLE_VALUE``, ``model/emb/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/...``),
and the value of a ``ShardedVariable`` is its logical tensor (shards concatenated on axis 0), as in a TF
checkpoint; so a psguard checkpoint can be exported to a standard one and restored under any partitioning.
Restores are all-or-nothing: every mismatch is listed before anything is assigned.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psguard.errors import ConfigError, TensorMismatchError

__all__ = [
    "VARIABLE_SUFFIX",
    "Shard",
    "TensorInfo",
    "bitwise_equal",
    "gather_variables",
    "list_tensors",
    "read_tensors",
    "restore",
]

log = logging.getLogger(__name__)

VARIABLE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


@dataclass(frozen=True)
class Shard:
    var: Any  # the innermost resource variable (no CachingVariable / Keras wrapper in between)
    offset: int  # first logical row
    rows: int
    # Every object from the one the object graph holds down to ``var``: writers may go through any of them
    # (a CachingVariable is a resource variable itself and writes through the handle, not through ``var``).
    chain: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    @property
    def device(self) -> str:
        return str(self.var.device)


@dataclass(frozen=True)
class TensorInfo:
    """One logical tensor of the object graph: what a manifest records and what restore checks against.

    ``alias_of`` names the tensor that owns the same variables when this one is a second path to them
    (Keras 3 optimizers track every model shard again under ``optimizer/_trainable_variables/N``); its
    rows are ``alias_offset`` to ``alias_offset + shape[0]`` of that tensor, and it is captured from that
    tensor's result, never read twice.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype  # type: ignore[type-arg]
    shards: tuple[Shard, ...] = field(repr=False)
    alias_of: str | None = None
    alias_offset: int = 0

    @property
    def partitioning(self) -> tuple[int, ...]:
        """Rows per shard, in order: how the tensor is laid out now (restore does not need it to match)."""
        return tuple(s.rows for s in self.shards)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(s.device for s in self.shards)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


# --------------------------------------------------------------------------------------------- object graph


def lazy_tf() -> Any:
    import tensorflow as tf

    return tf


def unwrap(var: Any) -> Any:
    """The resource variable under PS-strategy and Keras 3 wrappers, which is what lives on the PS."""
    return _chain(var)[-1]


def _chain(var: Any) -> list[Any]:
    """``var``, the wrappers inside it, and last the resource variable (or ShardedVariable) they wrap."""
    from tensorflow.python.distribute import ps_values

    chain = [var]
    for _ in range(16):
        if isinstance(var, (ps_values.CachingVariable, ps_values.AggregatingVariable)):
            var = var.get()
            chain.append(var)
            continue
        inner = getattr(var, "_value", None) if not isinstance(var, lazy_tf().Variable) else None
        if inner is not None and (isinstance(inner, lazy_tf().Variable) or _is_sharded(inner)):
            var = inner  # Keras 3 `keras.Variable` on the TensorFlow backend
            chain.append(var)
            continue
        return chain
    raise ConfigError(f"cannot find the resource variable inside {type(var).__name__}")


def _is_sharded(obj: Any) -> bool:
    from tensorflow.python.distribute import sharded_variable

    return isinstance(obj, sharded_variable.ShardedVariableMixin)


def _has_state(obj: Any) -> bool:
    """True for trackables that put tensors in a TF checkpoint (and so would be lost if we skipped them)."""
    from tensorflow.python.training.saving import saveable_object_util

    if saveable_object_util.trackable_has_serialize_to_tensor(obj):
        return True
    try:
        return bool(obj._gather_saveables_for_checkpoint())
    except (AttributeError, NotImplementedError):
        return False


def _numpy_dtype(var: Any) -> np.dtype:  # type: ignore[type-arg]
    tf = lazy_tf()
    if var.dtype == tf.string:
        return np.dtype(object)
    dtype: np.dtype = np.dtype(var.dtype.as_numpy_dtype)  # type: ignore[type-arg]
    return dtype


def gather_variables(root: Any) -> list[tuple[str, Any]]:
    """(checkpoint key, variable-like object) for every variable a ``tf.train.Checkpoint`` of ``root`` saves.

    Uses TF's own traversal (``objects_ids_and_slot_variables_and_paths``) so that names, slot-variable
    names included, are exactly the checkpoint keys.
    """
    from tensorflow.python.checkpoint import graph_view, util

    view = graph_view.ObjectGraphView(root)
    objects, _, _, _, names = util.objects_ids_and_slot_variables_and_paths(view)
    found: list[tuple[str, Any]] = []
    unsupported: list[str] = []
    tf = lazy_tf()
    for obj in objects:
        name = names[obj]
        if _is_sharded(obj) or isinstance(obj, tf.Variable):
            found.append((name + VARIABLE_SUFFIX, obj))
            continue
        inner = getattr(obj, "_value", None)
        if inner is not None and (isinstance(inner, tf.Variable) or _is_sharded(inner)):
            found.append((name + VARIABLE_SUFFIX, obj))
            continue
        if _has_state(obj):
            unsupported.append(f"{name or '(root)'} ({type(obj).__name__})")
    if unsupported:
        raise ConfigError(
            "psguard captures variables only; these objects also save state in a TF checkpoint and would be "
            "lost: " + ", ".join(unsupported) + ". Keep them out of the checkpointed object graph (record a "
            "data position as a counter variable instead of an iterator)."
        )
    return found


def list_tensors(root: Any) -> dict[str, TensorInfo]:
    """Every logical tensor of ``root``'s checkpoint, keyed by its checkpoint key, aliases marked."""
    infos: list[TensorInfo] = []
    for name, obj in gather_variables(root):
        outer = _chain(obj)
        inner = outer[-1]
        parts = list(inner.variables) if _is_sharded(inner) else [inner]
        shards: list[Shard] = []
        offset = 0
        for part in parts:
            chain = _chain(part) if _is_sharded(inner) else outer
            var = chain[-1]
            shape = tuple(int(d) for d in var.shape)
            rows = shape[0] if shape else 1
            shards.append(Shard(var, offset, rows, tuple(chain)))
            offset += rows
        first = shards[0].var
        shape = tuple(int(d) for d in inner.shape)
        infos.append(TensorInfo(name, shape, _numpy_dtype(first), tuple(shards)))
    return _mark_aliases(infos)


def _mark_aliases(infos: list[TensorInfo]) -> dict[str, TensorInfo]:
    """Mark tensors whose variables all belong, contiguously, to another (larger) tensor.

    The owner is the tensor with the most shards (the logical ShardedVariable), ties broken by graph order,
    so the choice does not depend on which path the traversal found first.
    """
    order = sorted(range(len(infos)), key=lambda i: (-len(infos[i].shards), i))
    owner: dict[int, tuple[str, int]] = {}  # id(resource variable) -> (owning tensor, its first row there)
    result: dict[str, TensorInfo] = {}
    for i in order:
        info = infos[i]
        homes = [owner.get(id(s.var)) for s in info.shards]
        target = homes[0][0] if homes[0] is not None else None
        contiguous = target is not None and all(
            h is not None and h[0] == target and h[1] == homes[0][1] + s.offset  # type: ignore[index]
            for h, s in zip(homes, info.shards, strict=True)
        )
        if contiguous and target is not None and homes[0] is not None:
            result[info.name] = TensorInfo(
                info.name, info.shape, info.dtype, info.shards, alias_of=target, alias_offset=homes[0][1]
            )
            continue
        for s in info.shards:
            owner.setdefault(id(s.var), (info.name, s.offset))
        result[info.name] = info
    return {info.name: result[info.name] for info in infos}


# --------------------------------------------------------------------------------------------- read / restore


def writable(a: np.ndarray) -> np.ndarray:
    """Stores apply later deltas in place, so what we hand out must be writable (and ours)."""
    return a if a.flags.writeable else np.array(a, copy=True)


def concat_parts(parts: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return writable(value.reshape(shape))


def read_tensors(root: Any) -> dict[str, np.ndarray]:
    """Read every logical tensor whole (shards concatenated), for tests, export and full snapshots.

    This reads everything to the chief, shard by shard; a capture reads only what changed.
    """
    infos = list_tensors(root)
    values: dict[str, np.ndarray] = {}
    for name, info in infos.items():
        if info.alias_of is None:
            values[name] = concat_parts([to_numpy(s.var.read_value()) for s in info.shards], info.shape)
    for name, info in infos.items():
        if info.alias_of is not None:
            values[name] = values[info.alias_of][info.alias_offset : info.alias_offset + info.shape[0]].copy()
    return {name: values[name] for name in infos}


def bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same shape, dtype and bytes: ``-0.0 != 0.0`` and NaNs compare by payload, as a restore must keep them."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == np.dtype(object):
        return bool(a.tolist() == b.tolist())
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def to_int(value: Any) -> int:
    """An int from an int, a numpy scalar, or an integer variable or tensor (TF's ``checkpoint_number``)."""
    return int(np.asarray(value.numpy() if hasattr(value, "numpy") else value))


def to_numpy(t: Any) -> np.ndarray:
    """``t``'s value as an array; a scalar string (``numpy()`` gives ``bytes``) as an ``object`` array, since a
    fixed-width numpy string (dtype ``S``) would drop its trailing NUL bytes."""
    value = t.numpy()
    if isinstance(value, np.ndarray):
        return value
    return np.array(value, dtype=object) if isinstance(value, bytes) else np.asarray(value)


def _check(infos: Mapping[str, TensorInfo], tensors: Mapping[str, Described]) -> list[tuple[str, str]]:
    """(tensor name, what is wrong) for every mismatch."""
    problems: list[tuple[str, str]] = []
    for name, info in infos.items():
        if name not in tensors:
            problems.append((name, f"{name}: missing from the checkpoint (model has {info.shape} {info.dtype})"))
            continue
        value = tensors[name]
        if isinstance(value, tuple):
            shape, dtype = value
        else:
            value = np.asarray(value)
            shape, dtype = tuple(int(d) for d in value.shape), value.dtype
        if shape != info.shape or dtype != info.dtype:
            problems.append((name, f"{name}: checkpoint has {shape} {dtype}, model has {info.shape} {info.dtype}"))
    for name in tensors:
        if name not in infos:
            value = tensors[name]
            hint = (
                " (is the optimizer built before restoring? Its slots exist only after build())"
                if "optimizer" in name.lower() or ".OPTIMIZER_SLOT" in name
                else ""
            )
            shape = value[0] if isinstance(value, tuple) else np.shape(value)
            problems.append((name, f"{name}: in the checkpoint ({shape}) but not in the model{hint}"))
    return problems


#: A tensor as ``_check`` compares it: its value, or (shape, dtype) when it is restored by another path.
Described = np.ndarray | tuple[tuple[int, ...], np.dtype]  # type: ignore[type-arg]
#: A tensor described without its value: (shape, dtype).
Shape = tuple[tuple[int, ...], np.dtype]  # type: ignore[type-arg]


def check_tensors(
    root: Any,
    tensors: Mapping[str, np.ndarray],
    *,
    elsewhere: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None = None,  # type: ignore[type-arg]
    deferred: Mapping[str, Shape] | None = None,
) -> dict[str, TensorInfo]:
    """``root``'s tensors, once every one of them is shown to have a value of its shape and dtype (either in
    ``tensors`` or, restored by another path, in ``elsewhere``) and nothing is left over; else
    :class:`TensorMismatchError` listing every mismatch.

    ``deferred``: saved tensors with no variable in the model that may get one later (TF's deferred
    restoration): not a mismatch by themselves, but listed with the others when the model does not match.
    """
    infos = list_tensors(root)
    found = _check(infos, {**tensors, **(elsewhere or {}), **(deferred or {})})
    problems = [text for _, text in found] if any(n not in (deferred or {}) for n, _ in found) else []
    if problems:
        raise TensorMismatchError(
            f"{len(problems)} tensor(s) do not match between the checkpoint and the model:\n  " + "\n  ".join(problems)
        )
    return infos


def restore(
    root: Any,
    tensors: Mapping[str, np.ndarray],
    *,
    elsewhere: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None = None,  # type: ignore[type-arg]
    deferred: Mapping[str, Shape] | None = None,
) -> dict[str, TensorInfo]:
    """Assign logical tensors into ``root``'s variables, whatever their current partitioning.

    All or nothing on names, shapes and dtypes: every variable must get a value and every saved tensor
    must land somewhere, otherwise :class:`TensorMismatchError` lists every mismatch and nothing is
    assigned. (TF's own restore leaves unmatched values pending without a word; the manager hands values whose
    variables do not exist yet to TF's deferred restoration explicitly, as ``deferred``.)
    A ``Capturer`` of the same root must be rebased afterwards; :meth:`Capturer.restore` does both.
    """
    infos = check_tensors(root, tensors, elsewhere=elsewhere, deferred=deferred)
    _assign(infos, {n: v for n, v in tensors.items() if n in infos and n not in (elsewhere or {})})
    return infos


def assign_existing(root: Any, tensors: Mapping[str, np.ndarray]) -> list[str]:
    """Assign those of ``tensors`` that ``root`` has a variable for now, whatever its partitioning; return
    their names. Names, shapes and dtypes are checked first (:class:`TensorMismatchError`, nothing assigned).

    For values that TF's deferred restoration assigned on creation, again, exactly: TF's restoring
    initializer gives every shard of a partitioned slot the logical tensor's first rows.
    """
    infos = list_tensors(root)
    present = {n: v for n, v in tensors.items() if n in infos}
    problems = [text for name, text in _check(infos, present) if name in present]
    if problems:
        raise TensorMismatchError(
            f"{len(problems)} tensor(s) do not match between the checkpoint and the model:\n  " + "\n  ".join(problems)
        )
    _assign(infos, present)
    return sorted(present)


def _assign(infos: Mapping[str, TensorInfo], tensors: Mapping[str, np.ndarray]) -> None:
    """Each logical tensor into the shards of its variable (aliases are assigned through their owner)."""
    for name, raw in tensors.items():
        info = infos[name]
        if info.alias_of is not None:
            continue
        value = np.asarray(raw)
        for s in info.shards:
            s.var.assign(shard_part(value, info, s))


def shard_part(value: Any, info: TensorInfo, shard: Shard) -> np.ndarray:
    """The part of logical tensor ``value`` that ``shard`` holds, in its variable's own shape (a scalar or a
    partitioned table's rows alike): what an assign of that one shard takes."""
    whole: np.ndarray = np.asarray(value)
    part = whole[shard.offset : shard.offset + shard.rows] if info.shape else whole
    return part.reshape(tuple(int(d) for d in shard.var.shape))
