"""Peer copies: every PS agent also holds a copy of another node's shards, so losing a node loses no memory tier.

Why: when a PS dies with its agent (a pod evicted, a machine gone), the node's memory tier is gone, and without
a copy elsewhere its new agent reads the PS's rows from the durable log at the store's rate: as slow as
TensorFlow's own restore, and older (the durable interval, not the memory one). With a copy on another node the
new agent fetches the shards from the peer's memory over the network, at the newest capture.

How (docs/design.md, "Peer copies"):

- **Placement** is the chief's agent's: a ring over the PS tasks that skips tasks on the same node, or the
  user's ``peers.copy_placement``. It names each part's holder in every ``/shards/apply``, so a moved or
  restarted agent is picked up at the next capture.
- **The owner pushes** (:class:`CopySender`): after its tier applied a capture, the changed rows go to the
  holder in the background, bounded in queued bytes (past the bound the queue is dropped and the next send is
  whole) and in bandwidth. Training never waits on it; a holder that is down or lags is reported
  (``/status``: ``copy_out.lag_steps``).
- **The holder** (:class:`CopyHolder`) keeps one :class:`MemoryTier` per owner, under the owner's tokens: a
  delta applies only on top of the state it names, exactly as in the owner's tier, or the holder answers
  ``need_full`` and the owner sends its whole state again.
- **Verification.** The owner keeps a digest per shard of its tier's state (:func:`rows_digest`, a sum over
  rows of a hash of the row's index and bytes, so a delta updates it from the rows it changes) and sends it with
  every frame. The holder checks each delta against it before applying (its own old rows out, the new rows in),
  and a new agent fetching a copy checks the bytes it received against it before its tier takes them. Frames
  carry a CRC32 of their payload. Nothing is restored from a copy that does not verify.
- A peer copy is never durable: it only ever serves a restore of the memory tier's state.
- ``copies: parity``: the same sender feeds one XOR block per group of PS instead (frames with ``parity`` in
  their header go to the holder's :class:`ParityPart`, :mod:`psguard.agent.tiers.parity`).

The frames and the digests: :mod:`psguard.agent.tiers.copy_frames`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from psguard.agent.tiers.copy_frames import (
    MASK,
    Frame,
    decode_frame,
    delta_digest,
    delta_rows,
    digests_from,
    digests_json,
    encode_frame,
    frame_parts,
    rows_digest,
)
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.codec.dtypes import dtype_from_name
from psguard.errors import CorruptCheckpointError, PsguardError
from psguard.tensors import FullStream, Rows, Same, TensorUpdate

#: A holder's answer read as it arrives (url, body, timeout, the rows' array, ``take(row, rows)`` called with each
#: piece): :meth:`psguard.agent.copies.PeerLink.read_copy_into`. Returns the answer's header.
ReadInto = Callable[[str, Mapping[str, Any], float, np.ndarray, Callable[[int, np.ndarray], None]], dict[str, Any]]

__all__ = [
    "CopyHolder",
    "CopySender",
    "fetch_copy",
    "new_delta",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- holder
@dataclass
class _Copy:
    tier: MemoryTier
    layout: list[dict[str, Any]]  # per tensor: name (tier name), key [name, offset, rows], shape (logical), dtype
    digests: dict[str, int]
    received_at: float
    bytes_in: int = 0
    # The last delta's way back: the state it applied to, its step, the rows it overwrote and the digests
    # before it (an owner's capture that did not reach every PS: see ShardKeeper._roll_back_to).
    undo: tuple[str, int, dict[str, tuple[np.ndarray, np.ndarray]], dict[str, int]] | None = None


class ParityPart(Protocol):
    """The parity blocks an agent holds (:class:`psguard.agent.tiers.parity.ParityHolder`): the frames and reads
    of owners in ``copies: parity`` go there."""

    def put(self, owner: str, header: dict[str, Any], arrays: list[np.ndarray], nbytes: int) -> dict[str, Any]: ...

    def holds(self, owner: str) -> bool: ...

    def read(self, doc: Mapping[str, Any]) -> bytes | Frame: ...


@dataclass
class _Incoming:
    header: dict[str, Any]
    arrays: dict[str, np.ndarray]
    filled: dict[str, int]


class CopyHolder:
    """The copies this agent holds of other PS agents' shards (one tier per owner task)."""

    def __init__(self, task: str, on_copy: Callable[[str, int], None] | None = None) -> None:
        """``on_copy(owner, bytes)``: after each change of a copy (the agent's metrics)."""
        self.task = task
        self.on_copy = on_copy
        self._lock = threading.Lock()
        self._copies: dict[str, _Copy] = {}
        self._incoming: dict[str, _Incoming] = {}  # owner -> a whole copy being received
        self._refused = 0
        self.parity: ParityPart | None = None  # the parity blocks held here, if any

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                owner: {
                    "step": c.tier.step,
                    "token": c.tier.token,
                    "bytes": c.tier.status().nbytes,
                    "age_seconds": round(time.time() - c.received_at, 3),
                }
                for owner, c in self._copies.items()
            } | ({"refused_frames": self._refused} if self._refused else {})

    def put(self, body: bytes) -> dict[str, Any]:
        """One frame from an owner: ``begin``/``fill``/``end`` of a whole copy, or a ``delta``."""
        header, arrays = decode_frame(body)
        owner = header.get("task")
        if not isinstance(owner, str) or not owner.startswith("ps:") or owner == self.task:
            raise CorruptCheckpointError(f"peer copy frame: bad owner {owner!r}")
        if header.get("parity") is not None:
            if self.parity is None:
                raise CorruptCheckpointError("peer copy frame: parity is not held here")
            self.drop(owner)  # the owner's copies moved to parity: its full copy is behind already
            return self.parity.put(owner, header, arrays, len(body))
        op = header.get("op")
        if op == "begin":
            return self._begin(owner, header)
        if op == "fill":
            return self._fill(owner, header, arrays)
        if op == "end":
            return self._end(owner, header)
        if op == "delta":
            return self._delta(owner, header, arrays, len(body))
        raise CorruptCheckpointError(f"peer copy frame: unknown op {op!r}")

    def _begin(self, owner: str, header: dict[str, Any]) -> dict[str, Any]:
        layout = header.get("tensors")
        if not isinstance(layout, list):
            raise CorruptCheckpointError("peer copy begin: no tensors")
        # The copy this replaces is behind the owner already (a whole copy is sent when the holder cannot take a
        # delta), so it could not serve a restore at the chief's state: drop it now and fill its arrays in place
        # where they fit, so that the holder never holds two copies of one owner (2x the memory of the copy).
        with self._lock:
            old = self._copies.pop(owner, None)
            self._incoming.pop(owner, None)
        reuse: dict[str, np.ndarray] = {}
        if old is not None:
            reuse = {n: a for n in old.tier.names() if (a := old.tier.take_array(n)) is not None}
            del old
        arrays: dict[str, np.ndarray] = {}
        for t in layout:
            try:
                name = str(t["name"])
                shape, dtype = tuple(int(x) for x in t["array_shape"]), dtype_from_name(str(t["dtype"]))
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptCheckpointError(f"peer copy begin: bad tensor {t!r}: {e}") from None
            have = reuse.pop(name, None)
            ok = have is not None and have.shape == shape and have.dtype == dtype and have.flags.writeable
            arrays[name] = have if ok and have is not None else np.empty(shape, dtype=dtype)
        reuse.clear()
        with self._lock:
            self._incoming[owner] = _Incoming(header, arrays, dict.fromkeys(arrays, 0))
        return {"status": "ok"}

    def _fill(self, owner: str, header: dict[str, Any], arrays: list[np.ndarray]) -> dict[str, Any]:
        with self._lock:
            inc = self._incoming.get(owner)
        if inc is None or inc.header.get("session") != header.get("session"):
            return {"status": "need_full", "message": "no whole copy in progress for this session"}
        name, start = header.get("name"), header.get("start")
        target = inc.arrays.get(str(name))
        if target is None or type(start) is not int or len(arrays) != 1:
            raise CorruptCheckpointError("peer copy fill: bad tensor or start")
        rows = arrays[0]
        if rows.dtype != target.dtype or rows.shape[1:] != target.shape[1:] or start + rows.shape[0] > target.shape[0]:
            raise CorruptCheckpointError(f"peer copy fill: rows do not fit {name}")
        target[start : start + rows.shape[0]] = rows
        inc.filled[str(name)] += rows.shape[0]
        return {"status": "ok"}

    def _end(self, owner: str, header: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            inc = self._incoming.pop(owner, None)
        if inc is None or inc.header.get("session") != header.get("session"):
            return {"status": "need_full", "message": "no whole copy in progress for this session"}
        short = [n for n, a in inc.arrays.items() if inc.filled[n] != a.shape[0]]
        if short:
            return {"status": "need_full", "message": f"rows missing in {short[:3]}"}
        digests = digests_from(inc.header.get("digests"))
        bad = [n for n, a in inc.arrays.items() if rows_digest(a) != digests.get(n)]
        if bad:
            with self._lock:
                self._refused += 1
            log.error("event=peer_copy_refused owner=%s holder=%s tensors=%s: digest mismatch", owner, self.task, bad)
            return {"status": "need_full", "message": f"digest mismatch in {bad[:3]}"}
        tier = MemoryTier()
        h = inc.header
        tier.seed(int(h["step"]), inc.arrays, metadata=h.get("metadata") or {}, token=str(h["token"]), durable=False)
        nbytes = sum(a.nbytes for a in inc.arrays.values())
        with self._lock:
            self._copies[owner] = _Copy(tier, list(h["tensors"]), digests, time.time(), nbytes)
        log.info("event=peer_copy_whole owner=%s holder=%s step=%s bytes=%d", owner, self.task, h["step"], nbytes)
        if self.on_copy is not None:
            self.on_copy(owner, nbytes)
        return {"status": "ok", "step": tier.step, "token": tier.token}

    def _delta(self, owner: str, header: dict[str, Any], arrays: list[np.ndarray], nbytes: int) -> dict[str, Any]:
        with self._lock:
            copy = self._copies.get(owner)
        parent, token, step = header.get("parent"), header.get("token"), header.get("step")
        if copy is None or copy.tier.token != parent:
            have = None if copy is None else copy.tier.token
            return {"status": "need_full", "message": f"the copy holds {have}, the delta applies to {parent}"}
        if not isinstance(token, str) or type(step) is not int:
            raise CorruptCheckpointError("peer copy delta: bad token or step")
        digests = digests_from(header.get("digests"))
        updates: dict[str, TensorUpdate] = {}
        new_digests = dict(copy.digests)
        undo_rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        it = iter(arrays)
        with copy.tier.export() as snap:
            for t in header.get("tensors") or []:
                name, kind = str(t.get("name")), t.get("kind")
                current = snap.tensors.get(name)
                if current is None:
                    raise CorruptCheckpointError(f"peer copy delta: unknown tensor {name}")
                if kind == "same":
                    updates[name] = Same(current.shape, current.dtype)
                    continue
                ids, values = delta_rows(it, name, kind, current.shape[0], "peer copy")
                before = current[ids]
                undo_rows[name] = (ids, before)
                new_digests[name] = delta_digest(copy.digests.get(name, 0), ids, before, values)
                updates[name] = Rows(ids, values, current.shape)
        bad = sorted(n for n in updates if new_digests.get(n) != digests.get(n))
        if bad:
            with self._lock:
                self._refused += 1
            log.error("event=peer_copy_refused owner=%s holder=%s tensors=%s: digest mismatch", owner, self.task, bad)
            return {"status": "need_full", "message": f"digest mismatch in {bad[:3]}"}
        before_step = copy.tier.step
        result = copy.tier.apply(updates, step=step, token=token, parent=parent, metadata=header.get("metadata"))
        if result.ok:
            if before_step is not None and result.message != "already applied":
                copy.undo = (str(parent), before_step, undo_rows, copy.digests)
            copy.digests = new_digests
            copy.received_at = time.time()
            copy.bytes_in += nbytes
        return {"status": result.status, "step": copy.tier.step, "token": copy.tier.token, "message": result.message}

    def read(self, doc: Mapping[str, Any]) -> bytes | Frame:
        """A frame of what a new agent of ``owner`` fetches: ``{"owner", "token"}`` gives the layout, token and
        digests (the copy's last delta undone first when that gives ``token``); with ``"name", "start",
        "stop"`` the rows of one tensor (only while the copy is at ``token``), as a :class:`Frame` of views of the
        copy, under an export lease its sender releases: no copy of the rows at all."""
        owner = doc.get("owner")
        with self._lock:
            copy = self._copies.get(str(owner))
        if copy is None and self.parity is not None and self.parity.holds(str(owner)):
            return self.parity.read(doc)
        if copy is None:
            return encode_frame({"status": "empty", "message": f"{self.task} holds no copy of {owner}"})
        wanted = doc.get("token")
        if isinstance(wanted, str) and copy.tier.token != wanted:
            self._roll_back(str(owner), copy, wanted)
        snap = copy.tier.export()
        sent = False
        try:
            if "name" not in doc:
                return encode_frame(
                    {
                        "status": "ok",
                        "step": snap.step,
                        "token": snap.token,
                        "metadata": snap.metadata,
                        "tensors": copy.layout,
                        "digests": digests_json(copy.digests),
                    }
                )
            if doc.get("token") != snap.token:
                return encode_frame({"status": "mismatch", "step": snap.step, "token": snap.token})
            arr = snap.tensors.get(str(doc.get("name")))
            start, stop = doc.get("start"), doc.get("stop")
            if arr is None or type(start) is not int or type(stop) is not int or not 0 <= start <= stop:
                raise CorruptCheckpointError("peer copy read: bad tensor or row range")
            # No CRC: fetch_copy checks every row against the owner's digests (rows_digest) before any is used.
            parts = frame_parts({"status": "ok", "token": snap.token}, [arr[start:stop]], crc=False)
            frame = Frame(parts, snap.release)
            sent = True  # the lease goes with the frame: released once it is written
            return frame
        finally:
            if not sent:
                snap.release()

    def _roll_back(self, owner: str, copy: _Copy, token: str) -> bool:
        """Undo the copy's last delta when that gives state ``token`` (the chief's: the owner's last capture
        reached this copy but not every PS). True when the copy is at ``token`` now."""
        undo = copy.undo
        if undo is None or undo[0] != token:
            return False
        _, step, rows, digests = undo
        result, _ = copy.tier.revert(rows, step=step, token=token)
        if not result.ok:
            return False
        copy.digests, copy.undo = digests, None
        log.info("event=peer_copy_rolled_back owner=%s holder=%s to_step=%d", owner, self.task, step)
        return True

    def drop(self, owner: str) -> None:
        with self._lock:
            self._copies.pop(owner, None)
            self._incoming.pop(owner, None)


# ---------------------------------------------------------------------------------------------------- sender
class WholeView(Protocol):
    """What a whole copy is read from: a state of the owner's tier read in row ranges, released when sent (a
    :class:`~psguard.agent.tiers.memory_tier.StreamSnapshot`, or the tier with its fingerprints)."""

    step: int | None
    token: str | None
    metadata: dict[str, Any]
    tensors: Mapping[str, FullStream]

    @property
    def empty(self) -> bool: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass
class _Delta:
    step: int
    token: str
    parent: str
    updates: dict[str, TensorUpdate]
    digests: dict[str, int]
    metadata: dict[str, Any]
    nbytes: int


def _same_copy(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two frames' extra fields describe the same copy: equal but for the parity group's URLs. A member
    replaced on a new node has a new address; the holder learns it from any frame, and the block still holds every
    member at its state, so a survivor must not send its whole (it would reset the group)."""

    def without_urls(x: Mapping[str, Any]) -> dict[str, Any]:
        parity = x.get("parity")
        if isinstance(parity, Mapping):
            return {**x, "parity": {k: v for k, v in parity.items() if k != "urls"}}
        return dict(x)

    return without_urls(a) == without_urls(b)


class CopySender:
    """The owner's side: pushes its tier's state to the holder the chief named, in the background.

    ``snapshot``: under the owner's lock, a consistent ``(Snapshot, layout, digests)`` of its tier (the
    layout as :class:`CopyHolder` keeps it); ``post``: sends one frame to a URL and returns the answer's JSON.
    """

    def __init__(
        self,
        task: str,
        snapshot: Callable[[], tuple[WholeView, list[dict[str, Any]], dict[str, int]]],
        post: Callable[[str, bytes, float], dict[str, Any]],
        config: PeerCopyConfig,
    ) -> None:
        self.task = task
        self._snapshot = snapshot
        self._post = post
        self.config = config
        self._cond = threading.Condition()
        self._queue: deque[_Delta] = deque()
        self._queued_bytes = 0
        self._target: tuple[str, str] | None = None  # (holder task, URL)
        self._extra: dict[str, Any] = {}  # fields every frame's header carries (``parity``: the owner's group)
        self._whole = True  # the next send is the whole state
        self._in_whole = False  # a whole copy is being sent (deltas queue behind it, nobody waits for them)
        self._stop = False
        self._synced: tuple[int, str] | None = None  # (step, token) the holder acknowledged last
        self._known: tuple[str, int, str] | None = None  # a holder's URL and the (step, token) it holds: synced_with
        self._tier_step: int | None = None
        self._counts = {"whole": 0, "deltas": 0, "errors": 0, "dropped": 0, "bytes": 0}
        self._last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"psguard-copy-{task}", daemon=True)
        self._thread.start()

    @property
    def target(self) -> str | None:
        with self._cond:
            return self._target[0] if self._target else None

    def set_target(self, target: tuple[str, str] | None, extra: Mapping[str, Any] | None = None) -> None:
        """The holder the chief names (``None``: no copy) and what every frame to it carries (``extra``); a new
        one gets the whole state first."""
        with self._cond:
            if target == self._target and _same_copy(dict(extra or {}), self._extra):
                self._extra = dict(extra or {})  # a member's new address, carried by the next frames
                return
            self._target = target
            self._extra = dict(extra or {})
            self._queue.clear()
            self._queued_bytes = 0
            self._whole = True
            self._synced = None
            known, self._known = self._known, None
            if known is not None and target is not None and target[1] == known[0]:
                self._whole, self._synced = False, known[1:]
            self._cond.notify_all()

    def synced_with(self, url: str, step: int, token: str) -> None:
        """The holder at ``url`` holds this owner's state ``(step, token)``: a new agent just fetched its tier
        from that very copy. If the chief names it as the holder next, the deltas follow at once instead of a
        whole copy of the state (512 MB sent again at 1 GB, on the CPU the resumed training needs); a delta it
        cannot apply (its copy moved) makes the next send whole, as always. A parity holder too: the block it rebuilt
        the state from holds this owner at that very state, so an XOR delta applies to it; a whole send there would
        reset the group and have every member send its whole state again."""
        with self._cond:
            self._known = (url, step, token)

    def offer(self, delta: _Delta | None, step: int) -> None:
        """After the owner's tier applied a capture: queue its delta (``None``: a whole capture, so the next
        send is whole). Never blocks on the network."""
        with self._cond:
            self._tier_step = step
            if self._target is None:
                return
            if delta is None:
                self._queue.clear()
                self._queued_bytes = 0
                self._whole = True
            elif not self._whole:
                if self._queued_bytes + delta.nbytes > self.config.max_queue_mb << 20:
                    self._counts["dropped"] += len(self._queue) + 1
                    self._queue.clear()
                    self._queued_bytes = 0
                    self._whole = True  # the holder lags too far: it gets the whole state next
                else:
                    self._queue.append(delta)
                    self._queued_bytes += delta.nbytes
            self._cond.notify_all()

    def wait_synced(self, token: str, timeout: float) -> bool:
        """Wait until the holder holds state ``token``; False at once when there is no holder, else after
        ``timeout``. A whole copy is waited for too: a small state's takes milliseconds, and without it a node
        lost just after its first capture had no copy to restore from; a large state's outlasts ``timeout``,
        which bounds the wait."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._synced is not None and self._synced[1] == token:
                    return True
                left = deadline - time.monotonic()
                if self._target is None or self._stop or left <= 0:
                    return False
                self._cond.wait(left)

    def status(self) -> dict[str, Any]:
        with self._cond:
            synced = self._synced
            lag = None
            if synced is not None and self._tier_step is not None:
                lag = max(0, self._tier_step - synced[0])
            return {
                "target": self._target[0] if self._target else None,
                "synced_step": synced[0] if synced else None,
                "synced_token": synced[1] if synced else None,
                "lag_steps": lag,
                "queued": len(self._queue),
                "queued_bytes": self._queued_bytes,
                "sending_whole": self._whole and self._target is not None,
                **self._counts,
                "last_error": self._last_error,
            }

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._target is None or (not self._whole and not self._queue)):
                    self._cond.wait()
                if self._stop:
                    return
                target, whole = self._target, self._whole
                delta = None if whole else self._queue.popleft()
                if delta is not None:
                    self._queued_bytes -= delta.nbytes
            assert target is not None
            try:
                if whole:
                    self._send_whole(target)
                else:
                    assert delta is not None
                    self._send_delta(target, delta)
            except Exception as e:  # the holder is down or refused: report, wait, start again whole
                with self._cond:
                    self._counts["errors"] += 1
                    self._last_error = f"{type(e).__name__}: {e}"
                    if self._target == target:
                        self._whole = True
                        self._queue.clear()
                        self._queued_bytes = 0
                log.warning("event=peer_copy_failed owner=%s holder=%s error=%r", self.task, target[0], str(e))
                with self._cond:
                    self._cond.wait(self.config.retry_after)

    def _pace(self, nbytes: int, started: float) -> None:
        rate = self.config.max_mb_per_s
        if rate > 0:
            wait = nbytes / (rate * (1 << 20)) - (time.perf_counter() - started)
            if wait > 0:
                with self._cond:
                    self._cond.wait(wait)

    def _answer(self, target: tuple[str, str], frame: bytes) -> dict[str, Any]:
        t0 = time.perf_counter()
        answer = self._post(target[1], frame, self.config.request_timeout)
        self._pace(len(frame), t0)
        with self._cond:
            self._counts["bytes"] += len(frame)
        status = answer.get("status")
        if status != "ok":
            raise PsguardError(f"{target[0]} answered {status}: {answer.get('message', '')}")
        return answer

    def begin_whole(self) -> None:
        """Called by ``snapshot`` under the owner's lock: the snapshot holds every delta queued so far, and the
        deltas applied after it are queued on top of it (``offer`` runs under the same lock)."""
        with self._cond:
            self._queue.clear()
            self._queued_bytes = 0
            self._whole = False
            self._in_whole = True

    def _send_whole(self, target: tuple[str, str]) -> None:
        try:
            self._send_whole_once(target)
        finally:
            with self._cond:
                self._in_whole = False
                self._cond.notify_all()

    def _send_whole_once(self, target: tuple[str, str]) -> None:
        snap, layout, digests = self._snapshot()
        with snap:
            if snap.empty or snap.token is None:
                with self._cond:
                    self._whole = True
                    self._cond.wait(self.config.retry_after)  # nothing to copy yet
                return
            session = secrets.token_hex(8)
            with self._cond:
                extra = dict(self._extra)
            base = {**extra, "task": self.task, "session": session}
            self._answer(
                target,
                encode_frame(
                    {
                        **base,
                        "op": "begin",
                        "step": snap.step,
                        "token": snap.token,
                        "metadata": snap.metadata,
                        "tensors": layout,
                        "digests": digests_json(digests),
                    }
                ),
            )
            chunk = max(1, self.config.chunk_mb) << 20
            for t in layout:
                stream = snap.tensors[t["name"]]
                n = stream.shape[0] if stream.shape else 1
                rows = max(1, chunk // max(1, stream.nbytes // max(1, n)))
                for start in range(0, n, rows):
                    head = {**base, "op": "fill", "name": t["name"], "start": start}
                    self._answer(target, encode_frame(head, [stream.read(start, min(n, start + rows))]))
            answer = self._answer(target, encode_frame({**base, "op": "end"}))
        with self._cond:
            self._counts["whole"] += 1
            self._synced = (int(answer["step"]), str(answer["token"]))
            self._cond.notify_all()
        log.info("event=peer_copy_whole_sent owner=%s holder=%s step=%s", self.task, target[0], answer["step"])

    def _send_delta(self, target: tuple[str, str], d: _Delta) -> None:
        tensors: list[dict[str, Any]] = []
        arrays: list[np.ndarray] = []
        for name, u in d.updates.items():
            if isinstance(u, Rows):
                tensors.append({"name": name, "kind": "rows"})
                arrays += [np.asarray(u.ids, dtype=np.int64), u.values]
            else:
                tensors.append({"name": name, "kind": "same"})
        with self._cond:
            extra = dict(self._extra)
        frame = encode_frame(
            {
                **extra,
                "task": self.task,
                "op": "delta",
                "step": d.step,
                "token": d.token,
                "parent": d.parent,
                "metadata": d.metadata,
                "tensors": tensors,
                "digests": digests_json(d.digests),
            },
            arrays,
        )
        answer = self._answer(target, frame)
        with self._cond:
            self._counts["deltas"] += 1
            self._synced = (int(answer["step"]), str(answer["token"]))
            self._cond.notify_all()


def new_delta(
    step: int, token: str, parent: str, updates: Mapping[str, TensorUpdate], digests: Mapping[str, int]
) -> _Delta:
    nbytes = 0
    for u in updates.values():
        if isinstance(u, Rows):
            nbytes += u.values.nbytes + u.ids.nbytes
    return _Delta(step, token, parent, dict(updates), dict(digests), {}, nbytes)


def fetch_copy(
    owner: str,
    holder_url: str,
    token: str,
    post: Callable[[str, Mapping[str, Any], float], tuple[dict[str, Any], list[np.ndarray]]],
    config: PeerCopyConfig,
    alloc: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray | None] | None = None,
    read_into: ReadInto | None = None,
    write: Callable[[np.ndarray, int, np.ndarray], None] | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A new agent of ``owner`` takes its shards from the holder's copy, at ``token`` only, verified.

    ``alloc`` makes the arrays the rows are fetched into (the agent's tier files: the bytes land where the tier
    keeps them, with no second copy; None from it, or no ``alloc``: anonymous memory). ``read_into`` (as
    ``post``, each answer's rows handed over as they arrive: :func:`read_frame_into`) saves the buffer of each
    answer: its rows are hashed in pieces while in cache and put in place by ``write(array, row, rows)``
    (:meth:`TierFiles.write_rows`: ``pwrite`` into the tier file, which allocates its pages as it goes and fails
    with ``ENOSPC`` on a full tmpfs, never a ``SIGBUS``; default: assignment into the array). Returns the copy's
    description (step, token, metadata, layout) and the arrays; raises
    :class:`PsguardError` when the holder has no copy at ``token`` (it lags, or holds none, or this node has no
    room for it) and :class:`CorruptCheckpointError` when the bytes do not match the owner's digests.
    """
    info, _ = post(holder_url, {"owner": owner, "token": token}, config.request_timeout)
    if info.get("status") == "refused":  # a parity holder's reconstruction that did not verify
        raise CorruptCheckpointError(f"the holder refused {owner}'s state: {info.get('message', '')}")
    if info.get("status") != "ok":
        raise PsguardError(f"the holder has no copy of {owner}: {info.get('status')} {info.get('message', '')}")
    if info.get("token") != token:
        raise PsguardError(f"the holder's copy of {owner} is at step {info.get('step')}, not at the chief's state")
    digests = digests_from(info.get("digests"))
    chunk = max(1, config.chunk_mb) << 20
    ranges: list[tuple[str, int, int]] = []  # every request, in order: tensor, start, stop
    arrays: dict[str, np.ndarray] = {}
    for t in info.get("tensors") or []:
        name = str(t["name"])
        shape = tuple(int(x) for x in t["array_shape"])
        dtype = dtype_from_name(str(t["dtype"]))
        made = alloc(shape, dtype) if alloc is not None else None
        arrays[name] = made if made is not None else np.empty(shape, dtype=dtype)
        per_row = max(1, arrays[name].nbytes // max(1, shape[0]))
        rows = max(1, chunk // per_row)
        ranges += [(name, start, min(shape[0], start + rows)) for start in range(0, shape[0], rows)]

    def request(r: tuple[str, int, int]) -> dict[str, Any]:
        return {"owner": owner, "token": token, "name": r[0], "start": r[1], "stop": r[2]}

    sums = dict.fromkeys(arrays, 0)
    streams = max(1, config.fetch_streams)

    def put(out: np.ndarray, row: int, rows: np.ndarray) -> None:
        try:
            if write is not None:
                write(out, row, rows)
            else:
                out[row : row + rows.shape[0]] = rows
        except OSError as e:  # no room on the node's tmpfs: the log is used instead
            raise PsguardError(f"no memory for {owner}'s copy on this node: {e}") from None

    def place(i: int) -> int:
        """Fetch one chunk, check it and put it in place; its rows' digest (numpy and zlib release the GIL)."""
        name, start, stop = ranges[i]
        out = arrays[name]
        if read_into is not None:
            total = 0

            def take(row: int, rows: np.ndarray) -> None:
                nonlocal total
                first = start + row
                total = (total + rows_digest(rows, first=first)) & MASK
                put(out, first, rows)

            answer = read_into(holder_url, request(ranges[i]), config.request_timeout, out[start:stop], take)
            if answer.get("status") != "ok" or not answer.get("arrays"):
                raise PsguardError(f"the holder's copy of {owner} moved on while it was fetched: {answer}")
            return total
        answer, got = post(holder_url, request(ranges[i]), config.request_timeout)
        if answer.get("status") != "ok" or len(got) != 1:
            raise PsguardError(f"the holder's copy of {owner} moved on while it was fetched: {answer}")
        if got[0].shape != (stop - start, *out.shape[1:]) or got[0].dtype != out.dtype:
            raise CorruptCheckpointError(f"the copy of {name} from the holder has the wrong shape or dtype")
        put(out, start, got[0])
        return rows_digest(got[0], first=start)

    # ``streams`` requests in flight: each is fetched, checked and placed on its own thread.
    with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="psguard-copy-fetch") as pool:
        futures = [pool.submit(place, i) for i in range(len(ranges))]
        for i, f in enumerate(futures):
            name = ranges[i][0]
            sums[name] = (sums[name] + f.result()) & MASK
    bad = sorted(n for n, d in sums.items() if d != digests.get(n))
    if bad:
        raise CorruptCheckpointError(
            f"the peer copy of {owner} does not match its owner's digests in {bad[:3]}: refused"
        )
    return info, arrays
