"""Parity copies (``peers.copies: parity``): one XOR block per group of K PS tasks instead of a full copy per PS,
held outside the group on another node: 1/K of the memory, and still any one member's node may be lost.

How (docs/design.md, "Parity"): a member's *stripe* is its tensors' bytes in sorted-name order; the parity is the
XOR of the stripes. Owners send as for full copies, the group in every header: a whole XORs in chunk by chunk, a
delta carries ``old XOR new`` per changed row (:func:`xor_rows`), kept to be undone once. A member's whole cannot
replace its unknown old contribution, so it resets the group. A lost member is rebuilt from the parity and the
survivors' stripes (``/peer-copy/stripe``), every piece checked against its owner's digests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psguard.agent.tiers.copy_frames import MASK, copy_header, delta_rows, digests_from, encode_frame, rows_digest
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.codec.dtypes import dtype_from_name
from psguard.errors import CorruptCheckpointError, PsguardError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StripePart:
    """One tensor's place in its owner's stripe."""

    name: str
    offset: int
    nbytes: int
    row_bytes: int
    dtype: np.dtype  # type: ignore[type-arg]
    shape: tuple[int, ...]


def stripe_parts(layout: object) -> dict[str, StripePart]:
    """Each tensor's byte range in the stripe (tensors in sorted-name order), from a copy's layout (a begin frame's
    ``tensors``); :class:`CorruptCheckpointError` for a malformed one."""
    parts: dict[str, StripePart] = {}
    offset = 0
    try:
        if not isinstance(layout, list):
            raise ValueError("no tensors")
        specs = sorted(((str(t["name"]), t) for t in layout), key=lambda x: x[0])
        for name, t in specs:
            shape = tuple(int(x) for x in t["array_shape"])
            dtype = dtype_from_name(str(t["dtype"]))
            if not shape or any(x < 0 for x in shape):
                raise ValueError(f"shape {shape}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            row_bytes = nbytes // shape[0] if shape[0] else 0
            parts[name] = StripePart(name, offset, nbytes, row_bytes, dtype, shape)
            offset += nbytes
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"peer copy: bad layout: {e}") from None
    return parts


def _bytes(a: np.ndarray) -> np.ndarray:
    """The rows of ``a`` as bytes, one row per line (a view when ``a`` is C-contiguous)."""
    c = np.ascontiguousarray(a)
    n = c.shape[0] if c.ndim else 1
    return c.reshape(n, -1).view(np.uint8)


def xor_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``old XOR new`` bit for bit, shaped and typed as ``new`` (what a parity delta carries for each row)."""
    out: np.ndarray = np.bitwise_xor(_bytes(old), _bytes(new))
    return out.view(new.dtype).reshape(new.shape)


def group_header(raw: object) -> dict[str, Any] | None:
    """``parity`` of a ``copy_to`` or a frame: ``{"group": [tasks], "urls": {task: URL}}``, checked; else None."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CorruptCheckpointError("bad 'parity': not an object")
    group, urls = raw.get("group"), raw.get("urls")
    if (
        not isinstance(group, list)
        or not group
        or not all(isinstance(t, str) and t.startswith("ps:") for t in group)
        or len(set(group)) != len(group)
        or not isinstance(urls, dict)
        or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls.values())
    ):
        raise CorruptCheckpointError("bad 'parity': a group of PS tasks and their URLs")
    return {"group": list(group), "urls": {str(k): v for k, v in urls.items()}}


def stripe_frame(token: str, snap_token: str | None, tensors: Mapping[str, np.ndarray]) -> bytes:
    """An owner's answer to ``/peer-copy/stripe``: its tier's arrays in stripe order, at ``token`` only."""
    if snap_token != token:
        return encode_frame({"status": "mismatch", "token": snap_token})
    names = sorted(tensors)
    return encode_frame({"status": "ok", "token": token, "names": names}, [tensors[n] for n in names])


# ---------------------------------------------------------------------------------------------------- holder
@dataclass
class _Member:
    layout: list[dict[str, Any]]
    parts: dict[str, StripePart]
    digests: dict[str, int]
    step: int
    token: str
    metadata: dict[str, Any]
    session: str | None = None  # a whole being received (its frames XOR in as they come)
    sums: dict[str, int] = field(default_factory=dict)
    filled: dict[str, int] = field(default_factory=dict)
    # The last delta's way back: the token and step before it, the digests and metadata then, and its XOR rows.
    undo: tuple[str, int, dict[str, int], dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]] | None = None
    rolled_back_from: str | None = None  # the token an undo left (that owner's own roll-back delta is a no-op)

    @property
    def whole(self) -> bool:
        return self.session is None


@dataclass
class _Group:
    members: tuple[str, ...]
    parity: np.ndarray
    urls: dict[str, str]
    held: dict[str, _Member] = field(default_factory=dict)  # the members whose stripe is in the parity
    resets: int = 0
    # The last member rebuilt (owner, token, info, arrays), served to its new agent until that member sends again.
    restored: tuple[str, str, dict[str, Any], dict[str, np.ndarray]] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def key(self) -> str:
        return ",".join(self.members)

    def token(self) -> str | None:
        """The state the parity describes: every member's, when they all hold the same whole one."""
        tokens = {m.token if m.whole else None for m in self.held.values()}
        return tokens.pop() if len(self.held) == len(self.members) and len(tokens) == 1 else None


class ParityHolder:
    """The parity blocks this agent holds, one per group of owners (their stripes XORed together).
    ``read_stripe(url, body, timeout)``: a member agent's ``/peer-copy/stripe`` answer (header, arrays)."""

    def __init__(
        self,
        task: str,
        read_stripe: Callable[[str, Mapping[str, Any], float], tuple[dict[str, Any], list[np.ndarray]]] | None,
        config: PeerCopyConfig,
    ) -> None:
        self.task = task
        self._read_stripe = read_stripe
        self.config = config
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}  # group key -> group
        self._refused = 0
        self._restores = 0
        self.on_copy: Callable[[str, int], None] | None = None  # (group, bytes) after a whole: the agent's metrics

    def holds(self, owner: str) -> bool:
        with self._lock:
            return any(owner in g.members for g in self._groups.values())

    def status(self) -> dict[str, Any]:
        with self._lock:
            groups = list(self._groups.values())
        out: dict[str, Any] = {}
        for g in groups:
            with g.lock:
                out[g.key] = {
                    "members": {
                        t: ({"step": m.step, "token": m.token} if m.whole else {"receiving": True})
                        if (m := g.held.get(t))
                        else None
                        for t in g.members
                    },
                    "token": g.token(),
                    "bytes": int(g.parity.nbytes),
                    "resets": g.resets,
                }
        return (
            out
            | ({"refused": self._refused} if self._refused else {})
            | ({"restores": self._restores} if self._restores else {})
        )

    def _group(self, owner: str, header: Mapping[str, Any]) -> _Group:
        spec = group_header(header.get("parity"))
        assert spec is not None
        members = tuple(spec["group"])
        if owner not in members or self.task in members:
            raise CorruptCheckpointError(f"parity frame: {owner} sent for group {members} to {self.task}")
        key = ",".join(members)
        with self._lock:
            g = self._groups.get(key)
            if g is None:
                for old in [k for k, x in self._groups.items() if set(x.members) & set(members)]:
                    del self._groups[old]  # the chief regrouped: an overlapping group's parity is void
                g = self._groups[key] = _Group(members, np.zeros(0, np.uint8), {})
            g.urls.update(spec["urls"])
            return g

    def put(self, owner: str, header: dict[str, Any], arrays: list[np.ndarray]) -> dict[str, Any]:
        """One frame of ``owner`` for its group's parity: ``begin``/``fill``/``end`` of a whole, or a ``delta`` (the
        op checked by :meth:`CopyHolder.put`)."""
        g = self._group(owner, header)
        op = header["op"]
        handle: Callable[..., dict[str, Any]] = getattr(self, f"_{op}")
        with g.lock:
            if g.restored is not None and g.restored[0] == owner:
                g.restored = None  # the rebuilt member sends again: its new agent took the rebuilt state
            m = g.held.get(owner)
            if op in ("fill", "end") and (m is None or m.session is None or m.session != header.get("session")):
                return {"status": "need_full", "message": "no whole state in progress for this session"}
            return handle(g, owner, header, arrays)

    def _reset(self, g: _Group, why: str) -> None:
        g.held.clear()
        g.parity = np.zeros(0, np.uint8)
        g.resets += 1
        log.info("event=parity_reset group=%s holder=%s reason=%r", g.key, self.task, why)

    def _begin(self, g: _Group, owner: str, header: dict[str, Any], _: object) -> dict[str, Any]:
        parts = stripe_parts(header.get("tensors"))
        token, step = header.get("token"), header.get("step")
        if not isinstance(token, str) or type(step) is not int:
            raise CorruptCheckpointError("parity begin: bad token or step")
        digests = digests_from(header.get("digests"))
        if owner in g.held:
            # Its old contribution is unknown here: the parity restarts, every member sends its whole again.
            self._reset(g, f"a whole state of {owner}")
        length = sum(p.nbytes for p in parts.values())
        if length > g.parity.nbytes:
            g.parity = np.concatenate([g.parity, np.zeros(length - g.parity.nbytes, np.uint8)])
        metadata = header.get("metadata")
        g.held[owner] = _Member(
            list(header["tensors"]),
            parts,
            digests,
            step,
            token,
            metadata if isinstance(metadata, dict) else {},
            session=str(header.get("session")),
            sums=dict.fromkeys(parts, 0),
            filled=dict.fromkeys(parts, 0),
        )
        return {"status": "ok"}

    def _fill(self, g: _Group, owner: str, header: dict[str, Any], arrays: list[np.ndarray]) -> dict[str, Any]:
        m = g.held[owner]
        part, start = m.parts.get(str(header.get("name"))), header.get("start")
        if part is None or type(start) is not int or len(arrays) != 1:
            raise CorruptCheckpointError("parity fill: bad tensor or start")
        rows = arrays[0]
        n = rows.shape[0] if rows.ndim else 0
        if rows.dtype != part.dtype or rows.shape[1:] != part.shape[1:] or not 0 <= start <= start + n <= part.shape[0]:
            raise CorruptCheckpointError(f"parity fill: rows do not fit {part.name}")
        lo = part.offset + start * part.row_bytes
        g.parity[lo : lo + n * part.row_bytes] ^= _bytes(rows).reshape(-1)
        m.sums[part.name] = (m.sums[part.name] + rows_digest(rows, first=start)) & MASK
        m.filled[part.name] += n
        return {"status": "ok"}

    def _end(self, g: _Group, owner: str, header: dict[str, Any], _: object) -> dict[str, Any]:
        m = g.held[owner]
        short = [n for n, p in m.parts.items() if m.filled[n] != p.shape[0]]
        bad = sorted(n for n in m.parts if m.sums[n] != m.digests.get(n))
        if short or bad:
            # Its bytes are XORed in already: the parity is void, every member sends its whole again.
            self._reset(g, f"a whole state of {owner} that did not verify")
            if bad and not short:
                self._refused += 1
                log.error("event=parity_refused owner=%s holder=%s tensors=%s: digest mismatch", owner, self.task, bad)
            return {"status": "need_full", "message": f"rows missing in {short[:3]}" if short else f"digests {bad[:3]}"}
        m.session, m.sums, m.filled = None, {}, {}
        log.info("event=parity_whole owner=%s holder=%s group=%s step=%s", owner, self.task, g.key, m.step)
        if self.on_copy is not None:
            self.on_copy(g.key, int(g.parity.nbytes))
        return {"status": "ok", "step": m.step, "token": m.token}

    def _delta(self, g: _Group, owner: str, header: dict[str, Any], arrays: list[np.ndarray]) -> dict[str, Any]:
        m = g.held.get(owner)
        parent, token, step = header.get("parent"), header.get("token"), header.get("step")
        if m is not None and m.whole and m.token == token and m.rolled_back_from == parent:
            return {"status": "ok", "step": m.step, "token": m.token, "message": "already applied"}  # our undo
        if m is None or not m.whole or m.token != parent:
            have = None if m is None or not m.whole else m.token
            return {"status": "need_full", "message": f"the parity holds {owner} at {have}, the delta needs {parent}"}
        if not isinstance(token, str) or type(step) is not int:
            raise CorruptCheckpointError("parity delta: bad token or step")
        digests = digests_from(header.get("digests"))
        rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        it = iter(arrays)
        for t in header.get("tensors") or []:
            name, kind = str(t.get("name")), t.get("kind")
            part = m.parts.get(name)
            if part is None:
                raise CorruptCheckpointError(f"parity delta: unknown tensor {name}")
            if kind == "same":
                continue
            ids, values = delta_rows(it, name, kind, part.shape[0], "parity")
            if values.nbytes != ids.size * part.row_bytes:
                raise CorruptCheckpointError(f"parity delta: rows do not fit {name}")
            rows[name] = (ids, _bytes(values).reshape(ids.size, part.row_bytes))
        _xor_in(g, m, rows)
        metadata = header.get("metadata")
        m.undo = (str(parent), m.step, m.digests, m.metadata, rows)
        m.digests = {**m.digests, **digests}
        m.step, m.token, m.rolled_back_from = step, token, None
        m.metadata = metadata if isinstance(metadata, dict) else m.metadata
        return {"status": "ok", "step": m.step, "token": m.token}

    # ------------------------------------------------------------------------------------------ reconstruction
    def read(self, doc: Mapping[str, Any]) -> bytes:
        """What a new agent of a lost member fetches, as from a full copy (:func:`copy_owner.fetch_copy`):
        ``{"owner", "token"}`` reconstructs the owner's state at ``token`` and answers its layout, step and
        digests (``unavailable`` or ``refused`` with a reason when it cannot); with ``"name", "start", "stop"``
        the rows of one tensor of that reconstruction."""
        owner, token = str(doc.get("owner")), doc.get("token")
        with self._lock:
            g = next((x for x in self._groups.values() if owner in x.members), None)
        if g is None or not isinstance(token, str):
            return encode_frame({"status": "empty", "message": f"{self.task} holds no parity of {owner}"})
        with g.lock:
            if "name" not in doc:
                try:
                    g.restored = (owner, token, *self._reconstruct(g, owner, token))
                except CorruptCheckpointError as e:
                    with self._lock:
                        self._refused += 1
                    log.error("event=parity_refused owner=%s holder=%s error=%r", owner, self.task, str(e))
                    return encode_frame({"status": "refused", "message": str(e)})
                except (PsguardError, OSError, RuntimeError) as e:
                    log.warning("event=parity_unavailable owner=%s holder=%s error=%r", owner, self.task, str(e))
                    return encode_frame({"status": "unavailable", "message": str(e)})
                return encode_frame(g.restored[2])
            restored = g.restored
            if restored is None or restored[:2] != (owner, token):
                return encode_frame({"status": "mismatch", "token": None})
            arr = restored[3].get(str(doc.get("name")))
            start, stop = doc.get("start"), doc.get("stop")
            if arr is None or type(start) is not int or type(stop) is not int or not 0 <= start <= stop:
                raise CorruptCheckpointError("parity read: bad tensor or row range")
            return encode_frame({"status": "ok", "token": token}, [arr[start:stop]])

    def _reconstruct(self, g: _Group, owner: str, token: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Owner's arrays at ``token`` from the parity and the survivors' stripes (under ``g.lock``), verified."""
        for t in g.members:
            m = g.held.get(t)
            if m is None or not m.whole:
                raise PsguardError(f"the parity of {g.key} lacks {t}'s whole state")
            if m.token != token and not self._roll_back(g, t, m, token):
                raise PsguardError(f"the parity holds {t} at step {m.step}, not at the chief's state")
        if self._read_stripe is None:
            raise PsguardError(f"the agent of {self.task} cannot fetch stripes")
        buf = g.parity.copy()
        for t in g.members:
            if t == owner:
                continue
            url = g.urls.get(t)
            if url is None:
                raise PsguardError(f"no URL known for {t}")
            m = g.held[t]
            header, arrays = self._read_stripe(url, {"task": t, "token": token}, self.config.request_timeout)
            if header.get("status") != "ok" or header.get("token") != token:
                raise PsguardError(f"{t} cannot give its stripe at the chief's state: {header.get('status')}")
            names = header.get("names")
            if names != sorted(m.parts) or len(arrays) != len(m.parts):
                raise CorruptCheckpointError(f"the stripe of {t} does not match its layout")
            for name, a in zip(names, arrays, strict=True):
                p = m.parts[name]
                if a.dtype != p.dtype or a.shape != p.shape or rows_digest(a) != m.digests.get(name):
                    raise CorruptCheckpointError(f"the stripe of {t} does not match its digests in {name}")
                buf[p.offset : p.offset + p.nbytes] ^= _bytes(a).reshape(-1)
            del arrays
        m = g.held[owner]
        out = {n: buf[p.offset : p.offset + p.nbytes].view(p.dtype).reshape(p.shape) for n, p in m.parts.items()}
        bad = sorted(n for n, a in out.items() if rows_digest(a) != m.digests.get(n))
        if bad:
            raise CorruptCheckpointError(f"the reconstruction of {owner} does not match its digests in {bad[:3]}")
        with self._lock:
            self._restores += 1
        log.info("event=parity_reconstructed owner=%s holder=%s group=%s step=%s", owner, self.task, g.key, m.step)
        return {"status": "ok", **copy_header(m.step, token, m.metadata, m.layout, m.digests)}, out

    def _roll_back(self, g: _Group, task: str, m: _Member, token: str) -> bool:
        """Undo ``task``'s last delta (XOR it in again) when that brings it to ``token``."""
        if m.undo is None or m.undo[0] != token:
            return False
        parent, step, digests, metadata, rows = m.undo
        _xor_in(g, m, rows)
        m.rolled_back_from, m.token, m.step = m.token, parent, step
        m.digests, m.metadata, m.undo = digests, metadata, None
        log.info("event=parity_rolled_back owner=%s holder=%s to_step=%d", task, self.task, step)
        return True


def _xor_in(g: _Group, m: _Member, rows: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """XOR rows (``name -> (ids, bytes per row)``) into the parity at the member's offsets."""
    for name, (ids, xb) in rows.items():
        p = m.parts[name]
        region = g.parity[p.offset : p.offset + p.nbytes].reshape(p.shape[0], p.row_bytes)
        region[ids] ^= xb
