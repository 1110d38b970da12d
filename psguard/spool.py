"""The hand-off between the trainer and the agent on its node: a spool folder on tmpfs.

Why files on tmpfs rather than a socket or shared-memory segments: a capture must survive either side being
killed at any moment, and must be picked up by whichever agent runs next. A folder made visible by one atomic
``rename`` gives that for free (no half capture is ever visible, and unprocessed captures wait in order for
the next agent), costs memory copies only (tmpfs), and needs no pickle: raw tensor bytes plus JSON.

Layout under the spool folder (default ``/dev/shm/psguard-<job>/``)::

    agent.lock                         flock'ed (exclusive) by the live agent: one agent per spool
    writers/<gen>.lock                 flock'ed by a live trainer-side writer (generation ``gen``)
    seq                                the last sequence number handed off (so a new writer never reuses one)
    incoming/<seq>.tmp-<gen>/          a capture being written (ignored; deleted once its writer is dead)
    incoming/<seq:012d>/               a complete capture: capture.json + <i>.bin / <i>.ids files
    acks/<seq:012d>.json               the agent's answer once applied to the memory tier
    acks/<seq:012d>.pending.json       the capture is on its way to the durable log
    acks/<seq:012d>.durable.json       ... and its outcome
    requests/restore-<gen>-<nonce>.json    a trainer asks for the memory tier's snapshot
    restore/<gen>-<nonce>/             the answer: manifest.json + <i>.bin files (renamed into place whole)

Capture protocol. The writer writes every tensor file (native little-endian bytes, C order; strings as in
:mod:`psguard.chunks`: uint64 lengths then the bytes; row ids as int64) and ``capture.json`` into
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
The agent processes complete captures in ``seq`` order (a startup scan, then ``watchdog`` events, with a slow
poll as a safety net): it checks every file's size and CRC32C, applies the capture to the memory tier, writes
``acks/<seq>.json`` (``{"status": "ok" | "need_full" | "error", "memory_step", "token", "message"}``) by
write-then-rename, asks its persister to make captures for the durable tier durable, and deletes the folder.

Restore protocol. The trainer writes ``requests/restore-<gen>-<nonce>.json``; the agent exports a consistent
snapshot of the memory tier (step, metadata, token, the last durable checkpoint it knows, a CRC32C per
tensor) into ``restore/<gen>-<nonce>.tmp-agent/`` and renames it to ``restore/<gen>-<nonce>/``. The trainer
verifies every CRC32C before returning anything, then deletes the folder.

Crashes. A killed writer leaves ``*.tmp-<gen>`` folders: the agent deletes them once ``writers/<gen>.lock``
is no longer locked (flock works across PID namespaces, so a sidecar container that cannot see the trainer's
PID still tells). A killed agent leaves captures unprocessed: its successor processes them in order (one whose
ack already exists is only deleted; captures announced as pending for the durable log get an error durable
ack saying the agent restarted). A killed trainer leaves acks and restore folders that the agent removes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import math
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import crc32c as _crc32c
import numpy as np

from psguard.chunks import as_le_bytes, byte_view, deserialize_strings, dtype_from_name, dtype_name, serialize_strings
from psguard.errors import (
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    PsguardError,
    SaveError,
    StorageError,
)
from psguard.memory_tier import MemoryTier
from psguard.persister import Persister, PersistHandle
from psguard.policy import Tier
from psguard.tensors import Full, Rows, Same, TensorUpdate

__all__ = [
    "Ack",
    "Capture",
    "CaptureHandle",
    "DurableAck",
    "NeedFullCaptureError",
    "RestoreHandle",
    "Restored",
    "SpoolEvent",
    "SpoolServer",
    "SpoolServerStatus",
    "SpoolWriter",
    "SpooledCapture",
    "default_spool_dir",
    "read_capture",
    "read_restore",
]

log = logging.getLogger(__name__)

CAPTURE_FORMAT = "psguard-spool-capture"
RESTORE_FORMAT = "psguard-spool-restore"
VERSION = 1
_PIECE = 8 << 20  # bytes per write/read+CRC step: keeps the piece in cache between the two
_SEQ_RE = re.compile(r"^[0-9]{12,}$")
_GEN_RE = re.compile(r"^[0-9a-f]{8}$")
_TMP_RE = re.compile(r"^([0-9]+)\.tmp-([0-9a-f]{8})$")
_REQ_RE = re.compile(r"^restore-([0-9a-f]{8})-([0-9a-f]{12})\.json$")
_RESTORE_RE = re.compile(r"^([0-9a-f]{8})-([0-9a-f]{12})$")
_AGENT_TMP = ".tmp-agent"

T = TypeVar("T")


def default_spool_dir(job: str) -> Path:
    """``/dev/shm/psguard-<job>`` (tmpfs), or the temp folder where there is no ``/dev/shm``."""
    if not re.match(r"^[A-Za-z0-9_.-]+$", job):
        raise ConfigError(f"job name {job!r} must be made of [A-Za-z0-9_.-] to name a spool folder")
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"psguard-{job}"


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

    @property
    def whole(self) -> bool:
        return all(isinstance(u, Full) for u in self.tensors.values())


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


@dataclass(frozen=True)
class Ack:
    """The agent's answer to one capture (memory tier)."""

    seq: int
    status: Literal["ok", "need_full", "error"]
    memory_step: int | None
    token: str | None
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "status": self.status,
            "memory_step": self.memory_step,
            "token": self.token,
            "message": self.message,
        }


@dataclass(frozen=True)
class DurableAck:
    """The durable log's outcome for a capture meant for it: the checkpoint that covers it, or an error."""

    seq: int
    status: Literal["ok", "error"]
    checkpoint: str | None
    durable_step: int | None
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "status": self.status,
            "checkpoint": self.checkpoint,
            "durable_step": self.durable_step,
            "message": self.message,
        }


@dataclass(frozen=True)
class Restored:
    """The memory tier's snapshot as the trainer received it (every tensor verified)."""

    step: int
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]
    token: str | None
    durable_id: str | None = None
    durable_step: int | None = None


class NeedFullCaptureError(SaveError):
    """The agent could not apply a delta (its memory tier is not at the delta's parent state): the capture
    was not applied; send a whole capture (``Capturer.capture(full=True)``)."""

    def __init__(self, message: str, ack: Ack) -> None:
        super().__init__(message)
        self.ack = ack


# ------------------------------------------------------------------------------------------------ files
def _atomic_write_json(path: Path, doc: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        tmp.write_bytes(json.dumps(doc, allow_nan=False).encode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_blob(path: Path, data: memoryview) -> int:
    """Write ``data``; return its CRC32C, computed piece by piece while the piece is in cache."""
    crc = 0
    with open(path, "wb", buffering=0) as f:
        for start in range(0, len(data), _PIECE):
            piece = data[start : start + _PIECE]
            crc = _crc32c.crc32c(piece, crc)
            done = 0
            while done < len(piece):
                done += f.write(piece[done:]) or 0
    return int(crc)


def _read_blob(path: Path, out: memoryview, size: int, crc: int, what: str) -> None:
    """Read exactly ``size`` bytes into ``out`` and check their CRC32C; raise CorruptCheckpointError."""
    try:
        with open(path, "rb", buffering=0) as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size or len(out) != size:
                raise CorruptCheckpointError(f"{what}: {path.name} has {actual} bytes, expected {size}")
            got = 0
            running = 0
            while got < size:
                n = f.readinto(out[got : min(size, got + _PIECE)])
                if not n:
                    raise CorruptCheckpointError(f"{what}: {path.name} ended after {got} of {size} bytes")
                running = _crc32c.crc32c(out[got : got + n], running)
                got += n
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{what}: {path.name} is missing") from None
    if int(running) != crc:
        raise CorruptCheckpointError(f"{what}: {path.name} failed its CRC32C check (damaged in the spool)")


def _tensor_bytes(value: np.ndarray) -> memoryview:
    if value.dtype.kind in ("O", "S", "U"):
        return memoryview(serialize_strings(value))
    return as_le_bytes(value)


def _write_array(folder: Path, file: str, value: np.ndarray) -> dict[str, Any]:
    data = _tensor_bytes(value)
    return {"file": file, "size": len(data), "crc32c": _write_blob(folder / file, data)}


def _file_ref(doc: Any, what: str) -> tuple[str, int, int]:
    try:
        file, size, crc = doc["file"], doc["size"], doc["crc32c"]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"{what}: file reference incomplete") from None
    if not isinstance(file, str) or not re.match(r"^[0-9]+\.(bin|ids)$", file):
        raise CorruptCheckpointError(f"{what}: bad file name {file!r}")
    if not isinstance(size, int) or not isinstance(crc, int) or size < 0:
        raise CorruptCheckpointError(f"{what}: bad size or CRC32C")
    return file, size, crc


def _read_array(folder: Path, ref: Any, dtype: np.dtype[Any], shape: tuple[int, ...], what: str) -> np.ndarray:
    file, size, crc = _file_ref(ref, what)
    if dtype.kind == "O":
        blob = bytearray(size)
        _read_blob(folder / file, memoryview(blob), size, crc, what)
        try:
            return deserialize_strings(memoryview(blob), shape)
        except ValueError as e:
            raise CorruptCheckpointError(f"{what}: {e}") from None
    out = np.empty(shape, dtype=dtype)
    if out.nbytes != size:
        raise CorruptCheckpointError(f"{what}: {size} bytes on file for a {dtype}{list(shape)} tensor")
    _read_blob(folder / file, byte_view(out), size, crc, what)
    return out


def _parse_json(path: Path, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{what}: {path.name} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{what}: {path.name} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{what}: {path.name} is not a JSON object")
    return doc


def _shape_dtype(doc: Mapping[str, Any], what: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    shape = doc.get("shape")
    if not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
        raise CorruptCheckpointError(f"{what}: bad shape {shape!r}")
    try:
        dtype = dtype_from_name(str(doc.get("dtype")))
    except (ValueError, ImportError) as e:
        raise CorruptCheckpointError(f"{what}: {e}") from None
    return tuple(shape), dtype


def _check_json(metadata: Mapping[str, Any]) -> dict[str, Any]:
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"capture metadata must be plain JSON: {e}") from None
    return dict(metadata)


def _write_capture_files(folder: Path, capture: Capture) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    for i, (name, update) in enumerate(capture.tensors.items()):
        if isinstance(update, Full):
            value = update.value
            entry: dict[str, Any] = {
                "name": name,
                "kind": "full",
                "dtype": dtype_name(value.dtype),
                "shape": list(value.shape),
            }
            entry.update(_write_array(folder, f"{i}.bin", value))
        elif isinstance(update, Rows):
            ids = np.ascontiguousarray(update.ids, dtype="<i8")
            entry = {
                "name": name,
                "kind": "rows",
                "dtype": dtype_name(update.dtype),
                "shape": [int(x) for x in update.shape],
                "count": int(ids.size),
                "ids": _write_array(folder, f"{i}.ids", ids),
                "values": _write_array(folder, f"{i}.bin", update.values),
            }
        elif isinstance(update, Same):
            entry = {
                "name": name,
                "kind": "same",
                "dtype": dtype_name(np.dtype(update.dtype)),
                "shape": [int(x) for x in update.shape],
            }
        else:
            raise ConfigError(f"tensor {name!r}: {type(update).__name__} is not a Full, Rows or Same update")
        entries.append(entry)
    return entries


def _payload_bytes(capture: Capture) -> int:
    total = 0
    for u in capture.tensors.values():
        if isinstance(u, Full):
            total += u.value.nbytes if u.value.dtype.kind != "O" else 8 * u.value.size + 1024
        elif isinstance(u, Rows):
            total += u.values.nbytes + 8 * u.ids.size
    return total


def read_capture(folder: Path) -> SpooledCapture:
    """Read and verify a complete capture folder; :class:`CorruptCheckpointError` names what is wrong."""
    what = f"spool capture {folder}"
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
    if not isinstance(metadata, dict) or not isinstance(items, list):
        raise CorruptCheckpointError(f"{what}: metadata or tensors malformed")
    tensors: dict[str, TensorUpdate] = {}
    nbytes = 0
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise CorruptCheckpointError(f"{what}: tensor entry malformed")
        name = item["name"]
        where = f"{what}, tensor {name!r}"
        shape, dtype = _shape_dtype(item, where)
        kind = item.get("kind")
        if kind == "full":
            value = _read_array(folder, item, dtype, shape, where)
            tensors[name] = Full(value)
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
    return SpooledCapture(seq, writer, token, parent, step, tiers, metadata, metrics, tensors, nbytes)


def read_restore(folder: Path) -> Restored:
    """Read an exported snapshot, verifying every tensor's size and CRC32C before returning anything.

    :class:`NoCheckpointError` when the agent's memory tier was empty; :class:`CorruptCheckpointError`
    on any damage; :class:`PsguardError` with the agent's message when the export failed.
    """
    what = f"memory-tier snapshot {folder}"
    doc = _parse_json(folder / "manifest.json", what)
    if doc.get("format") != RESTORE_FORMAT or doc.get("version") != VERSION:
        raise CorruptCheckpointError(f"{what}: not a version-{VERSION} snapshot")
    status = doc.get("status")
    if status == "empty":
        raise NoCheckpointError(f"the agent's memory tier is empty ({doc.get('message', '')}); use the durable log")
    if status != "ok":
        raise PsguardError(f"the agent could not export its memory tier: {doc.get('message', status)}")
    tensors: dict[str, np.ndarray] = {}
    items = doc.get("tensors")
    if not isinstance(items, list):
        raise CorruptCheckpointError(f"{what}: tensors malformed")
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise CorruptCheckpointError(f"{what}: tensor entry malformed")
        shape, dtype = _shape_dtype(item, f"{what}, tensor {item['name']!r}")
        tensors[item["name"]] = _read_array(folder, item, dtype, shape, f"{what}, tensor {item['name']!r}")
    try:
        return Restored(
            step=int(doc["step"]),
            tensors=tensors,
            metadata=dict(doc["metadata"]),
            token=doc.get("token"),
            durable_id=doc.get("durable_id"),
            durable_step=doc.get("durable_step"),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{what}: manifest lacks or garbles {e}") from None


# ------------------------------------------------------------------------------------------------ both sides
class _Paths:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.incoming = self.root / "incoming"
        self.acks = self.root / "acks"
        self.requests = self.root / "requests"
        self.restore = self.root / "restore"
        self.writers = self.root / "writers"
        self.agent_lock = self.root / "agent.lock"
        self.seq = self.root / "seq"

    def make(self) -> None:
        for d in (self.incoming, self.acks, self.requests, self.restore, self.writers):
            d.mkdir(parents=True, exist_ok=True)

    def ack(self, seq: int, kind: str = "") -> Path:
        return self.acks / f"{seq:012d}{'.' + kind if kind else ''}.json"


def _try_flock(path: Path, mode: int) -> int | None:
    """An fd holding ``mode`` on ``path`` (created if absent), or None when someone else holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _wait(
    check: Callable[[], T | None], timeout: float | None, max_poll: float, timeout_message: Callable[[], str]
) -> T:
    """Poll ``check`` with a backoff from 0.2 ms up to ``max_poll`` until it answers or ``timeout`` passes."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.0002
    while True:
        got = check()
        if got is not None:
            return got
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(timeout_message())
            time.sleep(min(delay, left))
        else:
            time.sleep(delay)
        delay = min(delay * 2, max_poll)


def _read_json_if_present(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # cannot happen with write-then-rename; poll again
    return doc if isinstance(doc, dict) else None


# ------------------------------------------------------------------------------------------------ trainer side
class CaptureHandle:
    """One capture handed off. :meth:`result` waits for the memory tier; :meth:`durable` for the log."""

    def __init__(self, writer: SpoolWriter, seq: int, token: str, step: int, tiers: frozenset[Tier]) -> None:
        self._writer = writer
        self.seq = seq
        self.token = token
        self.step = step
        self.tiers = tiers
        self._ack: Ack | None = None
        self._durable: DurableAck | None = None

    def done(self) -> bool:
        """True once the agent answered (without consuming the answer)."""
        return self._ack is not None or self._writer._paths.ack(self.seq).exists()

    def result(self, timeout: float | None = None) -> Ack:
        """The agent's ack once the capture is applied to the memory tier (the save is *restorable*).

        Raises :class:`NeedFullCaptureError` when the agent needs a whole capture, :class:`SaveError` when it
        rejected the capture, :class:`TimeoutError` when no answer came within ``timeout`` seconds.
        """
        if self._ack is None:
            path = self._writer._paths.ack(self.seq)
            doc = _wait(
                lambda: _read_json_if_present(path),
                timeout,
                self._writer.poll_interval,
                lambda: self._writer._no_answer(f"capture seq {self.seq} (step {self.step})", timeout),
            )
            self._ack = Ack(
                seq=self.seq,
                status=doc.get("status", "error"),
                memory_step=doc.get("memory_step"),
                token=doc.get("token"),
                message=str(doc.get("message", "")),
            )
            with contextlib.suppress(OSError):
                path.unlink()
            self._writer._answered(self.seq, self._ack)
        ack = self._ack
        if ack.status == "need_full":
            raise NeedFullCaptureError(f"capture seq {self.seq} (step {self.step}) not applied: {ack.message}", ack)
        if ack.status != "ok":
            raise SaveError(f"the agent rejected capture seq {self.seq} (step {self.step}): {ack.message}")
        return ack

    def durable(self, timeout: float | None = None) -> DurableAck:
        """The durable log's outcome (the save is *durable*); raises :class:`SaveError` on failure."""
        if Tier.DURABLE not in self.tiers:
            raise ConfigError(f"capture seq {self.seq} was not meant for the durable tier")
        if self._durable is None:
            path = self._writer._paths.ack(self.seq, "durable")
            doc = _wait(
                lambda: _read_json_if_present(path),
                timeout,
                max(self._writer.poll_interval, 0.05),
                lambda: self._writer._no_answer(f"the durable save of capture seq {self.seq}", timeout),
            )
            self._durable = DurableAck(
                seq=self.seq,
                status="ok" if doc.get("status") == "ok" else "error",
                checkpoint=doc.get("checkpoint"),
                durable_step=doc.get("durable_step"),
                message=str(doc.get("message", "")),
            )
            with contextlib.suppress(OSError):
                path.unlink()
        if self._durable.status != "ok":
            raise SaveError(
                f"capture seq {self.seq} (step {self.step}) did not become durable: {self._durable.message}"
            )
        return self._durable


class RestoreHandle:
    """A pending request for the memory tier's snapshot."""

    def __init__(self, writer: SpoolWriter, name: str) -> None:
        self._writer = writer
        self.name = name
        self.folder = writer._paths.restore / name

    def done(self) -> bool:
        return self.folder.is_dir()

    def result(self, timeout: float | None = None) -> Restored:
        """Wait for the export, verify it, delete it, return it (see :func:`read_restore` for errors)."""
        _wait(
            lambda: True if self.folder.is_dir() else None,
            timeout,
            self._writer.poll_interval,
            lambda: self._writer._no_answer("the restore request", timeout),
        )
        try:
            return read_restore(self.folder)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


class SpoolWriter:
    """The trainer's end of the spool. Not a thread: handing off is a few file writes and one rename.

    ``parent``: the token of the state the next delta applies to (set it to ``Restored.token`` after
    restoring from the memory tier, or to the durable checkpoint's token after restoring from the log);
    it then follows the captures submitted. A whole capture needs no parent.
    """

    def __init__(self, root: str | Path, *, parent: str | None = None, poll_interval: float = 0.005) -> None:
        self._paths = _Paths(root)
        self._paths.make()
        self.root = self._paths.root
        self.poll_interval = poll_interval
        self.generation = secrets.token_hex(4)
        self._lock = threading.Lock()
        self._parent = parent
        self._chain_start = 0  # a capture from here on that is not applied breaks the chain
        lock_tmp = self._paths.writers / f"{self.generation}.lock.tmp"
        fd = _try_flock(lock_tmp, fcntl.LOCK_EX)
        if fd is None:  # pragma: no cover - a fresh random name
            raise PsguardError(f"could not lock {lock_tmp}")
        self._lock_fd: int | None = fd
        self._lock_path = self._paths.writers / f"{self.generation}.lock"
        os.rename(lock_tmp, self._lock_path)  # only now visible: never seen unlocked by the agent
        self._seq = self._high_water() + 1

    def _high_water(self) -> int:
        high = -1
        with contextlib.suppress(FileNotFoundError, ValueError):
            high = int(self._paths.seq.read_text().strip() or -1)
        for folder in (self._paths.incoming, self._paths.acks):
            for name in os.listdir(folder):
                m = re.match(r"^\.?([0-9]+)", name)
                if m:
                    high = max(high, int(m.group(1)))
        return high

    @property
    def parent(self) -> str | None:
        return self._parent

    @parent.setter
    def parent(self, token: str | None) -> None:
        with self._lock:
            self._parent = token
            self._chain_start = self._seq

    def agent_alive(self) -> bool:
        """Whether an agent holds the spool (flock probe; never blocks)."""
        fd = _try_flock(self._paths.agent_lock, fcntl.LOCK_SH)
        if fd is None:
            return True
        os.close(fd)
        return False

    def submit(self, capture: Capture) -> CaptureHandle:
        """Hand ``capture`` off; returns at once after the rename (nothing waits for the agent).

        The arrays are written out before this returns, so the caller may reuse them. Raises
        :class:`StorageError` when the spool's filesystem is full (nothing half-written stays visible) and
        :class:`ConfigError` for a delta with no known parent state.
        """
        if capture.step < 0:
            raise ConfigError(f"step must be >= 0, got {capture.step}")
        metadata = _check_json(capture.metadata)
        metrics = {str(k): float(v) for k, v in capture.metrics.items()}
        if not all(math.isfinite(v) for v in metrics.values()):
            raise ConfigError(f"capture metrics must be finite numbers, got {metrics}")
        tiers = set(capture.tiers)
        if Tier.DURABLE in tiers or Tier.BASE in tiers:
            tiers |= {Tier.MEMORY, Tier.DURABLE}
        with self._lock:
            whole = capture.whole
            parent = None if whole else self._parent
            if not whole and parent is None:
                raise ConfigError(
                    "this delta has no parent state: send a whole capture first (capture(full=True)), or set "
                    "writer.parent to the token of the state the trainer restored"
                )
            seq = self._seq
            token = f"{self.generation}-{seq}"
            self._check_space(capture, seq)
            tmp = self._paths.incoming / f"{seq}.tmp-{self.generation}"
            final = self._paths.incoming / f"{seq:012d}"
            try:
                tmp.mkdir()
                entries = _write_capture_files(tmp, capture)
                doc = {
                    "format": CAPTURE_FORMAT,
                    "version": VERSION,
                    "seq": seq,
                    "writer": self.generation,
                    "token": token,
                    "parent": parent,
                    "step": int(capture.step),
                    "tiers": sorted(t.value for t in tiers),
                    "metadata": metadata,
                    "metrics": metrics,
                    "created_at": time.time(),
                    "tensors": entries,
                }
                (tmp / "capture.json").write_bytes(json.dumps(doc, allow_nan=False).encode())
                os.rename(tmp, final)  # the hand-off
            except BaseException as e:
                shutil.rmtree(tmp, ignore_errors=True)
                if isinstance(e, OSError):
                    raise self._os_error(e, seq, capture) from e
                raise
            self._seq = seq + 1
            self._parent = token
            if whole:
                self._chain_start = seq
            with contextlib.suppress(OSError):
                _atomic_write_text(self._paths.seq, str(seq))
        return CaptureHandle(self, seq, token, capture.step, frozenset(tiers))

    def _check_space(self, capture: Capture, seq: int) -> None:
        need = _payload_bytes(capture)
        st = os.statvfs(self._paths.incoming)
        free = st.f_bavail * st.f_frsize
        if need > free:
            raise StorageError(
                f"spool {self.root} has {free / 1e6:.1f} MB free, capture seq {seq} (step {capture.step}) needs "
                f"{need / 1e6:.1f} MB: not handed off. Enlarge the tmpfs (docker --shm-size, a bigger emptyDir "
                "medium: Memory limit) or point the spool elsewhere"
            )

    def _os_error(self, e: OSError, seq: int, capture: Capture) -> StorageError:
        if e.errno == errno.ENOSPC:
            return StorageError(
                f"spool {self.root} filled up (ENOSPC) while writing capture seq {seq} (step {capture.step}): "
                "not handed off, nothing left behind. Enlarge the tmpfs (docker --shm-size) or point the spool "
                "elsewhere"
            )
        return StorageError(f"writing capture seq {seq} to spool {self.root} failed: {e}")

    def _answered(self, seq: int, ack: Ack) -> None:
        """A capture that was not applied breaks the chain of every later delta (until a whole capture)."""
        if ack.status != "ok":
            with self._lock:
                if seq >= self._chain_start:
                    self._parent = None

    def _no_answer(self, what: str, timeout: float | None) -> str:
        agent = "an agent holds the spool" if self.agent_alive() else "no agent is running on this spool"
        return f"no answer from the agent for {what} within {timeout}s ({agent}: {self.root})"

    def request_restore(self) -> RestoreHandle:
        """Ask the agent for its memory tier's snapshot; ``result(timeout)`` returns it verified."""
        name = f"{self.generation}-{secrets.token_hex(6)}"
        _atomic_write_json(
            self._paths.requests / f"restore-{name}.json", {"writer": self.generation, "at": time.time()}
        )
        return RestoreHandle(self, name)

    def close(self) -> None:
        """Release the writer's lock (a killed writer's is released by the kernel)."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                self._lock_path.unlink()
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ agent side
class _WatchdogStopRace(logging.Filter):
    """Drop watchdog's ERROR "queue_events() called when the thread is inactive".

    watchdog 7 logs it when an inotify event arrives while its observer is being stopped (its own race, nothing
    lost: we process what is in the folders, not the events). Every agent stop printed it as an error.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


def _quiet_watchdog_stop_race() -> None:
    logger = logging.getLogger("watchdog.observers.inotify")
    if not any(isinstance(f, _WatchdogStopRace) for f in logger.filters):
        logger.addFilter(_WatchdogStopRace())


@dataclass(frozen=True)
class SpoolEvent:
    """One capture or restore handled by the agent, for metrics and logs."""

    kind: Literal["capture", "restore"]
    seq: int | None
    step: int | None
    status: str
    nbytes: int
    read_seconds: float
    apply_seconds: float
    message: str = ""
    stall_seconds: float | None = None  # the trainer's training stall for this capture, when it said


@dataclass(frozen=True)
class SpoolServerStatus:
    running: bool
    captures: Mapping[str, int]
    bytes_received: int
    restores: int
    last_seq: int | None
    last_apply_seconds: float | None
    last_error: str | None


class _Wake:
    """watchdog handler: any change in a watched folder wakes the processing thread (it rescans)."""

    def __init__(self, event: threading.Event) -> None:
        from watchdog.events import FileSystemEventHandler

        class Handler(FileSystemEventHandler):
            def on_any_event(self, _: Any) -> None:
                event.set()

        self.handler = Handler()


class SpoolServer:
    """The agent's end: applies captures to ``tier``, feeds ``persister``, serves restores.

    ``start()`` takes the spool's agent lock, cleans what dead processes left, and (``watch=True``) starts a
    ``watchdog`` observer plus one processing thread; everything present is processed at once, in order.
    ``start(watch=False)`` only takes the lock, for callers that drive :meth:`process_once` themselves.
    """

    def __init__(
        self,
        root: str | Path,
        tier: MemoryTier,
        persister: Persister | None = None,
        *,
        poll_interval: float = 0.5,
        ack_ttl: float = 3600.0,
        lock_timeout: float = 5.0,
        on_event: Callable[[SpoolEvent], None] | None = None,
    ) -> None:
        self._paths = _Paths(root)
        self.root = self._paths.root
        self.tier = tier
        self.persister = persister
        self.poll_interval = poll_interval
        self.ack_ttl = ack_ttl
        self.lock_timeout = lock_timeout
        self.on_event = on_event
        self._lock_fd: int | None = None
        self._process_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._observer: Any = None
        self._dead_writers: set[str] = set()
        self._last_prune = 0.0
        self._counts: dict[str, int] = {"ok": 0, "need_full": 0, "error": 0}
        self._bytes = 0
        self._restores = 0
        self._last_seq: int | None = None
        self._last_apply: float | None = None
        self._last_error: str | None = None

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self, *, watch: bool = True) -> SpoolServer:
        self._paths.make()
        self._stop.clear()
        deadline = time.monotonic() + self.lock_timeout
        while True:  # a trainer's liveness probe may hold a shared lock for a moment
            fd = _try_flock(self._paths.agent_lock, fcntl.LOCK_EX)
            if fd is not None:
                break
            if time.monotonic() > deadline:
                raise PsguardError(f"another agent serves spool {self.root} (its agent.lock is held); stop it first")
            time.sleep(0.05)
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._recover()
        if watch:
            from watchdog.observers import Observer

            _quiet_watchdog_stop_race()

            observer = Observer()
            handler = _Wake(self._wake).handler
            observer.schedule(handler, str(self._paths.incoming), recursive=False)
            observer.schedule(handler, str(self._paths.requests), recursive=False)
            observer.start()
            self._observer = observer
            self._thread = threading.Thread(target=self._run, name="psguard-spool", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop watching and processing (a capture being applied finishes first), release the spool."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout)
            self._observer = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> SpoolServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def status(self) -> SpoolServerStatus:
        return SpoolServerStatus(
            running=self._thread is not None and self._thread.is_alive(),
            captures=dict(self._counts),
            bytes_received=self._bytes,
            restores=self._restores,
            last_seq=self._last_seq,
            last_apply_seconds=self._last_apply,
            last_error=self._last_error,
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.process_once()
            except Exception as e:  # keep serving; the next scan retries
                self._last_error = f"{type(e).__name__}: {e}"
                log.exception("spool %s: processing failed", self.root)
            self._wake.wait(self.poll_interval)

    def _recover(self) -> None:
        """At start (holding the agent lock): whatever a previous agent left half-done is ours to settle."""
        for p in self._paths.restore.iterdir():
            if p.name.endswith(_AGENT_TMP):
                shutil.rmtree(p, ignore_errors=True)
        for p in self._paths.acks.iterdir():
            if p.name.startswith("."):
                with contextlib.suppress(OSError):
                    p.unlink()
            elif p.name.endswith(".pending.json"):
                seq = int(p.name.split(".", 1)[0])
                self._write_durable_ack(
                    DurableAck(
                        seq,
                        "error",
                        None,
                        None,
                        "the agent was restarted before this capture became durable; send a whole capture",
                    )
                )

    # ------------------------------------------------------------------------------------------- processing
    def process_once(self) -> int:
        """Process everything waiting, in order: captures first (so a restore sees them), then requests."""
        if self._lock_fd is None:
            raise PsguardError("start() the spool server (it takes the agent lock) before processing")
        with self._process_lock:
            done = 0
            seqs = []
            for name in os.listdir(self._paths.incoming):
                tmp = _TMP_RE.match(name)
                if tmp:
                    if not self._writer_alive(tmp.group(2)):
                        log.info("spool %s: removing %s left by a dead writer", self.root, name)
                        shutil.rmtree(self._paths.incoming / name, ignore_errors=True)
                elif _SEQ_RE.match(name):
                    seqs.append(int(name))
            for seq in sorted(seqs):
                if self._stop.is_set() and self._thread is not None:
                    break
                self._process_capture(seq)
                done += 1
            for name in sorted(os.listdir(self._paths.requests)):
                m = _REQ_RE.match(name)
                if m:
                    self._serve_restore(self._paths.requests / name, f"{m.group(1)}-{m.group(2)}", m.group(1))
                elif name.startswith("."):
                    gen = re.search(r"restore-([0-9a-f]{8})-", name)
                    if gen and not self._writer_alive(gen.group(1)):
                        with contextlib.suppress(OSError):
                            (self._paths.requests / name).unlink()
            self._prune()
            return done

    def _process_capture(self, seq: int) -> None:
        folder = self._paths.incoming / f"{seq:012d}"
        if self._paths.ack(seq).exists() or self._paths.ack(seq, "durable").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a predecessor answered, then died before deleting
            return
        t0 = time.perf_counter()
        step: int | None = None
        tiers: frozenset[Tier] = frozenset()
        nbytes = 0
        apply_seconds = 0.0
        stall: float | None = None
        try:
            cap = read_capture(folder)
            step, tiers, nbytes = cap.step, cap.tiers, cap.nbytes
            raw_stall = cap.metadata.get("capture_stall_seconds")
            if isinstance(raw_stall, int | float) and not isinstance(raw_stall, bool) and raw_stall >= 0:
                stall = float(raw_stall)
            if cap.seq != seq:
                raise CorruptCheckpointError(f"spool capture {folder}: says it is seq {cap.seq}")
            read_seconds = time.perf_counter() - t0
            result = self.tier.apply(
                cap.tensors,
                step=cap.step,
                token=cap.token,
                parent=cap.parent,
                metadata=cap.metadata,
                metrics=cap.metrics,
            )
            apply_seconds = result.seconds
            ack = Ack(seq, result.status, self.tier.step, self.tier.token, result.message)
        except Exception as e:  # whatever is wrong with this capture, answer it: never block the ones after it
            read_seconds = time.perf_counter() - t0
            ack = Ack(seq, "error", self.tier.step, self.tier.token, f"{type(e).__name__}: {e}")
            log.warning("spool %s: capture seq %d rejected: %s", self.root, seq, e)
            if not tiers:
                tiers = self._tiers_of(folder)
        durable = Tier.DURABLE in tiers
        if durable:
            if ack.status == "ok" and self.persister is not None:
                _atomic_write_json(self._paths.ack(seq, "pending"), {"seq": seq, "step": step})
            elif ack.status == "ok":
                self._write_durable_ack(DurableAck(seq, "error", None, None, "this agent has no durable store"))
            else:
                self._write_durable_ack(DurableAck(seq, "error", None, None, f"not applied: {ack.message}"))
        try:
            _atomic_write_json(self._paths.ack(seq), ack.to_json())
        except OSError:
            # Likely a full tmpfs: free the capture's space, then try once more (re-applying it is harmless).
            shutil.rmtree(folder, ignore_errors=True)
            _atomic_write_json(self._paths.ack(seq), ack.to_json())
        if durable and ack.status == "ok" and self.persister is not None:
            try:
                handle = self.persister.request(step, new_base=Tier.BASE in tiers)
            except PsguardError as e:  # the persister was stopped first
                self._write_durable_ack(DurableAck(seq, "error", None, None, str(e)))
            else:
                handle.add_done_callback(functools.partial(self._durable_done, seq))
        shutil.rmtree(folder, ignore_errors=True)
        self._counts[ack.status] = self._counts.get(ack.status, 0) + 1
        self._bytes += nbytes
        self._last_seq = seq
        self._last_apply = apply_seconds
        if ack.status == "error":
            self._last_error = ack.message
        self._emit(
            SpoolEvent("capture", seq, step, ack.status, nbytes, read_seconds, apply_seconds, ack.message, stall)
        )

    def _tiers_of(self, folder: Path) -> frozenset[Tier]:
        try:
            doc = json.loads((folder / "capture.json").read_bytes())
            return frozenset(Tier(t) for t in doc["tiers"])
        except Exception:
            return frozenset()

    def _durable_done(self, seq: int, handle: PersistHandle) -> None:
        try:
            error = handle.exception(0)
            if error is not None:
                ack = DurableAck(seq, "error", None, None, f"{type(error).__name__}: {error}")
            else:
                info = handle.result(0)
                if info is None:
                    ack = DurableAck(seq, "error", None, None, "the memory tier was empty; nothing was persisted")
                else:
                    ack = DurableAck(seq, "ok", info.id, info.step)
            self._write_durable_ack(ack)
        except Exception:
            log.exception("spool %s: could not write the durable ack of seq %d", self.root, seq)

    def _write_durable_ack(self, ack: DurableAck) -> None:
        _atomic_write_json(self._paths.ack(ack.seq, "durable"), ack.to_json())
        with contextlib.suppress(OSError):
            self._paths.ack(ack.seq, "pending").unlink()

    def _serve_restore(self, request: Path, name: str, gen: str) -> None:
        final = self._paths.restore / name
        if final.exists() or not self._writer_alive(gen):
            with contextlib.suppress(OSError):
                request.unlink()
            return
        t0 = time.perf_counter()
        tmp = self._paths.restore / f"{name}{_AGENT_TMP}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        durable = self.persister.status() if self.persister is not None else None
        nbytes = 0
        try:
            with self.tier.export() as snap:
                doc: dict[str, Any] = {
                    "format": RESTORE_FORMAT,
                    "version": VERSION,
                    "status": "empty" if snap.empty else "ok",
                    "step": snap.step,
                    "metadata": snap.metadata,
                    "token": snap.token,
                    "durable_id": durable.last_id if durable else None,
                    "durable_step": durable.last_step if durable else None,
                    "message": "no capture applied since the agent started" if snap.empty else "",
                    "tensors": [],
                }
                for i, (tname, value) in enumerate(snap.tensors.items()):
                    ref = _write_array(tmp, f"{i}.bin", value)
                    nbytes += int(ref["size"])
                    doc["tensors"].append(
                        {"name": tname, "dtype": dtype_name(value.dtype), "shape": list(value.shape), **ref}
                    )
            status = doc["status"]
        except (OSError, PsguardError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            status = "error"
            reason = "the spool's tmpfs is full" if isinstance(e, OSError) and e.errno == errno.ENOSPC else str(e)
            doc = {"format": RESTORE_FORMAT, "version": VERSION, "status": "error", "message": reason}
            log.warning("spool %s: could not export the memory tier: %s", self.root, e)
        (tmp / "manifest.json").write_bytes(json.dumps(doc, allow_nan=False).encode())
        os.rename(tmp, final)
        with contextlib.suppress(OSError):
            request.unlink()
        self._restores += 1
        self._emit(SpoolEvent("restore", None, doc.get("step"), status, nbytes, 0.0, time.perf_counter() - t0))

    def _writer_alive(self, gen: str) -> bool:
        if gen in self._dead_writers:
            return False
        path = self._paths.writers / f"{gen}.lock"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            self._dead_writers.add(gen)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        self._dead_writers.add(gen)
        return False

    def _prune(self) -> None:
        """Drop what nobody will read: answers to dead writers' restores, acks older than ``ack_ttl``."""
        now = time.time()
        if now - self._last_prune < min(60.0, self.ack_ttl / 2):
            return
        self._last_prune = now
        for p in self._paths.restore.iterdir():
            m = _RESTORE_RE.match(p.name)
            if m and not self._writer_alive(m.group(1)):
                shutil.rmtree(p, ignore_errors=True)
        for p in self._paths.writers.glob("*.lock.tmp"):  # a writer killed while creating its lock
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime < 60:
                    continue  # maybe being created right now (created, not yet locked)
            fd = _try_flock(p, fcntl.LOCK_EX)
            if fd is not None:
                with contextlib.suppress(OSError):
                    p.unlink()
                os.close(fd)
        for p in self._paths.acks.iterdir():
            if p.name.endswith(".pending.json"):
                continue
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > self.ack_ttl:
                    p.unlink()

    def _emit(self, event: SpoolEvent) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                log.exception("spool event callback failed (ignored)")
