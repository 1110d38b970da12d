"""The owner's side of a PS agent's peer copy, and the row fingerprints that go with it (a base class of
:class:`~psguard.agent.tiers.shards.ShardKeeper`, kept apart to keep the keeper readable).

After the keeper's tier applied a capture, :class:`CopyOwner` updates the copy's digests from the changed rows and
hands the delta to the :class:`~psguard.agent.tiers.copy_owner.CopySender`; it also undoes the tier's last capture
when the chief's state is one capture older, and the copy follows. A full copy also holds the rows' fingerprints
(``<tier name>#fp``, kept by the same deltas and digests), so a PS restored from it need not hash every row.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from psguard.agent.tiers.copy_frames import delta_digest, rows_digest
from psguard.agent.tiers.copy_owner import CopySender, Delta
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.agent.tiers.memory_tier import MemoryTier, StreamSnapshot
from psguard.agent.tiers.parity import xor_rows
from psguard.agent.tiers.tier_files import TierFiles
from psguard.codec.dtypes import dtype_name
from psguard.errors import PsguardError
from psguard.handoff.parts import ShardKey
from psguard.tensors import Full, Rows, Same, TensorUpdate

log = logging.getLogger(__name__)

#: A copy's tensor holding the fingerprints of tier tensor ``name`` is ``name + FP_SUFFIX``.
FP_SUFFIX = "#fp"

#: The rows an undo writes back: tier name -> (row ids, their values before the delta).
UndoRows = dict[str, tuple[np.ndarray, np.ndarray]]


def fp_name(name: str) -> str:
    return name + FP_SUFFIX


class CopyOwner:
    """The peer copy's owner side and the fingerprints' bookkeeping of a :class:`ShardKeeper` (its base class)."""

    task: str
    files: TierFiles
    tier: MemoryTier
    fp_tier: MemoryTier
    copy_config: PeerCopyConfig
    sender: CopySender | None
    _lock: threading.Lock
    _parity: bool
    _keys: dict[str, tuple[ShardKey, tuple[int, ...]]]
    _digests: dict[str, int] | None  # per copied tensor (fp_name ones too), while a copy is sent
    # The last delta's way back: the state it applied to, its step, the rows and fingerprints (None) it overwrote.
    _undo: tuple[str, int, UndoRows, UndoRows | None] | None
    _rollbacks: int

    # ------------------------------------------------------------------------------------------ fingerprints
    def _keep_fps(self, fps: Mapping[str, TensorUpdate] | None, *, step: int, token: str, parent: str | None) -> None:
        """Apply a capture's fingerprints beside its rows (under ``_lock``), or drop them all when they cannot
        follow the tier: fingerprints of another state would be restored as the rows'."""
        if fps is not None and set(fps) == set(self.tier.names()):
            whole = all(isinstance(u, Full) for u in fps.values())
            try:
                if self.fp_tier.apply(fps, step=step, token=token, parent=None if whole else parent).ok:
                    return
            except PsguardError as e:
                log.warning("event=fingerprints_dropped task=%s error=%r", self.task, str(e))
        self._drop_fps()

    def _drop_fps(self) -> None:
        self.fp_tier = MemoryTier(home=self.files)  # an export holding the old one keeps its lease on it

    def _seed_fps(self, step: int, token: str, fps: Mapping[str, np.ndarray]) -> bool:
        """Take the fingerprints a peer's copy held as this tier's (under ``_lock``, the tier just seeded at
        ``token``); False (and none kept) when there are none or they do not fit the tier."""
        rows = {n: key.rows for n, (key, _) in self._keys.items()}
        if (
            not fps
            or set(fps) != set(rows)
            or any(a.dtype != np.int64 or a.shape != (rows[n],) for n, a in fps.items())
        ):
            self._drop_fps()
            return False
        self.fp_tier = MemoryTier(home=self.files)
        self.fp_tier.seed(step, fps, token=token, durable=False)
        return True

    def _fps_follow(self, token: str | None) -> bool:
        """Whether the copy carries the fingerprints at state ``token`` (a full copy, the keeper holding them)."""
        return (
            self.copy_config.fingerprints
            and not self._parity
            and token is not None
            and self.fp_tier.token == token
            and set(self.fp_tier.names()) == set(self.tier.names())
        )

    def _copy_has_fps(self) -> bool:
        return self._digests is not None and any(n.endswith(FP_SUFFIX) for n in self._digests)

    # ------------------------------------------------------------------------------------------ peer copy
    def _old_rows(
        self, updates: Mapping[str, TensorUpdate], fps: Mapping[str, TensorUpdate] | None
    ) -> dict[str, np.ndarray] | None:
        """The rows a delta is about to overwrite (under ``_lock``), and their fingerprints when the copy holds
        them (``fp_name`` keys), for the digests and the undo; ``None`` when unknown."""
        if self._digests is None:
            return None
        with_fps = self._copy_has_fps() and fps is not None
        out: dict[str, np.ndarray] = {}
        for name, u in updates.items():
            if isinstance(u, Rows):
                old = self.tier.gather(name, u.ids)
                if old is None:
                    return None
                out[name] = old
                old_fp = self.fp_tier.gather(name, u.ids) if with_fps else None
                if old_fp is not None:
                    out[fp_name(name)] = old_fp
        return out

    def _offer_copy(
        self,
        updates: Mapping[str, TensorUpdate],
        step: int,
        token: str,
        parent: str | None,
        old_rows: Mapping[str, np.ndarray] | None,
        fps: Mapping[str, TensorUpdate] | None,
    ) -> None:
        """Update the digests after an apply (under ``_lock``, the fingerprints kept already) and hand the change
        to the sender: a delta of the rows and their fingerprints, or the whole state when the delta cannot be
        followed (a first capture, a whole tensor, the fingerprints started or stopped following the tier)."""
        assert self.sender is not None
        with_fps = self._fps_follow(token)
        if parent is None or old_rows is None or self._digests is None or with_fps != self._copy_has_fps():
            self._rehash()
            self.sender.offer(None, step)
            return
        digests = dict(self._digests)
        sent: dict[str, TensorUpdate] = dict(updates)
        for name, u in updates.items():
            f = (fps or {}).get(name) if with_fps else None
            if isinstance(u, Rows):
                digests[name] = delta_digest(digests[name], u.ids, old_rows[name], u.values)
                if with_fps:
                    old_fp = old_rows.get(fp_name(name))
                    if not isinstance(f, Rows) or old_fp is None or not np.array_equal(f.ids, u.ids):
                        break
                    digests[fp_name(name)] = delta_digest(digests[fp_name(name)], f.ids, old_fp, f.values)
                    sent[fp_name(name)] = f
            elif isinstance(u, Same):
                if with_fps:
                    sent[fp_name(name)] = Same((u.shape[0],), np.dtype(np.int64))
            else:
                break  # a whole tensor: the whole state follows
        else:
            self._digests = digests
            self.sender.offer(Delta(step, token, parent, self._copy_updates(sent, old_rows), digests), step)
            return
        self._rehash()
        self.sender.offer(None, step)

    def _copy_updates(
        self, updates: Mapping[str, TensorUpdate], before: Mapping[str, np.ndarray]
    ) -> Mapping[str, TensorUpdate]:
        """What a delta sends: the new rows, or for a parity block ``before XOR new`` of each changed row."""
        if not self._parity:
            return updates
        return {
            n: Rows(u.ids, xor_rows(before[n], u.values), u.shape) if isinstance(u, Rows) else u
            for n, u in updates.items()
        }

    def _rehash(self) -> None:
        """Every copied tensor's digest (the fingerprints' too when they follow the tier), hashed whole."""
        with self.tier.export() as snap:
            digests = {n: rows_digest(a) for n, a in snap.tensors.items()}
        if self._fps_follow(self.tier.token):
            with self.fp_tier.export() as fps:
                digests.update({fp_name(n): rows_digest(a) for n, a in fps.tensors.items()})
        self._digests = digests

    def _copy_snapshot(self) -> tuple[StreamSnapshot, list[dict[str, Any]], dict[str, int]]:
        """For the sender's whole copy: the tier and its fingerprints (read in row ranges), their layout and
        digests, at one state."""
        with self._lock:
            assert self.sender is not None
            with_fps = self._fps_follow(self.tier.token)
            names = set(self.tier.names())
            if with_fps:
                names |= {fp_name(n) for n in names}
            if self._digests is None or set(self._digests) != names:
                self._rehash()
            assert self._digests is not None
            snap = self.tier.stream_export()
            self.sender.begin_whole()
            layout = []
            for name, value in snap.tensors.items():
                key, shape = self._keys[name]
                entry = {"name": name, "key": [key.name, key.offset, key.rows], "shape": list(shape)}
                layout.append({**entry, "dtype": dtype_name(value.dtype), "array_shape": list(value.shape)})
                if with_fps:
                    fp = {"name": fp_name(name), "fp_of": name, "dtype": "int64", "array_shape": [value.shape[0]]}
                    layout.append({**entry, **fp})
            if with_fps:  # the fingerprints go as tensors of their own, released with the rows
                fps = self.fp_tier.stream_export()
                snap.tensors = {**snap.tensors, **{fp_name(n): s for n, s in fps.tensors.items()}}
                snap.also.append(fps)
            return snap, layout, dict(self._digests)

    def _keep_undo(
        self,
        parent: str | None,
        prev_step: int | None,
        updates: Mapping[str, TensorUpdate],
        old_rows: Mapping[str, np.ndarray] | None,
    ) -> None:
        """Keep the rows (and fingerprints) the capture just applied overwrote, to undo it (under ``_lock``)."""
        self._undo = None
        if parent is None or old_rows is None or prev_step is None:
            return
        rows = {n: (u.ids, old_rows[n]) for n, u in updates.items() if isinstance(u, Rows)}
        fp_rows = {n: (ids, old_rows[fp_name(n)]) for n, (ids, _) in rows.items() if fp_name(n) in old_rows}
        self._undo = (parent, prev_step, rows, fp_rows if len(fp_rows) == len(rows) else None)

    def _roll_back_to(self, token: str) -> None:
        """Bring the tier back one capture when that is the chief's state ``token`` (its last capture reached
        this PS and not every PS); the copy and the kept fingerprints follow."""
        with self._lock:
            undo = self._undo
            if undo is None or undo[0] != token or self.tier.token == token or self.tier.token is None:
                return
            _, step, rows, fp_rows = undo
            current = self.tier.token
            now: dict[str, np.ndarray] = {}
            for name, (ids, _old) in rows.items():
                got = self.tier.gather(name, ids)
                if got is None:
                    return
                now[name] = got
            fps_now = {n: self.fp_tier.gather(n, ids) for n, (ids, _) in (fp_rows or {}).items()}
            result, updates = self.tier.revert(rows, step=step, token=token)
            if not result.ok:
                return
            fp_updates: dict[str, TensorUpdate] | None = None
            if fp_rows is not None and self.fp_tier.token == current and all(v is not None for v in fps_now.values()):
                fp_result, fp_updates = self.fp_tier.revert(fp_rows, step=step, token=token)
                if not fp_result.ok:
                    fp_updates = None
            if fp_updates is None:
                self._drop_fps()  # not kept for the state rolled back to
            self._undo = None
            self._rollbacks += 1
            if self._digests is not None and self.sender is not None:  # the undo goes to the copy as a delta
                before = now | {fp_name(n): v for n, v in fps_now.items() if v is not None}
                self._offer_copy(updates, step, token, current, before, fp_updates)
        log.info(
            "event=tier_rolled_back task=%s to_step=%d: the chief's state (its last capture did not reach every PS)",
            self.task,
            step,
        )
