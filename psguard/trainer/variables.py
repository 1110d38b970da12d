"""The variables of a checkpoint's object graph, named by ``tf.train.Checkpoint``'s keys, and their logical
values (a ``ShardedVariable``'s shards concatenated on axis 0, as in a TF checkpoint), so a psguard checkpoint
exports to a standard one and restores under any partitioning. Restores are all or nothing."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from psguard.errors import ConfigError, TensorMismatchError

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
    """One logical tensor of the object graph. ``alias_of``: the tensor owning the same variables when this is a
    second path to them (Keras 3 optimizers track every model shard again), its rows from ``alias_offset``."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype  # type: ignore[type-arg]
    shards: tuple[Shard, ...] = field(repr=False)
    alias_of: str | None = None
    alias_offset: int = 0

    @property
    def partitioning(self) -> tuple[int, ...]:
        """Rows per shard, in order (restore does not need it to match)."""
        return tuple(s.rows for s in self.shards)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (of the whole tensor for a scalar)."""
        return self.nbytes // max(self.shape[0], 1) if self.shape else self.nbytes


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
        elif not isinstance(var, lazy_tf().Variable) and (inner := _keras3_inner(var)) is not None:
            var = inner
        else:
            return chain
        chain.append(var)
    raise ConfigError(f"cannot find the resource variable inside {type(var).__name__}")


def _keras3_inner(obj: Any) -> Any:
    """The variable a Keras 3 ``keras.Variable`` on the TensorFlow backend wraps (``None``: not one)."""
    inner = getattr(obj, "_value", None)
    return inner if inner is not None and (isinstance(inner, lazy_tf().Variable) or _is_sharded(inner)) else None


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


def graph_objects(root: Any) -> list[tuple[Any, str]]:
    """Every trackable under ``root`` and its path in the checkpoint's object graph, by TF's own traversal."""
    from tensorflow.python.checkpoint import graph_view, util

    objects, _, _, _, names = util.objects_ids_and_slot_variables_and_paths(graph_view.ObjectGraphView(root))
    return [(obj, names[obj]) for obj in objects]


def gather_variables(root: Any) -> list[tuple[str, Any]]:
    """(checkpoint key, variable-like object) for every variable a ``tf.train.Checkpoint`` of ``root`` saves,
    found by TF's own traversal so that names are exactly the checkpoint keys."""
    found: list[tuple[str, Any]] = []
    unsupported: list[str] = []
    tf = lazy_tf()
    for obj, name in graph_objects(root):
        if _is_sharded(obj) or isinstance(obj, tf.Variable) or _keras3_inner(obj) is not None:
            found.append((name + VARIABLE_SUFFIX, obj))
        elif _has_state(obj):
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
            rows = int(chain[-1].shape[0]) if chain[-1].shape.rank else 1
            shards.append(Shard(chain[-1], offset, rows, tuple(chain)))
            offset += rows
        dtype = shards[0].var.dtype
        dtype = np.dtype(object) if dtype == lazy_tf().string else np.dtype(dtype.as_numpy_dtype)
        infos.append(TensorInfo(name, tuple(int(d) for d in inner.shape), dtype, tuple(shards)))
    # Aliases: tensors whose variables all belong, contiguously, to another, the one with the most shards (the
    # logical ShardedVariable), ties broken by graph order (a stable sort).
    owner: dict[int, tuple[str, int]] = {}  # id(resource variable) -> (owning tensor, its first row there)
    result: dict[str, TensorInfo] = {}
    for info in sorted(infos, key=lambda info: -len(info.shards)):
        homes = [owner.get(id(s.var)) for s in info.shards]
        target = homes[0][0] if homes[0] is not None else None
        contiguous = target is not None and all(
            h is not None and h[0] == target and h[1] == homes[0][1] + s.offset  # type: ignore[index]
            for h, s in zip(homes, info.shards, strict=True)
        )
        if contiguous and target is not None and homes[0] is not None:
            result[info.name] = replace(info, alias_of=target, alias_offset=homes[0][1])
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
    """Read every logical tensor whole to the chief (shards concatenated), for tests."""
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
    """``t``'s value as an array; a scalar string as an ``object`` array (dtype ``S`` drops trailing NULs)."""
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
        shape, dtype = value if isinstance(value, tuple) else (np.shape(value), np.asarray(value).dtype)
        if shape != info.shape or dtype != info.dtype:
            problems.append((name, f"{name}: checkpoint has {shape} {dtype}, model has {info.shape} {info.dtype}"))
    for name, value in tensors.items():
        if name not in infos:
            slot = "optimizer" in name.lower() or ".OPTIMIZER_SLOT" in name
            hint = " (is the optimizer built before restoring? Its slots exist only after build())" if slot else ""
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
    """``root``'s tensors, once each has a value of its shape and dtype in ``tensors`` or ``elsewhere`` (restored
    by another path) and nothing is left over, else :class:`TensorMismatchError`. ``deferred``: saved tensors
    that may get a variable later (not a mismatch by themselves)."""
    infos = list_tensors(root)
    found = _check(infos, {**tensors, **(elsewhere or {}), **(deferred or {})})
    _refuse([text for _, text in found] if any(n not in (deferred or {}) for n, _ in found) else [])
    return infos


def _refuse(problems: list[str]) -> None:
    if problems:
        raise TensorMismatchError(
            f"{len(problems)} tensor(s) do not match between the checkpoint and the model:\n  " + "\n  ".join(problems)
        )


def restore(
    root: Any,
    tensors: Mapping[str, np.ndarray],
    *,
    elsewhere: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None = None,  # type: ignore[type-arg]
    deferred: Mapping[str, Shape] | None = None,
) -> dict[str, TensorInfo]:
    """Assign logical tensors into ``root``'s variables, whatever their partitioning; all or nothing (every
    variable gets a value, every tensor lands, or :class:`TensorMismatchError` lists each mismatch).
    ``deferred``: values whose variables do not exist yet. A ``Capturer`` of ``root`` must rebase after."""
    infos = check_tensors(root, tensors, elsewhere=elsewhere, deferred=deferred)
    _assign(infos, {n: v for n, v in tensors.items() if n in infos and n not in (elsewhere or {})})
    return infos


def assign_existing(root: Any, tensors: Mapping[str, np.ndarray]) -> list[str]:
    """Assign those of ``tensors`` that ``root`` has a variable for now, checked first; return their names.
    (TF's restoring initializer gives every shard of a partitioned slot the tensor's first rows.)"""
    infos = list_tensors(root)
    present = {n: v for n, v in tensors.items() if n in infos}
    _refuse([text for name, text in _check(infos, present) if name in present])
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
    """The part of logical tensor ``value`` that ``shard`` holds, in its variable's own shape."""
    whole: np.ndarray = np.asarray(value)
    part = whole[shard.offset : shard.offset + shard.rows] if info.shape else whole
    return part.reshape(tuple(int(d) for d in shard.var.shape))
