"""The hand-off between the trainer and the agent on its node: a spool folder on tmpfs (both ends' format).

The trainer's end is :class:`psguard.trainer.spool_writer.SpoolWriter`; the agent's is
:class:`psguard.agent.tiers.spool_server.SpoolServer`. This module holds what both must agree on: the layout, the
records and the file format.

Why files on tmpfs rather than a socket or shared-memory segments: a capture must survive either side being
killed at any moment, and must be picked up by whichever agent runs next. A folder made visible by one atomic
``rename`` gives that for free (no half capture is ever visible, and unprocessed captures wait in order for
the next agent), costs memory copies only (tmpfs), and needs no pickle: raw tensor bytes plus JSON.

Layout under the spool folder (default ``/dev/shm/psguard-<job>/``)::

    agent.lock                         flock'ed (exclusive) by the live agent: one agent per spool
    writers/<gen>.lock                 flock'ed by a live trainer-side writer (generation ``gen``)
    seq.lock                           flock'ed (exclusive) while a writer reserves a sequence number
    seq                                the last sequence number reserved (written by rename, under seq.lock)
    incoming/<seq>.tmp-<gen>/          a capture being written (ignored; deleted once its writer is dead)
    incoming/<seq:012d>/               a complete capture: capture.json + <i>.bin / <i>.ids files
    acks/<seq:012d>.json               the agent's answer once applied to the memory tier
    acks/<seq:012d>.pending.json       the capture is on its way to the durable log
    acks/<seq:012d>.durable.json       ... and its outcome
    heartbeat.json                     the trainer's last step, when it was made, and its hang bound (below)
    requests/restore-<gen>-<nonce>.json    a trainer asks for the memory tier's snapshot
    restore/<gen>-<nonce>/             the answer: manifest.json + <i>.bin files (renamed into place whole)

Sequence numbers. Several writers may share a spool (an orphaned trainer and its replacement), each in its
own process, so a writer reserves every ``seq`` atomically across processes: it takes an exclusive ``flock``
on ``seq.lock``, reads ``seq`` (when absent, the highest number found under ``incoming/`` and ``acks/``),
writes the next number by write-then-rename, and releases the lock. No two captures ever share a ``seq``;
a reserved number whose capture was never handed off (a full tmpfs, a killed writer) is a gap, which the
agent does not wait for.

Capture protocol. The writer writes every tensor file (native little-endian bytes, C order; strings as in
:mod:`psguard.codec.tensor_bytes`: uint64 lengths then the bytes; row ids as int64) and ``capture.json`` into
``incoming/<seq>.tmp-<gen>/``, then renames the folder to ``incoming/<seq:012d>/``. ``capture.json``::

    {"format": "psguard-spool-capture", "version": 1, "seq": 7, "writer": "<gen>",
     "token": "<gen>-7", "parent": "<gen>-6" | null, "step": 1200, "tiers": ["memory", "durable"],
     "metadata": {...}, "metrics": {"loss": 0.3}, "created_at": 1.7e9,
     "tensors": [{"name": "...", "kind": "full", "dtype": "bfloat16", "shape": [..], "file": "0.bin",
                  "size": N, "crc32c": C},
                 {"name": "...", "kind": "rows", "dtype": ..., "shape": [..], "count": n,
                  "ids": {"file": "1.ids", "size": .., "crc32c": ..}, "values": {"file": "1.bin", ...}},
                 {"name": "...", "kind": "same", "dtype": ..., "shape": [..]}]}

``token`` names the state the capture produces, ``parent`` the state it applies to (null: a whole capture).
``parts`` (optional, list): the shards the capture wrote on their PS nodes instead, one entry per PS
(:class:`psguard.handoff.parts.PartCapture`: ``{"task", "nonce", "shards": [{"name", "offset", "rows",
"shape", "dtype", "kind", "count", "stem"}]}``); the agent forwards each to that PS's agent, and the capture
is applied only if every PS's agent applied its part.
The agent processes complete captures in ``seq`` order (a startup scan, then ``watchdog`` events, with a slow
poll as a safety net): it checks every file's size and CRC32C, applies the capture to the memory tier, writes
``acks/<seq>.json`` (``{"status": "ok" | "need_full" | "error", "memory_step", "token", "capture",
"message"}``, ``capture`` being the token of the capture it answers; a writer accepts an ack only for its
own token, so it never takes another capture's answer for its own) by
write-then-rename, asks its persister to make captures for the durable tier durable, and deletes the folder.
While the durable answer is pending and the agent's store is failing and being retried, ``acks/<seq>.pending.json``
holds ``"store_retrying": {"since": <time.time()>, "error": "..."}``: a trainer holding for that answer (its durable
lag bound) stops holding instead of waiting out the store's retry deadline.

Restore protocol. The trainer writes ``requests/restore-<gen>-<nonce>.json``; the agent exports a consistent
snapshot of the memory tier (step, metadata, token, the last durable checkpoint it knows, a CRC32C per
tensor) into ``restore/<gen>-<nonce>.tmp-agent/`` and renames it to ``restore/<gen>-<nonce>/``. The trainer
verifies every CRC32C before returning anything, then deletes the folder. When PS agents keep the shards,
the snapshot's ``manifest.json`` also lists ``parts``: ``[{"task", "name", "offset", "rows", "shape",
"dtype", "path"}]``, each shard's file on its own PS node, written there by that PS's agent for the same
token. A request may name a durable ``checkpoint`` and the ``shards`` each PS task hosts (``{"ps:0":
[[name, offset, rows], ...]}``): the agent first brings every tier to that checkpoint (each PS agent reading
its rows from the log) and then answers the same way.

Heartbeat. The trainer's manager replaces ``heartbeat.json`` (write-then-rename) at most once a second while
it makes steps: ``{"step": 1200, "at": <time.time()>, "pid": <the trainer's pid>, "hang_after": 300.0 | null}``.
The agent declares the trainer hung when the step has not changed for ``hang_after`` seconds of its own clock
(``null``: the trainer does not ask to be judged yet); see :mod:`psguard.agent.process.hang`.

Files. Both ends hold the spool folder by descriptor from the start (:class:`SpoolPaths`), so renaming its path
away and putting another folder there changes nothing, and read only this user's private regular files, opened
without blocking (:mod:`psguard.local_files`): anything else in the spool is a damaged capture or answer, never
waited on.

Crashes. A killed writer leaves ``*.tmp-<gen>`` folders: the agent deletes them once ``writers/<gen>.lock``
is no longer locked (flock works across PID namespaces, so a sidecar container that cannot see the trainer's
PID still tells). A killed agent leaves captures unprocessed: its successor processes them in order (one whose
ack already exists is only deleted; captures announced as pending for the durable log get an error durable
ack saying the agent restarted). A killed trainer leaves acks and restore folders that the agent removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from io import FileIO
from pathlib import Path
from typing import Any, Literal, TypeVar

import crc32c as _crc32c
import numpy as np

from psguard.codec import strict_json
from psguard.codec.dtypes import MAX_DIMS, dtype_from_name, dtype_name
from psguard.codec.tensor_bytes import byte_view, deserialize_strings, tensor_bytes
from psguard.errors import ConfigError, CorruptCheckpointError, NoCheckpointError, PsguardError, SaveError
from psguard.handoff.contract import Tier, default_spool_dir
from psguard.handoff.credentials import ensure_private_dir
from psguard.handoff.parts import PartCapture, ShardKey, is_ps_task, parts_from_json
from psguard.local_files import HeldDir, open_regular, read_regular
from psguard.tensors import Full, Rows, Same, TensorUpdate

log = logging.getLogger(__name__)

CAPTURE_FORMAT = "psguard-spool-capture"
RESTORE_FORMAT = "psguard-spool-restore"
VERSION = 1
_PIECE = 8 << 20  # bytes per write/read+CRC step: keeps the piece in cache between the two
SEQ_RE = re.compile(r"^[0-9]{12,18}$")  # at most 18 digits: a stray huge name is ignored, not obeyed
TMP_RE = re.compile(r"^([0-9]{1,18})\.tmp-([0-9a-f]{8})$")
REQ_RE = re.compile(r"^restore-([0-9a-f]{8})-([0-9a-f]{12})\.json$")
RESTORE_RE = re.compile(r"^([0-9a-f]{8})-([0-9a-f]{12})$")
AGENT_TMP = ".tmp-agent"

T = TypeVar("T")


def part_dir(job: str, task: str) -> Path:
    """The part folder of PS ``task`` (``ps:0``) on its node, beside the job's spool (:mod:`.parts`)."""
    if not is_ps_task(task):
        raise ConfigError(f"not a PS task name: {task!r}")
    base = default_spool_dir(job)
    return base.with_name(f"{base.name}-{task.replace(':', '-')}")


# ------------------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class Capture:
    """What the trainer hands off: one update per tensor, the step, JSON metadata (the data position) and
    the tiers it is for (``DURABLE`` implies ``MEMORY``; ``BASE`` asks the persister for a new full base)."""

    step: int
    tensors: Mapping[str, TensorUpdate]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    tiers: frozenset[Tier] = frozenset({Tier.MEMORY})
    metrics: Mapping[str, float] = field(default_factory=dict)
    #: The shards captured into files on their PS nodes (:mod:`psguard.handoff.parts`): only descriptors here.
    parts: tuple[PartCapture, ...] = ()

    @property
    def whole(self) -> bool:
        return all(isinstance(u, Full) for u in self.tensors.values()) and all(
            s.kind == "full" for p in self.parts for s in p.shards
        )


@dataclass(frozen=True)
class SpooledCapture:
    """A capture as the agent read it from the spool (every file verified)."""

    seq: int
    writer: str
    token: str
    parent: str | None
    step: int
    tiers: frozenset[Tier]
    metadata: dict[str, Any]
    metrics: dict[str, float]
    tensors: dict[str, TensorUpdate]
    nbytes: int
    parts: tuple[PartCapture, ...] = ()


@dataclass(frozen=True)
class Ack:
    """The agent's answer to one capture (memory tier)."""

    seq: int
    status: Literal["ok", "need_full", "error"]
    memory_step: int | None
    token: str | None
    message: str = ""
    capture: str | None = None  # the token of the capture this answers (None: its capture.json was unreadable)
    #: With peer copies on: PS task -> the task whose agent holds this capture's copy of its shards (``None``:
    #: no copy holds it yet, so that PS's node lost now means the durable log). ``None``: copies off.
    copies: Mapping[str, str | None] | None = None

    def to_json(self) -> dict[str, Any]:
        doc = strict_json.fields_json(self)
        if self.copies is None:
            del doc["copies"]
        return doc


@dataclass(frozen=True)
class DurableAck(strict_json.JsonFields):
    """The durable log's outcome for a capture meant for it: the checkpoint that covers it, or an error."""

    seq: int
    status: Literal["ok", "error"]
    checkpoint: str | None
    durable_step: int | None
    message: str = ""


@dataclass(frozen=True)
class Restored:
    """The memory tier's snapshot as the trainer received it (every tensor verified)."""

    step: int
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]
    token: str | None
    durable_id: str | None = None
    durable_step: int | None = None
    #: Shard -> its file on the node of the PS that hosts it (written there by that PS's agent).
    parts: dict[ShardKey, str] = field(default_factory=dict)
    #: Shard -> (the PS task whose node holds its file, its dtype's name): what it takes to read a shard that
    #: has no variable yet (a deferred restore) on that PS.
    part_homes: dict[ShardKey, tuple[str, str]] = field(default_factory=dict)
    #: Shard -> the bundle of its rows' fingerprints beside its file, when its agent kept them (the PS then
    #: loads them instead of hashing every row).
    part_fps: dict[ShardKey, str] = field(default_factory=dict)
    #: The shards whose file is the PS agent's own tier file, linked (its PS may map it instead of reading it:
    #: :mod:`psguard.handoff.mapped`).
    part_linked: frozenset[ShardKey] = frozenset()


class DeltaWithoutParentError(ConfigError):
    """A delta was handed to a writer that knows no parent state for it: none was ever sent, or the chain broke
    (the agent did not apply an earlier capture) after the caller decided to capture a delta. Nothing was
    handed off; capture whole (``Capturer.capture(full=True)``) and submit that."""


class NewerInMemoryError(PsguardError):
    """A durable checkpoint was asked of the agents while their memory tiers hold a newer state that every PS's
    agent can still give: loading the log over it would lose acknowledged saves, so the agent refused. The
    trainer restores the memory tier instead."""


class NeedFullCaptureError(SaveError):
    """The agent could not apply a delta (its memory tier is not at the delta's parent state): the capture
    was not applied; send a whole capture (``Capturer.capture(full=True)``)."""

    def __init__(self, message: str, ack: Ack) -> None:
        super().__init__(message)
        self.ack = ack


# ------------------------------------------------------------------------------------------------ files
def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by this user only (``0600``): spool files hold model weights."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)


def atomic_write_json(path: Path, doc: Mapping[str, Any]) -> None:
    atomic_write_text(path, json.dumps(doc, allow_nan=False))


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        write_private(tmp, text.encode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _write_blob(path: Path, data: memoryview) -> int:
    """Write ``data``; return its CRC32C, computed piece by piece while the piece is in cache."""
    crc = 0
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb", buffering=0) as f:
        for start in range(0, len(data), _PIECE):
            piece = data[start : start + _PIECE]
            crc = _crc32c.crc32c(piece, crc)
            done = 0
            while done < len(piece):
                done += f.write(piece[done:]) or 0
    return int(crc)


def _read_blob(f: FileIO, name: str, out: memoryview, size: int, crc: int, what: str) -> None:
    """Read exactly ``size`` bytes from ``f`` into ``out`` and check their CRC32C; raise CorruptCheckpointError."""
    got = 0
    running = 0
    while got < size:
        n = f.readinto(out[got : min(size, got + _PIECE)])
        if not n:
            raise CorruptCheckpointError(f"{what}: {name} ended after {got} of {size} bytes")
        running = _crc32c.crc32c(out[got : got + n], running)
        got += n
    if int(running) != crc:
        raise CorruptCheckpointError(f"{what}: {name} failed its CRC32C check (damaged in the spool)")


def _open_spool_file(path: Path, what: str) -> FileIO:
    """A spool file for reading: a regular file of this user's that no one else can write, opened without blocking
    (:func:`psguard.local_files.open_regular`); anything else, or none, is a :class:`CorruptCheckpointError`."""
    try:
        return os.fdopen(open_regular(path, what, private=True), "rb", buffering=0)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{what}: {path.name} is missing") from None
    except OSError as e:
        raise CorruptCheckpointError(f"{what}: {path.name} cannot be read ({e.strerror or e})") from None


def write_array(folder: Path, file: str, value: np.ndarray) -> dict[str, Any]:
    data = tensor_bytes(value)
    return {"file": file, "size": len(data), "crc32c": _write_blob(folder / file, data)}


def _read_array(folder: Path, ref: Any, dtype: np.dtype[Any], shape: tuple[int, ...], what: str) -> np.ndarray:
    """Read one tensor file, allocating only once the claims agree: its size with its dtype and shape, and with
    the file's real size (so a capture.json claiming 10^12 rows costs a stat, not an allocation)."""
    try:
        file, size, crc = ref["file"], ref["size"], ref["crc32c"]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"{what}: file reference incomplete") from None
    if not isinstance(file, str) or not re.match(r"^[0-9]{1,9}\.(bin|ids)$", file):
        raise CorruptCheckpointError(f"{what}: bad file name {str(file)[:80]!r}")
    if not isinstance(size, int) or not isinstance(crc, int) or isinstance(size, bool) or size < 0:
        raise CorruptCheckpointError(f"{what}: bad size or CRC32C")
    elements = math.prod(shape)
    if dtype.kind == "O" and size < 8 * elements:
        raise CorruptCheckpointError(f"{what}: {size} bytes cannot hold {elements} strings")
    if dtype.kind != "O" and size != elements * dtype.itemsize:
        raise CorruptCheckpointError(f"{what}: {size} bytes on file for a {dtype}{list(shape)} tensor")
    with _open_spool_file(folder / file, what) as f:
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            raise CorruptCheckpointError(f"{what}: {file} has {actual} bytes, expected {size}")
        if dtype.kind == "O":
            blob = bytearray(size)
            _read_blob(f, file, memoryview(blob), size, crc, what)
            try:
                return deserialize_strings(memoryview(blob), shape)
            except ValueError as e:
                raise CorruptCheckpointError(f"{what}: {e}") from None
        out = np.empty(shape, dtype=dtype)  # of ``size`` bytes, as checked above
        _read_blob(f, file, byte_view(out), size, crc, what)
    return out


#: Largest capture.json / manifest.json read from a spool: one entry per tensor, a few hundred bytes each.
MAX_JSON_BYTES = 16 << 20


def _parse_json(path: Path, what: str) -> dict[str, Any]:
    """A spool JSON document, parsed strictly (:mod:`psguard.codec.strict_json`) and refused unread when too big."""
    try:
        data = read_regular(path, what, max_bytes=MAX_JSON_BYTES, private=True)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{what}: {path.name} is missing") from None
    except OSError as e:
        raise CorruptCheckpointError(f"{what}: {path.name} cannot be read ({e.strerror or e})") from None
    try:
        doc = strict_json.loads(data, max_bytes=MAX_JSON_BYTES)
    except strict_json.StrictJSONError as e:
        raise CorruptCheckpointError(f"{what}: {path.name} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{what}: {path.name} is not a JSON object")
    return doc


def _entries(items: Any, what: str) -> Iterator[tuple[dict[str, Any], str, str, tuple[int, ...], np.dtype[Any]]]:
    """Each tensor entry of a capture or snapshot, with its name, how errors name it, its shape and dtype."""
    if not isinstance(items, list):
        raise CorruptCheckpointError(f"{what}: tensors malformed")
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise CorruptCheckpointError(f"{what}: tensor entry malformed")
        where, shape = f"{what}, tensor {item['name']!r}", item.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)
        ):
            raise CorruptCheckpointError(f"{where}: bad shape {str(shape)[:80]}")
        try:
            dtype = dtype_from_name(str(item.get("dtype")))
        except (ValueError, ImportError) as e:
            raise CorruptCheckpointError(f"{where}: {e}") from None
        yield item, item["name"], where, tuple(shape), dtype


def check_json(metadata: Mapping[str, Any]) -> dict[str, Any]:
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"capture metadata must be plain JSON: {e}") from None
    return dict(metadata)


def write_capture_files(folder: Path, capture: Capture) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    for i, (name, update) in enumerate(capture.tensors.items()):
        kind = _KINDS.get(type(update))
        if kind is None:
            raise ConfigError(f"tensor {name!r}: {type(update).__name__} is not a Full, Rows or Same update")
        described = update.value if isinstance(update, Full) else update
        shape = [int(x) for x in described.shape]
        entry: dict[str, Any] = {"name": name, "kind": kind, "dtype": dtype_name(np.dtype(described.dtype))}
        entry["shape"] = shape
        if isinstance(update, Full):
            entry.update(write_array(folder, f"{i}.bin", update.value))
        elif isinstance(update, Rows):
            ids = np.ascontiguousarray(update.ids, dtype="<i8")
            entry.update(count=int(ids.size), ids=write_array(folder, f"{i}.ids", ids))
            entry["values"] = write_array(folder, f"{i}.bin", update.values)
        entries.append(entry)
    return entries


_KINDS: dict[type, str] = {Full: "full", Rows: "rows", Same: "same"}


def payload_bytes(capture: Capture) -> int:
    total = 0
    for u in capture.tensors.values():
        if isinstance(u, Full):
            total += u.value.nbytes if u.value.dtype.kind != "O" else 8 * u.value.size + 1024
        elif isinstance(u, Rows):
            total += u.values.nbytes + 8 * u.ids.size
    return total


def read_capture(folder: Path, *, shown: str | None = None) -> SpooledCapture:
    """Read and verify a complete capture folder; :class:`CorruptCheckpointError` names what is wrong (the folder
    as ``shown``, when given: :meth:`SpoolPaths.show`)."""
    what = f"spool capture {shown or folder}"
    doc = _parse_json(folder / "capture.json", what)
    if doc.get("format") != CAPTURE_FORMAT or doc.get("version") != VERSION:
        raise CorruptCheckpointError(f"{what}: not a version-{VERSION} capture ({doc.get('format')!r})")
    try:
        seq, writer, token, parent = int(doc["seq"]), str(doc["writer"]), str(doc["token"]), doc["parent"]
        step = int(doc["step"])
        tiers = frozenset(Tier(t) for t in doc["tiers"])
        metadata = doc["metadata"]
        metrics = {str(k): float(v) for k, v in doc.get("metrics", {}).items()}
        items = doc["tensors"]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"{what}: capture.json lacks or garbles {e}") from None
    if parent is not None and not isinstance(parent, str):
        raise CorruptCheckpointError(f"{what}: bad parent token {parent!r}")
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(f"{what}: metadata malformed")
    tensors: dict[str, TensorUpdate] = {}
    nbytes = 0
    for item, name, where, shape, dtype in _entries(items, what):
        kind = item.get("kind")
        if kind == "full":
            tensors[name] = Full(_read_array(folder, item, dtype, shape, where))
            nbytes += int(item["size"])
        elif kind == "rows":
            count = item.get("count")
            if not isinstance(count, int) or count < 0 or not shape:
                raise CorruptCheckpointError(f"{where}: bad row count or shape")
            ids = _read_array(folder, item.get("ids"), np.dtype("<i8"), (count,), where)
            values = _read_array(folder, item.get("values"), dtype, (count, *shape[1:]), where)
            tensors[name] = Rows(ids, values, shape)
            nbytes += values.nbytes + ids.nbytes
        elif kind == "same":
            tensors[name] = Same(shape, dtype)
        else:
            raise CorruptCheckpointError(f"{where}: unknown kind {kind!r}")
    parts = tuple(parts_from_json(doc.get("parts", []), what))
    return SpooledCapture(seq, writer, token, parent, step, tiers, metadata, metrics, tensors, nbytes, parts)


def read_restore(folder: Path, *, shown: str | None = None) -> Restored:
    """Read an exported snapshot, verifying every tensor's size and CRC32C before returning anything.

    :class:`NoCheckpointError` when the agent's memory tier was empty; :class:`CorruptCheckpointError`
    on any damage; :class:`PsguardError` with the agent's message when the export failed.
    """
    what = f"memory-tier snapshot {shown or folder}"
    doc = _parse_json(folder / "manifest.json", what)
    if doc.get("format") != RESTORE_FORMAT or doc.get("version") != VERSION:
        raise CorruptCheckpointError(f"{what}: not a version-{VERSION} snapshot")
    status = doc.get("status")
    if status == "empty":
        raise NoCheckpointError(f"the agent's memory tier is empty ({doc.get('message', '')}); use the durable log")
    if status == "newer":
        raise NewerInMemoryError(str(doc.get("message", "the memory tiers hold a newer state")))
    if status != "ok":
        raise PsguardError(f"the agent could not export its memory tier: {doc.get('message', status)}")
    entries = _entries(doc.get("tensors"), what)
    tensors = {name: _read_array(folder, item, dtype, shape, where) for item, name, where, shape, dtype in entries}
    parts: dict[ShardKey, str] = {}
    homes: dict[ShardKey, tuple[str, str]] = {}
    fps: dict[ShardKey, str] = {}
    linked: set[ShardKey] = set()
    raw_parts = doc.get("parts", [])
    for item in raw_parts if isinstance(raw_parts, list) else [None]:
        try:
            assert isinstance(item, dict)
            key = ShardKey(str(item["name"]), int(item["offset"]), int(item["rows"]))
            path = item["path"]
        except (AssertionError, KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{what}: a part entry is malformed") from None
        if not isinstance(path, str) or key in parts:
            raise CorruptCheckpointError(f"{what}: a part entry is malformed")
        parts[key] = path
        homes[key] = (str(item.get("task", "")), str(item.get("dtype", "")))
        if isinstance(item.get("fp_path"), str):
            fps[key] = item["fp_path"]
        if item.get("linked") is True:
            linked.add(key)
    try:
        return Restored(
            step=int(doc["step"]),
            tensors=tensors,
            metadata=dict(doc["metadata"]),
            token=doc.get("token"),
            durable_id=doc.get("durable_id"),
            durable_step=doc.get("durable_step"),
            parts=parts,
            part_homes=homes,
            part_fps=fps,
            part_linked=frozenset(linked),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{what}: manifest lacks or garbles {e}") from None


# ------------------------------------------------------------------------------------------------ both sides
class _Under:
    """A path of the spool's layout: ``name`` under :attr:`SpoolPaths.base`, wherever that leads now."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, paths: SpoolPaths, owner: type | None = None) -> Path:
        return paths.base / self.name


class SpoolPaths:
    """The spool's layout. After :meth:`make`, every path leads through the spool folder held open
    (:class:`psguard.local_files.HeldDir`): someone who can write the folder above the spool may rename it away and
    put their own folder at its path, but neither end reads their captures, acks or restores, nor writes there.
    :meth:`moved` tells when that happened; :meth:`release` lets the folder go (the paths are plain again)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._held: HeldDir | None = None

    @property
    def base(self) -> Path:
        """Where the spool's contents are reached: through the held folder, or by its path before :meth:`make`."""
        held = self._held
        return held.path if held is not None else self.root

    incoming = _Under("incoming")
    acks = _Under("acks")
    requests = _Under("requests")
    restore = _Under("restore")
    writers = _Under("writers")
    agent_lock = _Under("agent.lock")
    seq = _Under("seq")
    heartbeat = _Under("heartbeat.json")
    seq_lock = _Under("seq.lock")

    def make(self) -> None:
        """Create the layout, the spool folder private to this user (refused if someone else could write it), and
        hold the folder open from now on."""
        ensure_private_dir(self.root, "spool")
        self.release()
        self._held = HeldDir(self.root, "spool")
        for d in (self.incoming, self.acks, self.requests, self.restore, self.writers):
            d.mkdir(mode=0o700, exist_ok=True)

    def moved(self) -> bool:
        """Whether the spool's path no longer names the folder held (renamed away or replaced since :meth:`make`)."""
        held = self._held
        return held is not None and held.moved()

    def show(self, path: Path) -> str:
        """``path`` as a reader knows it: under the spool's own path, not ``/proc/self/fd/<n>``."""
        held = self._held
        if held is not None and path.is_relative_to(held.path):
            return str(self.root / path.relative_to(held.path))
        return str(path)

    def release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.close()

    def ack(self, seq: int, kind: str = "") -> Path:
        return self.acks / f"{seq:012d}{'.' + kind if kind else ''}.json"


def try_flock(path: Path, mode: int) -> int | None:
    """An fd holding ``mode`` on the lock file ``path`` (created if absent), or None when someone else holds it;
    a lock file that is not this user's private regular file is a :class:`CorruptCheckpointError`."""
    fd = open_regular(path, "lock file", create=True, private=True)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def poll_until(
    check: Callable[[], T | None], timeout: float | None, max_poll: float, timeout_message: Callable[[], str]
) -> T:
    """Poll ``check`` with a backoff from 0.2 ms up to ``max_poll`` until it answers or ``timeout`` passes."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.0002
    while True:
        got = check()
        if got is not None:
            return got
        left = math.inf if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(timeout_message())
        time.sleep(min(delay, left))
        delay = min(delay * 2, max_poll)


def read_json_if_present(path: Path) -> dict[str, Any] | None:
    """The JSON object the other side wrote at ``path`` by write-then-rename, or None while there is none; a
    :class:`CorruptCheckpointError` when what is there is not this user's private regular file (never waited on:
    :func:`psguard.local_files.read_regular`)."""
    try:
        data = read_regular(path, "spool", max_bytes=MAX_JSON_BYTES, private=True)
    except FileNotFoundError:
        return None
    try:
        doc = strict_json.loads(data)
    except strict_json.StrictJSONError:
        return None  # cannot happen with write-then-rename; poll again
    return doc if isinstance(doc, dict) else None
