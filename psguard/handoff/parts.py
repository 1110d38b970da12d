"""What the trainer, the chief's agent and each PS's agent say about the shards a PS holds.

The bytes of a sharded variable stay on the node of the PS that hosts them (docs/design.md, "Where the data
flows"): the capture function on each PS device writes that PS's changed rows as tensor files into the *part
folder* of that PS's agent; only these small descriptors travel through the chief. A restore goes the other way.
Part folder of task ``ps:i`` of job ``J``: ``/dev/shm/psguard-J-ps-i`` (:func:`psguard.handoff.spool.part_dir`),
owner-only, whose contents only that PS's agent deletes::

    incoming/<nonce>/<t>-<s>.{full,ids,rows}   a capture's files for tensor t, shard s (written by TF on the PS)
    restore/<nonce>/<k>.{index,data-00000-of-00001}
                                               a restore's values: a one-tensor TF bundle (written by the agent
                                               without TF, :mod:`psguard.handoff.tensor_bundle`; RestoreV2 on the PS)

A capture writes all three files of every shard (the unused ones an empty tensor): the kind is decided inside the
capture function, and three tiny writes cost less than a conditional in the graph.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from psguard.codec.strict_json import JsonFields, fields_json
from psguard.errors import CorruptCheckpointError, TensorMismatchError

Kind = Literal["full", "rows", "same"]
_TASK_RE = re.compile(r"^ps:[0-9]{1,6}$")
_NONCE_RE = re.compile(r"^[0-9a-f]{16}$")
_DEVICE_RE = re.compile(r"/job:([a-z]+)/(?:replica:[0-9]+/)?task:([0-9]+)")
_MAX_DIM = 1 << 48


def task_of_device(device: str) -> str | None:
    """``ps:1`` for ``/job:ps/replica:0/task:1/device:CPU:0``; None for a device of no PS task."""
    m = _DEVICE_RE.search(device)
    return f"ps:{int(m.group(2))}" if m and m.group(1) == "ps" else None


@dataclass(frozen=True)
class ShardKey:
    """Rows [offset, offset + rows) of logical tensor ``name``: what one PS holds of it."""

    name: str
    offset: int
    rows: int

    @property
    def label(self) -> str:
        return f"{self.name}[{self.offset}:{self.offset + self.rows}]"


@dataclass(frozen=True)
class ShardFiles:
    """One shard's part of a capture: what changed, and under which file stem (``<stem>.full`` etc.)."""

    key: ShardKey
    shape: tuple[int, ...]  # the logical tensor's
    dtype: str
    kind: Kind
    count: int  # rows in the files: ``rows`` for full, the changed rows for rows, 0 for same
    stem: str
    #: ``<stem>.fps`` holds the rows' fingerprints (int64, ``count`` of them) as the capture stored them on the
    #: PS; absent from parts of older trainers (their agent then has none, and a restore hashes the rows).
    fps: bool = False

    def to_json(self) -> dict[str, Any]:
        doc = {"name": self.key.name, "offset": self.key.offset, "rows": self.key.rows}
        return doc | {k: v for k, v in fields_json(self).items() if k != "key" and (k != "fps" or v)}

    @classmethod
    def from_json(cls, doc: Any, what: str) -> ShardFiles:
        if not isinstance(doc, Mapping):
            raise CorruptCheckpointError(f"{what}: a shard entry is not an object")
        name, dtype, kind, stem = (doc.get(k) for k in ("name", "dtype", "kind", "stem"))
        nums = [doc.get(k) for k in ("offset", "rows", "count")]
        shape = doc.get("shape")
        if (
            not isinstance(name, str)
            or not name
            or not isinstance(dtype, str)
            or kind not in ("full", "rows", "same")
            or not isinstance(stem, str)
            or not re.match(r"^[0-9]{1,6}-[0-9]{1,6}$", stem)
            or not all(type(n) is int and 0 <= n < _MAX_DIM for n in nums)
            or not isinstance(shape, list)
            or not 1 <= len(shape) <= 32
            or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape)
        ):
            raise CorruptCheckpointError(f"{what}: malformed shard entry")
        offset, rows, count = (int(n) for n in nums)  # type: ignore[arg-type]  # all checked to be int above
        if offset + rows > shape[0] or count > rows or (kind == "full" and count != rows) or (kind == "same" and count):
            raise CorruptCheckpointError(f"{what}: shard {name}[{offset}:{offset + rows}] does not fit {shape}")
        key = ShardKey(name, offset, rows)
        return cls(key, tuple(shape), dtype, kind, count, stem, doc.get("fps") is True)  # type: ignore[arg-type]


@dataclass(frozen=True)
class PartCapture(JsonFields):
    """One PS's share of a capture: the folder its files are in and one entry per shard it hosts."""

    task: str
    nonce: str
    shards: tuple[ShardFiles, ...]

    @classmethod
    def from_json(cls, doc: Any, what: str) -> PartCapture:
        if not isinstance(doc, Mapping):
            raise CorruptCheckpointError(f"{what}: a part is not an object")
        task, nonce, shards = doc.get("task"), doc.get("nonce"), doc.get("shards")
        if not isinstance(task, str) or not _TASK_RE.match(task):
            raise CorruptCheckpointError(f"{what}: bad part task {task!r}")
        if not isinstance(nonce, str) or not _NONCE_RE.match(nonce):
            raise CorruptCheckpointError(f"{what}: bad part folder name")
        if not isinstance(shards, list):
            raise CorruptCheckpointError(f"{what}: part shards is not a list")
        parsed = tuple(ShardFiles.from_json(s, f"{what} {task}") for s in shards)
        if len({s.key for s in parsed}) != len(parsed) or len({s.stem for s in parsed}) != len(parsed):
            raise CorruptCheckpointError(f"{what}: a shard appears twice in the part of {task}")
        return cls(task, nonce, parsed)


def is_ps_task(task: str) -> bool:
    return bool(_TASK_RE.match(task))


def parts_from_json(docs: Any, what: str) -> list[PartCapture]:
    if not isinstance(docs, list):
        raise CorruptCheckpointError(f"{what}: parts is not a list")
    parts = [PartCapture.from_json(d, what) for d in docs]
    if len({p.task for p in parts}) != len(parts):
        raise CorruptCheckpointError(f"{what}: a task has two parts")
    return parts


def check_restore_files(
    placed: Mapping[ShardKey, str], files: Mapping[ShardKey, str], homes: Mapping[ShardKey, str] | None
) -> None:
    """A PS-side restore's files against the model's shards (``placed``: shard -> the PS task the model put it
    on): one file per shard, no other; and (``homes``: shard -> the PS whose agent wrote its file) each on its
    own PS's node, since each PS reads only its own node's files. :class:`TensorMismatchError` otherwise."""
    missing = sorted(k.label for k in placed.keys() - files.keys())
    extra = sorted(k.label for k in files.keys() - placed.keys())
    if missing or extra:
        raise TensorMismatchError(
            f"the PS-side snapshot does not match the model's shards: missing {missing[:5]} "
            f"({len(missing)}), not in the model {extra[:5]} ({len(extra)}); was the number of PS changed?"
        )
    moved = [
        f"{k.label} on {task}, its file on {homes[k]}'s node"
        for k, task in placed.items()
        if homes and k in homes and homes[k] != task
    ]
    if moved:
        raise TensorMismatchError(
            f"the model placed {len(moved)} shard(s) on another PS than the one that captured them "
            f"({moved[:3]}): each PS reads only its own node's files"
        )
