"""Leases: the lock objects a save and a gc hold in the store, kept alive while they run.

The protocol (docs/storage-format.md, "Locks and leases"):

* A lease is a JSON object under ``locks/`` carrying a random ``token`` (its owner's proof) and ``ttl``.
* Its holder rewrites it every ``ttl / 5`` seconds (:class:`LeaseKeeper`, a thread with a handle) for as
  long as the save or gc runs, so a save longer than the TTL keeps its lock.
* A lease is read as plain JSON (:mod:`psguard.codec.strict_json`: no ``NaN``, no ``Infinity``) whose numbers
  are sane (:func:`lease_problem`: a TTL in ``(0, MAX_TTL]``, a positive pid, times from 1970 on); any
  other lease is *damaged*, said in the log and judged like a torn write (stale once a second old), never
  honoured for ever (a TTL of NaN or 1e300 never runs out).
* Nobody compares clocks across nodes. A lease is stale when the *storage* last wrote it more than ``ttl``
  ago, where "now" is also a time the storage wrote (the mtime of an object the judge itself just wrote):
  both times come from the one storage clock, so a writer whose clock runs minutes behind gc's is judged
  correctly.
* Only the owner deletes its lease: release reads the object and deletes it only if the token is still its
  own (read-check-delete; see the doc for the window this leaves on S3).
* A holder that could not refresh for ``ttl * 0.6`` (a stalled process, an unreachable store), or that finds
  its token gone or replaced, has *lost* the lease: whatever it was doing must fail, never report success.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from psguard.codec import strict_json
from psguard.errors import ConfigError, ObjectExistsError, ObjectNotFoundError, PsguardError, SaveError
from psguard.storage.base import Backend
from psguard.store.manifest import LOCK_PREFIX, MAX_TIMESTAMP

log = logging.getLogger(__name__)

#: A holder whose last successful refresh is older than this fraction of the TTL considers the lease lost:
#: the judge needs a full TTL without a refresh to call it stale, so the holder gives up well before that.
LOST_AFTER = 0.6
#: Refresh period as a fraction of the TTL: two failed or slow refreshes in a row are survived.
REFRESH_EVERY = 0.2
#: The lease of the gc running on a store (at most one); a save's lease is ``locks/writer-<checkpoint id>.json``.
GC_LOCK = f"{LOCK_PREFIX}gc.json"
#: The longest TTL a lease may declare, in seconds (a day; psguard's default is 10 minutes). A save or gc of any
#: length keeps its lease by refreshing it, so no holder needs more, and a longer one would keep a dead holder's
#: lock (gc refused, saves waiting) for longer than anyone would wait.
MAX_TTL = 86_400.0
#: Largest pid a lease may carry (Linux's own bound is 2**22).
_MAX_PID = 2**31 - 1
#: A lease document is a few hundred bytes.
_MAX_LEASE_BYTES = 64 << 10


class LeaseLostError(SaveError):
    """A save (or gc) lost its lock lease (someone judged it stale and took or removed it, or it could not be
    refreshed in time): its work is not protected any more and it must not report success."""


def check_ttl(ttl: float) -> float:
    """The TTL a holder in this process may take: :class:`ConfigError` unless in ``(0, MAX_TTL]``."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not (0 < ttl <= MAX_TTL):
        raise ConfigError(f"lock_ttl must be a number of seconds in (0, {MAX_TTL:g}], got {ttl!r}")
    return float(ttl)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def lease_problem(doc: Mapping[str, Any]) -> str | None:
    """Why ``doc`` is not a lease psguard could have written, or None: a TTL (older leases: ``expires_at -
    created_at``) in ``(0, MAX_TTL]``, a positive ``pid``, times from 1970 to the year 10000, string ``token`` and
    ``host``."""
    for key in ("token", "host"):
        if key in doc and not isinstance(doc[key], str):
            return f"{key} is not a string"
    pid = doc.get("pid", 1)
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _MAX_PID:
        return f"pid {str(pid)[:40]} is not a process id"
    for key in ("created_at", "expires_at"):
        if key in doc and not (_number(doc[key]) and 0 <= doc[key] <= MAX_TIMESTAMP):
            return f"{key} {str(doc[key])[:40]} is not a time"
    if "ttl" in doc:
        ttl = doc["ttl"]
    elif "created_at" in doc and "expires_at" in doc:
        ttl = doc["expires_at"] - doc["created_at"]
    else:
        return "it has no ttl"
    if not (_number(ttl) and 0 < ttl <= MAX_TTL):
        return f"ttl {str(ttl)[:40]} is not in (0, {MAX_TTL:g}] seconds"
    return None


def read_lease(backend: Backend, key: str) -> dict[str, Any] | None:
    """The lease document; ``{}`` for a damaged one (a torn write by a killed process, or numbers no psguard
    writes: :func:`lease_problem`), said in the log; None if absent."""
    try:
        raw = backend.get(key)
    except ObjectNotFoundError:
        return None
    try:
        doc = strict_json.loads(raw, max_bytes=_MAX_LEASE_BYTES)
    except strict_json.StrictJSONError as e:
        problem: str | None = str(e)
    else:
        problem = lease_problem(doc) if isinstance(doc, dict) else "not a JSON object"
    if problem is not None:
        log.warning(
            "event=lease_insane key=%s store=%s reason=%r action='judged as a damaged lock: stale once a second old'",
            key,
            backend.url,
            problem,
        )
        return {}
    return doc  # type: ignore[no-any-return]


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def lease_stale(doc: Mapping[str, Any], written_at: float, storage_now: float) -> bool:
    """Whether a lease whose object the storage wrote at ``written_at`` is dead at ``storage_now``.

    Both times are the storage's. Also stale at once: a damaged lease (unreadable, or insane by
    :func:`lease_problem`) older than a second, and a lease whose holder ran on this host and is gone.
    """
    age = storage_now - written_at
    if not doc or lease_problem(doc) is not None:
        return age > 1.0
    ttl = float(doc["ttl"]) if "ttl" in doc else float(doc["expires_at"]) - float(doc["created_at"])  # older locks
    if age > ttl:
        return True
    pid = doc.get("pid", 0)
    return doc.get("host") == socket.gethostname() and pid > 0 and not pid_alive(pid)


def storage_now(backend: Backend, *, hint_key: str | None = None) -> float:
    """The storage's clock, now: the mtime of an object just written (``hint_key`` if we just wrote it)."""
    if hint_key is not None:
        with contextlib.suppress(ObjectNotFoundError):
            return backend.mtime(hint_key)
    probe = f"locks/clock-{secrets.token_hex(6)}.json"
    backend.put(probe, b"{}")
    try:
        return backend.mtime(probe)
    finally:
        backend.delete(probe)


class Lease:
    """One lease object this process owns (its ``token`` in the payload)."""

    def __init__(self, backend: Backend, key: str, ttl: float, **fields: Any) -> None:
        self.backend = backend
        self.key = key
        self.ttl = check_ttl(ttl)
        self.token = secrets.token_hex(16)
        now = time.time()
        self.payload: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": self.token,
            "ttl": ttl,
            "created_at": now,  # informative only: the writer's clock is never compared with another's
            "expires_at": now + ttl,
            **fields,
        }
        self.refreshed = time.monotonic()  # last time the storage confirmed the lease was ours

    def _data(self) -> bytes:
        self.payload["expires_at"] = time.time() + self.ttl
        return json.dumps(self.payload).encode()

    def create(self, *, new: bool = False) -> None:
        """Write the lease, replacing any object (a writer's key is unique to its checkpoint); with ``new`` only if
        absent (:class:`ObjectExistsError` otherwise): gc's shared key."""
        started = time.monotonic()
        (self.backend.put_new if new else self.backend.put)(self.key, self._data())
        self.refreshed = started

    def refresh(self, *, fresh: float = 0.0) -> None:
        """Check the lease is still ours and rewrite it; :class:`LeaseLostError` when it is not. A lease last
        written less than ``fresh`` seconds ago is only read back (see :meth:`LeaseKeeper.confirm`)."""
        started = time.monotonic()
        if started - self.refreshed > self.ttl * LOST_AFTER:
            raise LeaseLostError(
                f"lease {self.key} on {self.backend.url} was not refreshed for {started - self.refreshed:.1f}s "
                f"(TTL {self.ttl:g}s): it may have been judged stale"
            )
        doc = read_lease(self.backend, self.key)
        if doc is None or doc.get("token") != self.token:
            holder = "removed" if doc is None else f"taken by {doc.get('host')}:{doc.get('pid')}"
            raise LeaseLostError(f"lease {self.key} on {self.backend.url} was {holder} (judged stale)")
        if started - self.refreshed < fresh:
            return
        self.backend.put(self.key, self._data())
        self.refreshed = started

    def release(self) -> None:
        """Delete the lease if it is still ours; never raises (the caller's own outcome matters more)."""
        try:
            doc = read_lease(self.backend, self.key)
            if doc is None:
                return
            if doc.get("token") != self.token:
                log.warning("event=lease_not_released key=%s reason='taken over by another holder'", self.key)
                return
            self.backend.delete(self.key)
        except PsguardError as e:
            log.warning("event=lease_release_failed key=%s error=%r", self.key, str(e))


class LeaseKeeper:
    """The handle of a background refresher, started with the work and stopped in ``finally``: :meth:`check`
    raises :class:`LeaseLostError` once the lease is lost; :meth:`confirm` refreshes now (right before a commit or a
    deletion) and raises the same way."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self._stop = threading.Event()
        self._mutex = threading.Lock()  # one refresh at a time (the thread's and confirm()'s)
        self._state = threading.Lock()  # guards _error; never held across storage calls
        self._error: LeaseLostError | None = None
        self._thread = threading.Thread(target=self._run, name=f"psguard-lease-{lease.key}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        period = max(0.01, self.lease.ttl * REFRESH_EVERY)
        while not self._stop.wait(period):
            try:
                self.confirm()
            except LeaseLostError:
                log.error("event=lease_lost key=%s error=%r", self.lease.key, str(self._error))
                return
            except Exception as e:  # storage trouble: try again next period, until LOST_AFTER says lost
                log.warning("event=lease_refresh_failed key=%s error=%r", self.lease.key, str(e))

    def confirm(self, *, fresh: float = 0.0) -> None:
        """Check the lease is ours now, refreshing it unless the storage wrote it less than ``fresh`` seconds
        ago: then it is only read back, its token still ours, and the judge's TTL leaves at least ``ttl - fresh``
        for the write it guards. A save's commit so spends one read, not a rewrite, on its usual short path (a
        write costs half a second on HDFS, whose client waits that long to close a file)."""
        with self._mutex:
            self.check()
            try:
                self.lease.refresh(fresh=fresh)
            except LeaseLostError as e:
                with self._state:
                    self._error = e
                raise

    def check(self) -> None:
        with self._state:
            error = self._error
        if error is not None:
            raise error

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


# ----------------------------------------------------------------------------------------------- the store's locks
def judging_now(backend: Backend, hint_key: str | None = None) -> float:
    """The storage's clock (never this host's; see above), minus its resolution: the "now" a lease is judged at."""
    return storage_now(backend, hint_key=hint_key) - backend.mtime_resolution


def read_lease_with_mtime(backend: Backend, key: str) -> tuple[dict[str, Any] | None, float]:
    """The lease and when the storage wrote it (read in that order: a refresh in between only makes the
    lease look younger, the safe side)."""
    doc = read_lease(backend, key)
    if doc is None:
        return None, 0.0
    try:
        return doc, backend.mtime(key)
    except ObjectNotFoundError:
        return None, 0.0


def remove_if_unchanged(backend: Backend, key: str, doc: Mapping[str, Any], written: float) -> bool:
    """Delete a lease judged stale, unless it changed since it was judged (refreshed, or taken over).

    Read-check-delete: on storage without a conditional delete a holder's refresh may still land
    between the check and the delete; the holder's next refresh then finds its lease gone and fails.
    """
    again, written_again = read_lease_with_mtime(backend, key)
    if again is None or again.get("token") != doc.get("token") or written_again != written:
        return False
    log.info("event=stale_lock_removed key=%s holder=%s:%s", key, doc.get("host"), doc.get("pid"))
    backend.delete(key)
    return True


def acquire_writer_lease(
    backend: Backend, cid: str, parent: str | None, ttl: float, *, dedup_against: str | None = None
) -> tuple[Lease, LeaseKeeper]:
    """Create a save's lease and start refreshing it; then wait for a live gc to finish.

    ``parent`` (the checkpoint the save builds on) and ``dedup_against`` (whose chunks it reuses) are in
    the lease, so gc keeps both while it is live."""
    key = f"{LOCK_PREFIX}writer-{cid}.json"
    extra = {"dedup_against": dedup_against} if dedup_against not in (None, parent) else {}
    lease = Lease(backend, key, ttl, checkpoint=cid, parent=parent, **extra)
    lease.create()
    keeper = LeaseKeeper(lease).start()
    try:
        # A gc that started before our lock existed may not have seen it: wait for it to finish.
        deadline = time.monotonic() + max(ttl, 30.0)
        while True:
            doc, written = read_lease_with_mtime(backend, GC_LOCK)
            if doc is None or lease_stale(doc, written, judging_now(backend, key)):
                return lease, keeper
            if time.monotonic() > deadline:
                raise SaveError(f"a gc on {backend.url} held its lock for over {max(ttl, 30.0):.0f}s")
            keeper.check()
            time.sleep(0.2)  # polling another process's lock in the store: there is no event to wait on
    except BaseException:
        keeper.stop()
        lease.release()
        raise


def live_writer_leases(backend: Backend, now: float, *, remove: bool = True) -> list[dict[str, Any]]:
    """Writer leases still alive at storage time ``now``; stale ones are removed (``remove``)."""
    live = []
    for key in (k for k in backend.keys(LOCK_PREFIX) if k.startswith(f"{LOCK_PREFIX}writer-")):
        doc, written = read_lease_with_mtime(backend, key)
        if doc is None:
            continue
        if lease_stale(doc, written, now):
            if remove:
                remove_if_unchanged(backend, key, doc, written)
        else:
            live.append(doc)
    return live


def acquire_gc_lease(backend: Backend, ttl: float) -> Lease:
    """Create the gc's lease (one gc at a time per store), taking over a stale one; refuse while another lives."""
    lease = Lease(backend, GC_LOCK, ttl, op="gc")
    try:
        lease.create(new=True)
    except ObjectExistsError:
        doc, written = read_lease_with_mtime(backend, GC_LOCK)
        if doc is not None:
            if not lease_stale(doc, written, judging_now(backend)):
                raise PsguardError(
                    f"another gc is running on {backend.url} ({doc.get('host')}:{doc.get('pid')}, "
                    f"since {doc.get('created_at')} by its clock); wait for it, it keeps its lock alive"
                ) from None
            remove_if_unchanged(backend, GC_LOCK, doc, written)
        try:
            lease.create(new=True)
        except ObjectExistsError:
            raise PsguardError(f"another gc started on {backend.url} just now; run this one later") from None
    return lease
