"""Peer copies, the holder's side: a PS agent holds a copy of another node's shards, so that a new agent of a lost
node fetches them from memory at the newest capture instead of reading the older durable log at the store's rate.

How (docs/design.md, "Peer copies"): the chief's agent names each part's holder in every ``/shards/apply``; the
owner pushes its changes (:mod:`.copy_owner`); the holder (:class:`CopyHolder`) keeps one :class:`MemoryTier` per
owner under the owner's tokens (a delta over another state: ``need_full``). Every frame carries the owner's
digests (:func:`rows_digest`), checked before a delta applies and before a fetched copy is used. Frames with
``parity`` go to :class:`~psguard.agent.tiers.parity.ParityHolder`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from psguard.agent.tiers.copy_frames import (
    Frame,
    copy_header,
    decode_frame,
    delta_digest,
    delta_rows,
    digests_from,
    encode_frame,
    frame_parts,
    rows_digest,
)
from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.parity import stripe_parts
from psguard.errors import CorruptCheckpointError
from psguard.tensors import Rows, Same, TensorUpdate

if TYPE_CHECKING:
    from psguard.agent.tiers.parity import ParityHolder

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- holder
@dataclass
class _Copy:
    tier: MemoryTier
    layout: list[dict[str, Any]]  # per tensor: name (tier name), key [name, offset, rows], shape (logical), dtype
    digests: dict[str, int]
    # The last delta's way back: the state it applied to, its step, the rows it overwrote and the digests
    # before it (an owner's capture that did not reach every PS: see ShardKeeper._roll_back_to).
    undo: tuple[str, int, dict[str, tuple[np.ndarray, np.ndarray]], dict[str, int]] | None = None


@dataclass
class _Incoming:
    header: dict[str, Any]
    arrays: dict[str, np.ndarray]
    filled: dict[str, int]


class CopyHolder:
    """The copies this agent holds of other PS agents' shards (one tier per owner task)."""

    def __init__(self, task: str) -> None:
        self.task = task
        self.on_copy: Callable[[str, int], None] | None = None  # (owner, bytes) after a whole: the metrics
        self._lock = threading.Lock()
        self._copies: dict[str, _Copy] = {}
        self._incoming: dict[str, _Incoming] = {}  # owner -> a whole copy being received
        self._refused = 0
        self.parity: ParityHolder | None = None  # the parity blocks held here, if any

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                owner: {"step": c.tier.step, "token": c.tier.token, "bytes": c.tier.status().nbytes}
                for owner, c in self._copies.items()
            } | ({"refused_frames": self._refused} if self._refused else {})

    def put(self, body: bytes) -> dict[str, Any]:
        """One frame from an owner: ``begin``/``fill``/``end`` of a whole copy, or a ``delta``."""
        header, arrays = decode_frame(body)
        owner = header.get("task")
        if not isinstance(owner, str) or not owner.startswith("ps:") or owner == self.task:
            raise CorruptCheckpointError(f"peer copy frame: bad owner {owner!r}")
        op = header.get("op")
        if op not in ("begin", "fill", "end", "delta"):
            raise CorruptCheckpointError(f"peer copy frame: unknown op {op!r}")
        if header.get("parity") is not None:
            if self.parity is None:
                raise CorruptCheckpointError("peer copy frame: parity is not held here")
            with self._lock:  # the owner's copies moved to parity: its full copy is behind already
                self._copies.pop(owner, None)
                self._incoming.pop(owner, None)
            return self.parity.put(owner, header, arrays)
        handle: Callable[..., dict[str, Any]] = getattr(self, f"_{op}")
        return handle(owner, header, arrays)

    def _begin(self, owner: str, header: dict[str, Any], _: object) -> dict[str, Any]:
        parts = stripe_parts(header.get("tensors"))
        # The copy this replaces is behind the owner already: drop it now and fill its arrays in place where they
        # fit, so that the holder never holds two copies of one owner.
        with self._lock:
            old = self._copies.pop(owner, None)
            self._incoming.pop(owner, None)
        reuse = {} if old is None else {n: a for n in old.tier.names() if (a := old.tier.take_array(n)) is not None}
        del old
        arrays: dict[str, np.ndarray] = {}
        for name, p in parts.items():
            have = reuse.pop(name, None)
            ok = have is not None and have.shape == p.shape and have.dtype == p.dtype and have.flags.writeable
            arrays[name] = have if ok and have is not None else np.empty(p.shape, dtype=p.dtype)
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

    def _end(self, owner: str, header: dict[str, Any], _: object) -> dict[str, Any]:
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
            return self._refuse(owner, bad)
        tier = MemoryTier()
        h = inc.header
        tier.seed(int(h["step"]), inc.arrays, metadata=h.get("metadata") or {}, token=str(h["token"]), durable=False)
        nbytes = sum(a.nbytes for a in inc.arrays.values())
        with self._lock:
            self._copies[owner] = _Copy(tier, list(h["tensors"]), digests)
        log.info("event=peer_copy_whole owner=%s holder=%s step=%s bytes=%d", owner, self.task, h["step"], nbytes)
        if self.on_copy is not None:
            self.on_copy(owner, nbytes)
        return {"status": "ok", "step": tier.step, "token": tier.token}

    def _delta(self, owner: str, header: dict[str, Any], arrays: list[np.ndarray]) -> dict[str, Any]:
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
            return self._refuse(owner, bad)
        before_step = copy.tier.step
        result = copy.tier.apply(updates, step=step, token=token, parent=parent, metadata=header.get("metadata"))
        if result.ok:
            if before_step is not None and result.message != "already applied":
                copy.undo = (str(parent), before_step, undo_rows, copy.digests)
            copy.digests = new_digests
        return {"status": result.status, "step": copy.tier.step, "token": copy.tier.token, "message": result.message}

    def _refuse(self, owner: str, bad: list[str]) -> dict[str, Any]:
        with self._lock:
            self._refused += 1
        log.error("event=peer_copy_refused owner=%s holder=%s tensors=%s: digest mismatch", owner, self.task, bad)
        return {"status": "need_full", "message": f"digest mismatch in {bad[:3]}"}

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
                    {"status": "ok", **copy_header(snap.step, snap.token, snap.metadata, copy.layout, copy.digests)}
                )
            if doc.get("token") != snap.token:
                return encode_frame({"status": "mismatch", "step": snap.step, "token": snap.token})
            arr = snap.tensors.get(str(doc.get("name")))
            start, stop = doc.get("start"), doc.get("stop")
            if arr is None or type(start) is not int or type(stop) is not int or not 0 <= start <= stop:
                raise CorruptCheckpointError("peer copy read: bad tensor or row range")
            # No CRC: fetch_copy checks every row against the owner's digests before any is used.
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
