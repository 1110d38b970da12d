"""What a capture's per-shard outputs become: one update per tensor (its changed rows, all of it, or nothing), the
descriptors of what the PS nodes wrote themselves, and what the capture cost (:class:`CaptureStats`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from psguard.codec.dtypes import dtype_name
from psguard.handoff.parts import Kind, PartCapture, ShardFiles, ShardKey, task_of_device
from psguard.tensors import Full, Rows, Same, TensorUpdate
from psguard.trainer.variables import TensorInfo, concat_parts, to_numpy, writable


class Primary(Protocol):
    """A tensor the capture function answered for (the capturer's tracked tensor)."""

    info: TensorInfo
    by_row: bool
    spill: bool  # its shards were written to files on their PS nodes


@dataclass
class CaptureStats:
    """What the last capture cost: ``capture_seconds`` is the stall (from the drained coordinator to the capture
    in host memory), ``bytes_read`` what travelled PS -> chief; what went whole (``full``) and by rows."""

    capture_seconds: float = 0.0
    bytes_read: int = 0
    logical_bytes: int = 0
    full: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    #: Row-tracked tensors whose every row was hashed (not only the rows written since the last capture).
    hashed_all: list[str] = field(default_factory=list)
    #: Tensors where a sample of rows not marked as written had changed all the same (see ``probe_rows``).
    untracked_writes: list[str] = field(default_factory=list)
    #: Rows written to files on the PS nodes instead (``spill_dirs``): they never reached the chief.
    rows_spilled: int = 0


def assemble(
    primaries: Sequence[Primary], outputs: Any, infos: Mapping[str, TensorInfo]
) -> tuple[dict[str, TensorUpdate], int]:
    """One update per logical tensor from per-shard results: when only some shards were sent whole, a Rows
    update of those shards' every row and the other shards' changed rows."""
    updates: dict[str, TensorUpdate] = {}
    nbytes = 0
    for tr, outs in zip(primaries, outputs, strict=True):
        info = tr.info
        if tr.spill:
            continue  # in files on the PS nodes: see part_files
        arrays = [[to_numpy(t) for t in shard_out] for shard_out in outs]
        nbytes += sum(a.nbytes for shard_out in arrays for a in shard_out)
        sent_all = [bool(a[0]) for a in arrays]
        if all(sent_all):
            updates[info.name] = Full(concat_parts([a[1] for a in arrays], info.shape))
            continue
        ids: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for a, s, whole in zip(arrays, info.shards, sent_all, strict=True):
            if whole:
                ids.append(np.arange(s.offset, s.offset + s.rows, dtype=np.int64))
                values.append(a[1].reshape((s.rows, *info.shape[1:])))
            elif tr.by_row and a[2].size:
                ids.append(a[2] + s.offset)
                values.append(a[3])
        if not ids:
            updates[info.name] = Same(info.shape, info.dtype)
            continue
        updates[info.name] = Rows(
            np.concatenate(ids) if len(ids) > 1 else ids[0],
            writable(np.concatenate(values) if len(values) > 1 else values[0]),
            info.shape,
        )
    for name, info in infos.items():
        if info.alias_of is not None:
            updates[name] = _slice_update(updates[info.alias_of], info)
    return {name: updates[name] for name in infos if name in updates}, nbytes


def part_files(primaries: Sequence[Primary], outputs: Any, nonce: str) -> list[PartCapture]:
    """The descriptors of what the capture wrote on each PS node (small: a few numbers per shard)."""
    by_task: dict[str, list[ShardFiles]] = {}
    for i, (tr, outs) in enumerate(zip(primaries, outputs, strict=True)):
        if not tr.spill:
            continue
        for j, (s, out) in enumerate(zip(tr.info.shards, outs, strict=True)):
            sent_all, count = bool(to_numpy(out[0])), int(to_numpy(out[1]))
            kind: Kind = "full" if sent_all else "rows" if count else "same"
            task = task_of_device(str(s.device)) or ""
            by_task.setdefault(task, []).append(
                ShardFiles(
                    ShardKey(tr.info.name, s.offset, s.rows),
                    tuple(tr.info.shape),
                    dtype_name(tr.info.dtype),
                    kind,
                    s.rows if sent_all else count,
                    f"{i}-{j}",
                    fps=True,  # capture_fn writes them for every spilled shard
                )
            )
    return [PartCapture(task, nonce, tuple(shards)) for task, shards in sorted(by_task.items())]


def capture_stats(
    infos: Mapping[str, TensorInfo], updates: Mapping[str, TensorUpdate], seconds: float, nbytes: int
) -> CaptureStats:
    """What the capture cost and what it sent of each tensor (aliases are their owners')."""
    stats = CaptureStats(capture_seconds=seconds, bytes_read=nbytes)
    for name, u in updates.items():
        if infos[name].alias_of is None:
            stats.logical_bytes += infos[name].nbytes
            if isinstance(u, Full):
                stats.full.append(name)
            elif isinstance(u, Rows):
                stats.rows[name] = len(u.ids)
    return stats


def _slice_update(update: TensorUpdate, info: TensorInfo) -> TensorUpdate:
    """The update of an alias, cut from its owner's update (copies: stores may modify arrays in place)."""
    lo, hi = info.alias_offset, info.alias_offset + (info.shape[0] if info.shape else 1)
    if isinstance(update, Full):
        return Full(np.array(update.value[lo:hi], copy=True).reshape(info.shape))
    if isinstance(update, Rows):
        mask = (update.ids >= lo) & (update.ids < hi)
        if not mask.any():
            return Same(info.shape, info.dtype)
        return Rows(update.ids[mask] - lo, update.values[mask], info.shape)
    return Same(info.shape, info.dtype)
