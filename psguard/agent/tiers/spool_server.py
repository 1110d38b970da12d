"""The agent's end of the spool (the protocol: :mod:`psguard.handoff.spool`)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from psguard.agent.tiers.memory_tier import MemoryTier, limit_malloc_retention
from psguard.agent.tiers.persister import Persister, PersistHandle
from psguard.agent.tiers.shard_client import ShardClient
from psguard.agent.tiers.shards import ShardError
from psguard.agent.tiers.spool_restores import RestoreAnswers
from psguard.errors import CorruptCheckpointError, PsguardError
from psguard.handoff.contract import Tier
from psguard.handoff.spool import (
    AGENT_TMP,
    REQ_RE,
    RESTORE_RE,
    SEQ_RE,
    TMP_RE,
    Ack,
    DurableAck,
    SpooledCapture,
    SpoolPaths,
    atomic_write_json,
    read_capture,
    read_json_if_present,
    try_flock,
)
from psguard.local_files import open_regular

log = logging.getLogger(__name__)

POLL_WITHOUT_WATCHDOG = 0.05
"""Seconds between scans of the spool when watchdog (an optional dependency) is not installed."""


def _not_watchdog_stop_race(record: logging.LogRecord) -> bool:
    """watchdog 7 logs an ERROR when an inotify event races its observer's stop (nothing is lost: the folders are
    scanned, not the events); every agent stop printed it."""
    return "called when the thread is inactive" not in record.getMessage()


@dataclass(frozen=True)
class SpoolEvent:
    """One capture or restore handled by the agent, for metrics."""

    kind: Literal["capture", "restore"]
    seq: int | None
    step: int | None
    status: str
    stall_seconds: float | None = None  # the trainer's training stall for this capture, when it said


@dataclass(frozen=True)
class SpoolServerStatus:
    running: bool
    captures: Mapping[str, int]
    last_error: str | None


class SpoolServer(RestoreAnswers):
    """The agent's end: applies captures to ``tier``, feeds ``persister``, serves restores (:class:`RestoreAnswers`).

    ``start()`` takes the spool's agent lock, cleans what dead processes left, and (``watch=True``) starts a
    processing thread woken by ``watchdog``; ``start(watch=False)`` is for callers driving :meth:`process_once`.
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
        shards: ShardClient | None = None,
    ) -> None:
        self._paths = SpoolPaths(root)
        #: The PS agents holding the shards the trainer captures on the PS nodes (issue 12).
        self.shards = shards
        self._order = shards.order if shards is not None else threading.Lock()
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
        self._marked_retrying: set[int] = set()  # pending durable answers that say the store is being retried
        self._answering = threading.Lock()
        self._last_error: str | None = None
        self._moved_said = False
        self._ahead_lock = threading.Lock()
        self._ahead = None

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self, *, watch: bool = True) -> SpoolServer:
        limit_malloc_retention()  # MB-sized buffers on several threads here too
        self._paths.make()
        self._stop.clear()
        deadline = time.monotonic() + self.lock_timeout
        while True:  # a trainer's liveness probe may hold a shared lock for a moment
            fd = try_flock(self._paths.agent_lock, fcntl.LOCK_EX)
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
            self._observer = self._observe()
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
        self._paths.release()

    @property
    def heartbeat(self) -> Path:
        """The trainer's heartbeat file, in the spool folder this agent holds (not whatever is at its path now)."""
        return self._paths.heartbeat

    def __enter__(self) -> SpoolServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def status(self) -> SpoolServerStatus:
        running = self._thread is not None and self._thread.is_alive()
        return SpoolServerStatus(running=running, captures=dict(self._counts), last_error=self._last_error)

    def _observe(self) -> Any:
        """A watchdog observer on the two folders the trainer writes, or ``None`` without watchdog installed
        (``psguard[watch]``): then the processing thread polls every :data:`POLL_WITHOUT_WATCHDOG` seconds."""
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:
            log.info("event=spool_polling spool=%s every=%ss reason=watchdog-not-installed", self.root, self._poll)
            return None
        logging.getLogger("watchdog.observers.inotify").addFilter(_not_watchdog_stop_race)
        wake = self._wake

        class Wake(FileSystemEventHandler):  # any change wakes the processing thread: it rescans
            def on_any_event(self, _: Any) -> None:
                wake.set()

        observer = Observer()
        for folder in (self._paths.incoming, self._paths.requests):
            observer.schedule(Wake(), str(folder), recursive=False)
        observer.start()
        return observer

    @property
    def _poll(self) -> float:
        return self.poll_interval if self._observer is not None else min(self.poll_interval, POLL_WITHOUT_WATCHDOG)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.process_once()
                self._show_store_retrying()
            except Exception as e:  # keep serving; the next scan retries
                self._last_error = f"{type(e).__name__}: {e}"
                log.exception("spool %s: processing failed", self.root)
            self._wake.wait(self._poll)

    def _show_store_retrying(self) -> None:
        """Tell the trainer, in the pending durable answers, that the store is failing and being retried, so that
        its durable-lag hold does not wait out the store's retry deadline (the answer still comes later)."""
        retrying = self.persister.store_retrying() if self.persister is not None else None
        if retrying is None and not self._marked_retrying:
            return
        marked: set[int] = set()
        for path in self._paths.acks.glob("*.pending.json"):
            number = path.name.split(".", 1)[0]  # acks/<seq:012d>.pending.json
            if not number.isdigit():
                continue
            seq = int(number)
            if retrying is not None:
                marked.add(seq)
            if (retrying is not None) == (seq in self._marked_retrying):
                continue  # already says so (or never did): not read again every poll of an outage
            doc = read_json_if_present(path)
            if doc is None:
                continue
            if retrying is not None:
                doc["store_retrying"] = {"since": time.time() - retrying.seconds, "error": retrying.error[:500]}
            else:
                doc.pop("store_retrying", None)
            with self._answering, contextlib.suppress(OSError):
                if path.exists():  # not answered meanwhile
                    atomic_write_json(path, doc)
        self._marked_retrying = marked

    def _recover(self) -> None:
        """At start (holding the agent lock): whatever a previous agent left half-done is ours to settle."""
        for p in self._paths.restore.iterdir():
            if p.name.endswith(AGENT_TMP):
                shutil.rmtree(p, ignore_errors=True)
        for p in self._paths.acks.iterdir():
            if p.name.startswith("."):
                with contextlib.suppress(OSError):
                    p.unlink()
            elif p.name.endswith(".pending.json"):
                why = "the agent was restarted before this capture became durable; send a whole capture"
                self._write_durable_ack(DurableAck(int(p.name.split(".", 1)[0]), "error", None, None, why))

    # ------------------------------------------------------------------------------------------- processing
    def process_once(self) -> int:
        """Process everything waiting, in order: captures first (so a restore sees them), then requests."""
        if self._lock_fd is None:
            raise PsguardError("start() the spool server (it takes the agent lock) before processing")
        with self._process_lock:
            self._check_held()
            done = 0
            seqs = []
            for name in os.listdir(self._paths.incoming):
                tmp = TMP_RE.match(name)
                if tmp:
                    if not self._writer_alive(tmp.group(2)):
                        log.info("spool %s: removing %s left by a dead writer", self.root, name)
                        shutil.rmtree(self._paths.incoming / name, ignore_errors=True)
                elif SEQ_RE.match(name):
                    seqs.append(int(name))
            for seq in sorted(seqs):
                if self._stop.is_set() and self._thread is not None:
                    break
                self._process_capture(seq)
                done += 1
            for name in sorted(os.listdir(self._paths.requests)):
                m = REQ_RE.match(name)
                if m:
                    served = self.serve(self._paths.requests / name, f"{m.group(1)}-{m.group(2)}", m.group(1))
                    if served is not None:
                        self._emit(SpoolEvent("restore", None, *served))
                elif name.startswith("."):
                    gen = re.search(r"restore-([0-9a-f]{8})-", name)
                    if gen and not self._writer_alive(gen.group(1)):
                        with contextlib.suppress(OSError):
                            (self._paths.requests / name).unlink()
            self._prune()
            return done

    def _check_held(self) -> None:
        """Say once, at ERROR and in :meth:`status`, that the spool's path no longer names the folder this agent
        holds (renamed away or replaced); it goes on serving the folder it opened and never reads the other."""
        if self._moved_said or not self._paths.moved():
            return
        self._moved_said = True
        self._last_error = (
            f"the spool path {self.root} no longer names the folder this agent opened (renamed away or replaced by "
            f"someone who can write {self.root.parent}); the agent serves the folder it opened and ignores what is "
            f"at the path now, so a trainer started from now on will not reach it. Make {self.root.parent} writable "
            "by this user only (or sticky, as /dev/shm is), or give --spool a folder there, and restart the job"
        )
        log.error("event=spool_moved spool=%s: %s", self.root, self._last_error)

    def _process_capture(self, seq: int) -> None:
        folder = self._paths.incoming / f"{seq:012d}"
        if self._answered_before(seq, folder):
            shutil.rmtree(folder, ignore_errors=True)  # a predecessor answered, then died before deleting
            return
        ack, step, tiers, stall = self._apply_capture(seq, folder)
        durable = Tier.DURABLE in tiers
        if durable:
            if ack.status == "ok" and self.persister is not None:
                atomic_write_json(self._paths.ack(seq, "pending"), {"seq": seq, "step": step})
            elif ack.status == "ok":
                self._write_durable_ack(DurableAck(seq, "error", None, None, "this agent has no durable store"))
            else:
                self._write_durable_ack(DurableAck(seq, "error", None, None, f"not applied: {ack.message}"))
        try:
            atomic_write_json(self._paths.ack(seq), ack.to_json())
        except OSError:
            # Likely a full tmpfs: free the capture's space, then try once more (re-applying it is harmless).
            shutil.rmtree(folder, ignore_errors=True)
            atomic_write_json(self._paths.ack(seq), ack.to_json())
        if durable and ack.status == "ok" and self.persister is not None:
            try:
                handle = self.persister.request(step, new_base=Tier.BASE in tiers)
            except PsguardError as e:  # the persister was stopped first
                self._write_durable_ack(DurableAck(seq, "error", None, None, str(e)))
            else:
                handle.add_done_callback(functools.partial(self._durable_done, seq))
        elif ack.status == "ok" and self.persister is not None and self.persister.start_first_base():
            log.info("event=first_base step=%s: the durable log has no base yet; writing this state as its base", step)
        shutil.rmtree(folder, ignore_errors=True)
        self._counts[ack.status] = self._counts.get(ack.status, 0) + 1
        if ack.status == "error":
            self._last_error = ack.message
        self._emit(SpoolEvent("capture", seq, step, ack.status, stall))

    def _answered_before(self, seq: int, folder: Path) -> bool:
        """Whether ``seq`` has its answer already (a predecessor answered, then died before deleting the capture)."""
        if not (self._paths.ack(seq).exists() or self._paths.ack(seq, "durable").exists()):
            return False
        answered = (_json_or_none(self._paths.ack(seq)) or {}).get("capture")
        mine = self._token_of(folder)
        if answered is not None and mine is not None and answered != mine:
            # Two captures under one seq: this one was never applied, and its writer sees the answer is not its own.
            log.error("spool %s: capture %s under seq %d dropped: seq already answered for %s", self.root, mine, seq,
                      answered)  # fmt: skip
        return True

    def _apply_capture(self, seq: int, folder: Path) -> tuple[Ack, int | None, frozenset[Tier], float | None]:
        """Read the capture ``seq`` and apply it to the tiers (its PS parts first): its answer (whatever is wrong
        with it: an answer never blocks the captures after it), step, tiers and the trainer's stall for it."""
        step: int | None = None
        tiers: frozenset[Tier] = frozenset()
        stall: float | None = None
        try:
            cap = read_capture(folder, shown=self._paths.show(folder))
            step, tiers = cap.step, cap.tiers
            raw_stall = cap.metadata.get("capture_stall_seconds")
            if isinstance(raw_stall, int | float) and not isinstance(raw_stall, bool) and raw_stall >= 0:
                stall = float(raw_stall)
            if cap.seq != seq:
                raise CorruptCheckpointError(f"spool capture {folder}: says it is seq {cap.seq}")
            with self._order:
                status, message = self._apply_parts(cap)
                if status == "ok":
                    result = self.tier.apply(
                        cap.tensors,
                        step=cap.step,
                        token=cap.token,
                        parent=cap.parent,
                        metadata=cap.metadata,
                        metrics=cap.metrics,
                    )
                    status, message = result.status, result.message
                    if status == "ok" and self.shards is not None:
                        self.shards.active = tuple(p.task for p in cap.parts)
                copies = (
                    self.shards.holders_of([p.task for p in cap.parts], cap.token)
                    if status == "ok" and self.shards is not None and cap.parts
                    else None
                )
            ack = Ack(seq, status, self.tier.step, self.tier.token, message, capture=cap.token, copies=copies)
            if status != "ok":  # the trainer learns it from the ack; whoever reads the log learns why
                log.warning("event=capture_not_applied seq=%d step=%d status=%s message=%r", seq, cap.step, status,
                            message[:500])  # fmt: skip
        except Exception as e:  # whatever is wrong with this capture, answer it: never block the ones after it
            ack = Ack(seq, "error", self.tier.step, self.tier.token, f"{type(e).__name__}: {e}", self._token_of(folder))
            log.warning("spool %s: capture seq %d rejected: %s", self.root, seq, e)
            with contextlib.suppress(Exception):  # what it asked for, if it says
                tiers = tiers or frozenset(Tier(t) for t in (_json_or_none(folder / "capture.json") or {})["tiers"])
        return ack, step, tiers, stall

    def _apply_parts(self, cap: SpooledCapture) -> tuple[Literal["ok", "need_full", "error"], str]:
        """Forward the capture's PS parts to their agents first: the chief's tier moves only if they all did."""
        if not cap.parts:
            return "ok", ""
        if self.shards is None:
            return "error", "the capture has shards on PS nodes, but this agent knows no PS agents (--peer)"
        try:
            return self.shards.apply(cap.parts, step=cap.step, token=cap.token, parent=cap.parent)
        except ShardError as e:
            return "error", str(e)

    def _token_of(self, folder: Path) -> str | None:
        token = (_json_or_none(folder / "capture.json") or {}).get("token")
        return token if isinstance(token, str) else None

    def _durable_done(self, seq: int, handle: PersistHandle) -> None:
        try:
            error = handle.exception(0)
            info = handle.result(0) if error is None else None
            if error is not None:
                ack = DurableAck(seq, "error", None, None, f"{type(error).__name__}: {error}")
            elif info is None:
                ack = DurableAck(seq, "error", None, None, "the memory tier was empty; nothing was persisted")
            else:
                ack = DurableAck(seq, "ok", info.id, info.step)
            self._write_durable_ack(ack)
        except Exception:
            log.exception("spool %s: could not write the durable ack of seq %d", self.root, seq)

    def _write_durable_ack(self, ack: DurableAck) -> None:
        with self._answering:  # never a pending file rewritten after its answer (_show_store_retrying)
            atomic_write_json(self._paths.ack(ack.seq, "durable"), ack.to_json())
            with contextlib.suppress(OSError):
                self._paths.ack(ack.seq, "pending").unlink()

    def _writer_alive(self, gen: str) -> bool:
        if gen in self._dead_writers:
            return False
        path = self._paths.writers / f"{gen}.lock"
        try:
            fd = open_regular(path, f"spool {self.root}, writer lock", private=True)
        except FileNotFoundError:
            fd = None
        except CorruptCheckpointError as e:  # no writer makes such a lock: nobody holds it
            log.warning("spool %s: %s", self.root, e)
            fd = None
        if fd is not None:
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
            m = RESTORE_RE.match(p.name)
            if m and not self._writer_alive(m.group(1)):
                shutil.rmtree(p, ignore_errors=True)
        for p in self._paths.writers.glob("*.lock.tmp"):  # a writer killed while creating its lock
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime < 60:
                    continue  # maybe being created right now (created, not yet locked)
            fd = try_flock(p, fcntl.LOCK_EX)
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


def _json_or_none(path: Path) -> dict[str, Any] | None:
    """A spool JSON document, or None when it is absent, not whole, or not a file psguard wrote (a FIFO put in
    its place is refused, never waited on): for what only names a capture in an answer."""
    try:
        return read_json_if_present(path)
    except (OSError, PsguardError) as e:
        log.warning("spool file %s ignored: %s", path.name, e)
        return None
