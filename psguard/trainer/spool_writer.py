"""The trainer's end of the spool (the protocol: :mod:`psguard.handoff.spool`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from psguard.errors import ConfigError, CorruptCheckpointError, PsguardError, SaveError, StorageError
from psguard.handoff.contract import Tier
from psguard.handoff.parts import ShardKey
from psguard.handoff.spool import (
    CAPTURE_FORMAT,
    VERSION,
    Ack,
    Capture,
    DeltaWithoutParentError,
    DurableAck,
    NeedFullCaptureError,
    Restored,
    SpoolPaths,
    atomic_write_json,
    atomic_write_text,
    check_json,
    payload_bytes,
    poll_until,
    read_json_if_present,
    read_restore,
    try_flock,
    write_capture_files,
    write_private,
)
from psguard.local_files import open_regular, read_regular

log = logging.getLogger(__name__)

#: Sequence numbers stay below this (18 digits): a larger one in the spool is garbage, not a number to follow.
MAX_SEQ = 10**18
T = TypeVar("T")


class CaptureHandle:
    """One capture handed off. :meth:`result` waits for the memory tier; :meth:`durable` for the log.
    Thread-safe: each answer is read and deleted once, under a lock, and kept for every caller."""

    def __init__(self, writer: SpoolWriter, seq: int, token: str, step: int, tiers: frozenset[Tier]) -> None:
        self._writer = writer
        self.seq = seq
        self.token = token
        self.step = step
        self.tiers = tiers
        self._ack: Ack | None = None
        self._durable: DurableAck | None = None
        self._answers = threading.Lock()

    def done(self) -> bool:
        """True once the agent answered (without consuming the answer)."""
        return self._ack is not None or self._writer._paths.ack(self.seq).exists()

    def durable_answered(self) -> bool:
        """True once the durable log's outcome is in (without consuming it)."""
        return self._durable is not None or self._writer._paths.ack(self.seq, "durable").exists()

    def store_retrying(self) -> str | None:
        """While the durable answer is not in: why the agent's store is failing and being retried, if it is."""
        if self._durable is not None:
            return None
        doc = read_json_if_present(self._writer._paths.ack(self.seq, "pending"))
        retrying = doc.get("store_retrying") if doc is not None else None
        if not isinstance(retrying, dict):
            return None
        since = retrying.get("since")
        seconds = time.time() - since if isinstance(since, (int, float)) else 0.0
        return f"the store has failed for {max(0.0, seconds):.0f}s and is being retried: {retrying.get('error')}"

    def result(self, timeout: float | None = None) -> Ack:
        """The agent's ack once the capture is applied to the memory tier (the save is *restorable*).

        Raises :class:`NeedFullCaptureError` when the agent needs a whole capture, :class:`SaveError` when it
        rejected the capture, :class:`TimeoutError` when no answer came within ``timeout`` seconds.
        """
        ack = self._ack or poll_until(
            self._take_ack,
            timeout,
            self._writer.poll_interval,
            lambda: self._writer._no_answer(f"capture seq {self.seq} (step {self.step})", timeout),
        )
        if ack.status == "need_full":
            raise NeedFullCaptureError(f"capture seq {self.seq} (step {self.step}) not applied: {ack.message}", ack)
        if ack.status != "ok":
            raise SaveError(f"the agent rejected capture seq {self.seq} (step {self.step}): {ack.message}")
        return ack

    def durable(self, timeout: float | None = None) -> DurableAck:
        """The durable log's outcome (the save is *durable*); raises :class:`SaveError` on failure."""
        if Tier.DURABLE not in self.tiers:
            raise ConfigError(f"capture seq {self.seq} was not meant for the durable tier")
        durable = self._durable or poll_until(
            self._take_durable,
            timeout,
            max(self._writer.poll_interval, 0.05),
            lambda: self._writer._no_answer(f"the durable save of capture seq {self.seq}", timeout),
        )
        if durable.status != "ok":
            raise SaveError(f"capture seq {self.seq} (step {self.step}) did not become durable: {durable.message}")
        return durable

    def _take(self, kind: str = "") -> dict[str, Any] | None:
        """The agent's answer of ``kind`` (``""``: the memory tier's), read and deleted; None while absent."""
        path = self._writer._paths.ack(self.seq, kind)
        doc = read_json_if_present(path)
        if doc is not None:
            with contextlib.suppress(OSError):
                path.unlink()
        return doc

    def _take_ack(self) -> Ack | None:
        """The memory tier's answer, taken by whichever caller comes first; None while there is none."""
        with self._answers:
            if self._ack is None and (doc := self._take()) is not None:
                status, message, answered = doc.get("status", "error"), str(doc.get("message", "")), doc.get("capture")
                # An agent names the capture it answers (None only when it could not read which: never with ok).
                if "capture" in doc and (answered != self.token) and (answered is not None or status == "ok"):
                    # Not this capture's answer (two captures under one seq): never take it for ours.
                    status = "error"
                    message = f"the agent's answer under seq {self.seq} is for capture {answered}, not {self.token}"
                copies = _copies(doc.get("copies"))
                self._ack = Ack(self.seq, status, doc.get("memory_step"), doc.get("token"), message, answered, copies)
                self._writer._answered(self.seq, self._ack)
            return self._ack

    def _take_durable(self) -> DurableAck | None:
        """The durable log's answer, taken once as :meth:`_take_ack` takes the memory tier's."""
        with self._answers:
            if self._durable is None and (doc := self._take("durable")) is not None:
                ok, step, message = doc.get("status") == "ok", doc.get("durable_step"), str(doc.get("message", ""))
                self._durable = DurableAck(self.seq, "ok" if ok else "error", doc.get("checkpoint"), step, message)
            return self._durable


class RestoreHandle:
    """A pending request for the memory tier's snapshot."""

    def __init__(self, writer: SpoolWriter, name: str) -> None:
        self._writer = writer
        self.name = name

    @property
    def folder(self) -> Path:
        return self._writer._paths.restore / self.name

    def result(self, timeout: float | None = None) -> Restored:
        """Wait for the export, verify it, delete it, return it (see :func:`read_restore` for errors)."""
        poll_until(
            lambda: True if self.folder.is_dir() else None,
            timeout,
            self._writer.poll_interval,
            lambda: self._writer._no_answer("the restore request", timeout),
        )
        try:
            return read_restore(self.folder, shown=self._writer._paths.show(self.folder))
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


class SpoolWriter:
    """The trainer's end of the spool: a few file writes and one rename per capture, no thread.
    ``parent``: the token of the state the next delta applies to (set after a restore; then it follows)."""

    def __init__(self, root: str | Path, *, parent: str | None = None, poll_interval: float = 0.005) -> None:
        self._paths = SpoolPaths(root)
        self._paths.make()
        self.root = self._paths.root
        self.poll_interval = poll_interval
        self.generation = secrets.token_hex(4)
        self._lock = threading.Lock()
        self._parent = parent
        self._chain_start = 0  # a capture from here on that is not applied breaks the chain
        lock_tmp = self._paths.writers / f"{self.generation}.lock.tmp"
        fd = try_flock(lock_tmp, fcntl.LOCK_EX)
        if fd is None:  # pragma: no cover - a fresh random name
            raise PsguardError(f"could not lock {lock_tmp}")
        self._lock_fd: int | None = fd
        self._lock_path = self._paths.writers / f"{self.generation}.lock"
        os.rename(lock_tmp, self._lock_path)  # only now visible: never seen unlocked by the agent
        self._last_seq = -1  # the last seq this writer reserved

    @contextlib.contextmanager
    def _seq_locked(self) -> Iterator[None]:
        """An exclusive flock on ``seq.lock`` (held for a read and a rename: microseconds)."""
        fd = open_regular(self._paths.seq_lock, "spool sequence lock", create=True, private=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _reserve_seq(self) -> int:
        """The next sequence number, reserved atomically across every process writing to this spool: ``seq``
        (absent or garbled: the highest number in the spool's folders) plus one, written under the lock."""
        with self._seq_locked():
            try:
                last = int(self._read_seq())
                if not 0 <= last < MAX_SEQ:
                    raise ValueError("out of range")
            except (FileNotFoundError, ValueError, CorruptCheckpointError):  # replaced by the write below
                names = [*os.listdir(self._paths.incoming), *os.listdir(self._paths.acks)]
                found = (re.match(r"^\.?([0-9]{1,18})(?![0-9])", n) for n in names)  # a huge name is not a number
                last = max((int(m.group(1)) for m in found if m), default=-1)
            seq = max(last, self._last_seq) + 1
            atomic_write_text(self._paths.seq, str(seq))
        self._last_seq = seq
        return seq

    def _read_seq(self) -> str:
        return read_regular(self._paths.seq, "spool sequence number", max_bytes=64, private=True).decode().strip()

    @property
    def parent(self) -> str | None:
        return self._parent

    @parent.setter
    def parent(self, token: str | None) -> None:
        with self._lock:
            self._parent = token
            self._chain_start = self._last_seq + 1  # this writer's later captures all get higher numbers

    def agent_alive(self) -> bool:
        """Whether an agent holds the spool (flock probe; never blocks)."""
        fd = try_flock(self._paths.agent_lock, fcntl.LOCK_SH)
        if fd is None:
            return True
        os.close(fd)
        return False

    def submit(self, capture: Capture) -> CaptureHandle:
        """Hand ``capture`` off (written out, then one rename); :class:`StorageError` when the spool is full
        (nothing half-written stays), :class:`DeltaWithoutParentError` for a delta with no parent state."""
        if capture.step < 0:
            raise ConfigError(f"step must be >= 0, got {capture.step}")
        metadata = check_json(capture.metadata)
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
                raise DeltaWithoutParentError(
                    "this delta has no parent state: send a whole capture first (capture(full=True)), or set "
                    "writer.parent to the token of the state the trainer restored"
                )
            need, st = payload_bytes(capture), os.statvfs(self._paths.incoming)
            if need > (free := st.f_bavail * st.f_frsize):
                raise StorageError(
                    f"spool {self.root} has {free / 1e6:.1f} MB free, capture seq {self._last_seq + 1} (step "
                    f"{capture.step}) needs {need / 1e6:.1f} MB: not handed off. Enlarge the tmpfs (docker "
                    "--shm-size, a bigger emptyDir medium: Memory limit) or point the spool elsewhere"
                )
            seq = self._reserve_seq()
            token = f"{self.generation}-{seq}"
            tmp = self._paths.incoming / f"{seq}.tmp-{self.generation}"
            try:
                tmp.mkdir()
                entries = write_capture_files(tmp, capture)
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
                    "parts": [p.to_json() for p in capture.parts],
                }
                write_private(tmp / "capture.json", json.dumps(doc, allow_nan=False).encode())
                os.rename(tmp, self._paths.incoming / f"{seq:012d}")  # the hand-off
            except BaseException as e:
                shutil.rmtree(tmp, ignore_errors=True)
                # Give seq back (a full tmpfs) if no one reserved a later one.
                with contextlib.suppress(OSError, ValueError, CorruptCheckpointError), self._seq_locked():
                    if int(self._read_seq()) == seq:
                        atomic_write_text(self._paths.seq, str(seq - 1))
                        self._last_seq = seq - 1
                if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                    raise StorageError(
                        f"spool {self.root} filled up (ENOSPC) while writing capture seq {seq} (step {capture.step}): "
                        "not handed off, nothing left behind. Enlarge the tmpfs (docker --shm-size) or point the "
                        "spool elsewhere"
                    ) from e
                if isinstance(e, OSError):
                    raise StorageError(f"writing capture seq {seq} to spool {self.root} failed: {e}") from e
                raise
            self._parent = token
            if whole:
                self._chain_start = seq
        return CaptureHandle(self, seq, token, capture.step, frozenset(tiers))

    def _answered(self, seq: int, ack: Ack) -> None:
        """A capture that was not applied breaks the chain of every later delta (until a whole capture)."""
        if ack.status != "ok":
            with self._lock:
                if seq >= self._chain_start:
                    self._parent = None

    def _no_answer(self, what: str, timeout: float | None) -> str:
        agent = "an agent holds the spool" if self.agent_alive() else "no agent is running on this spool"
        return f"no answer from the agent for {what} within {timeout}s ({agent}: {self.root})"

    def heartbeat(self, step: int, hang_after: float | None) -> None:
        """Tell the agent the trainer made ``step`` (see the protocol); best effort, never raises."""
        try:
            atomic_write_json(
                self._paths.heartbeat,
                {"step": int(step), "at": time.time(), "pid": os.getpid(), "hang_after": hang_after},
            )
        except OSError as e:
            log.debug("heartbeat not written to %s: %s", self.root, e)

    def request_restore(
        self,
        *,
        checkpoint: str | None = None,
        shards: Mapping[str, Sequence[ShardKey]] | None = None,
        force: bool = False,
    ) -> RestoreHandle:
        """Ask the agent for its memory tier's snapshot; with ``checkpoint``, first bring every tier to that
        durable checkpoint (each PS's agent reading its rows of ``shards``), refused with
        :class:`~psguard.handoff.spool.NewerInMemoryError` when the tiers hold a newer state, unless ``force``."""
        name = f"{self.generation}-{secrets.token_hex(6)}"
        doc: dict[str, Any] = {"writer": self.generation, "at": time.time()}
        if checkpoint is not None:
            doc["checkpoint"] = checkpoint
            doc["force"] = force
            doc["shards"] = {t: [[k.name, k.offset, k.rows] for k in keys] for t, keys in (shards or {}).items()}
        atomic_write_json(self._paths.requests / f"restore-{name}.json", doc)
        return RestoreHandle(self, name)

    def close(self) -> None:
        """Release the writer's lock (a killed writer's is released by the kernel) and the spool folder."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                self._lock_path.unlink()
            os.close(self._lock_fd)
            self._lock_fd = None
        self._paths.release()

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copies(raw: object) -> dict[str, str | None] | None:
    """An ack's ``copies`` (PS task -> holder or null); anything else from an older or damaged ack: unknown."""
    return {str(k): v if isinstance(v, str) else None for k, v in raw.items()} if isinstance(raw, dict) else None
