"""A PS's shards kept by that PS's agent (issue 12): a PS job's embedding tables are far more than the chief holds.

Each PS agent keeps the memory tier of its own PS's shards (:class:`ShardKeeper`), fed by files the capture
function writes on its node and read back as files its PS loads there (:mod:`psguard.handoff.parts`); only
descriptors, tokens and steps cross the network. The chief's agent coordinates (:mod:`.shard_client`). Every
part carries its capture's token and a delta applies only over the token it names, as in the chief's tier; a
restore is served only when every PS's tier holds the chief's token.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from psguard.agent.tiers.copy_frames import digests_from
from psguard.agent.tiers.copy_owner import CopySender, ReadInto, fetch_copy
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.agent.tiers.memory_tier import DirtyTake, MemoryTier, Snapshot, limit_malloc_retention
from psguard.agent.tiers.parity import ParityHolder, group_header, stripe_frame
from psguard.agent.tiers.peer_copy import CopyHolder
from psguard.agent.tiers.shard_copy import CopyOwner, UndoRows
from psguard.agent.tiers.tier_files import TierFiles
from psguard.codec.dtypes import dtype_from_name, dtype_name
from psguard.errors import CorruptCheckpointError, PsguardError
from psguard.handoff.contract import TOKEN_KEY
from psguard.handoff.credentials import ensure_private_dir
from psguard.handoff.parts import PartCapture, ShardFiles, ShardKey
from psguard.handoff.spool import try_flock
from psguard.handoff.tensor_bundle import bundle_files, read_bundle, write_bundle
from psguard.handoff.tensor_file import read_tensor_file
from psguard.store.opening import StoreOpening
from psguard.tensors import Full, Rows, Same, TensorUpdate

log = logging.getLogger(__name__)


class ShardError(PsguardError):
    """A PS agent could not do what the chief's agent asked (its answer says why)."""


class StateNotHeldError(ShardError):
    """A PS agent answered that it holds no shards of the asked state (its tier is empty or at another state,
    and no peer copy gave it): that state is gone, unlike a PS agent that did not answer."""


def _tier_name(key: ShardKey) -> str:
    return f"{key.name}@{key.offset}:{key.rows}"


def _token(doc: Mapping[str, Any], key: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= 128:
        raise CorruptCheckpointError(f"bad {key!r} in a shard request")
    return value


def _maybe_token(doc: Mapping[str, Any], key: str) -> str | None:
    return None if doc.get(key) is None else _token(doc, key)


def _copy_target(raw: object) -> tuple[str, str] | None:
    """``copy_to`` of an apply: ``{"task": "ps:1", "url": ...}``, the holder of this PS's copy, or none."""
    if raw is None:
        return None
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("task"), str)
        or not isinstance(raw.get("url"), str)
        or not raw["url"].startswith(("http://", "https://"))
    ):
        raise CorruptCheckpointError("bad 'copy_to' in a shard request")
    return raw["task"], raw["url"]


def shard_keys(raw: object, what: str) -> list[ShardKey]:
    """The shards a request names, ``[[name, offset, rows], ...]``; :class:`CorruptCheckpointError` in ``what``."""
    if not isinstance(raw, list) or not all(
        isinstance(k, list) and len(k) == 3 and isinstance(k[0], str) and all(type(n) is int and n >= 0 for n in k[1:])
        for k in raw
    ):
        raise CorruptCheckpointError(f"bad 'shards' in {what}")
    return [ShardKey(*k) for k in raw]


def _step(doc: Mapping[str, Any]) -> int:
    step = doc.get("step")
    if type(step) is not int or not 0 <= step < 1 << 62:
        raise CorruptCheckpointError("bad 'step' in a shard request")
    return step


class ShardKeeper(CopyOwner):
    """A PS agent's memory tier of its PS's shards, fed and read through its part folder. Every public method
    takes and returns plain JSON (the HTTP handlers pass bodies straight through)."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        task: str,
        *,
        store: Any = None,
        copy_config: PeerCopyConfig | None = None,
        send_frame: Callable[[str, bytes, float], dict[str, Any]] | None = None,
        read_copy: Callable[[str, Mapping[str, Any], float], tuple[dict[str, Any], list[np.ndarray]]] | None = None,
        read_copy_into: ReadInto | None = None,
        read_stripe: Callable[[str, Mapping[str, Any], float], tuple[dict[str, Any], list[np.ndarray]]] | None = None,
        tier_files: bool | None = None,
    ) -> None:
        """``send_frame``, ``read_copy`` (``read_copy_into``) and ``read_stripe``: POSTs to a peer agent's
        ``/peer-copy/put``, ``/read`` and ``/stripe`` (without them this agent neither sends nor fetches copies,
        but still holds others'). ``tier_files``: None, when the folder is in memory; or forced on or off."""
        self.folder = Path(folder)
        self.task = task
        self.store = store
        self.files = TierFiles(self.folder / "tier", enabled=tier_files)
        self.tier = MemoryTier(home=self.files)
        # The rows' fingerprints from the captures, at the tier's token or dropped (a restore loads them).
        self.fp_tier = MemoryTier(home=self.files)
        self.copy_config = copy_config or PeerCopyConfig()
        self.holder = CopyHolder(task)  # the copies of other PS's shards this agent holds
        self.parity = ParityHolder(task, read_stripe, self.copy_config)  # and the parity blocks (copies: parity)
        self.holder.parity = self.parity
        self._parity = False  # this PS's copy is a part of a parity block (its deltas are XOR deltas)
        self.sender = (
            CopySender(task, self._copy_snapshot, send_frame, self.copy_config) if send_frame is not None else None
        )
        self._read_copy = read_copy
        self._read_copy_into = read_copy_into  # the same reads, each answer's rows straight into the tier
        self._digests: dict[str, int] | None = None  # the copy's digests (CopyOwner)
        self._pull_lock = threading.Lock()
        self._undo: tuple[str, int, UndoRows, UndoRows | None] | None = None
        self._rollbacks = 0
        self._keys: dict[str, tuple[ShardKey, tuple[int, ...]]] = {}  # tier name -> shard, logical shape
        self._lock = threading.Lock()
        self._take: tuple[str, DirtyTake] | None = None  # the open durable take: its checkpoint id
        self._exports = 0
        self._exports_reused = 0
        # Exports one at a time; the last one's files and state, reused by a restore of that state (export ahead).
        self._export_lock = threading.Lock()
        self._exported: tuple[str, dict[str, Any]] | None = None
        # The last export's lease: the tier writes no array of it in place while its restore files exist.
        self._export_lease: list[Snapshot] = []  # [the shards', their fingerprints']
        self._export_bytes = 0  # bytes the exports wrote (the data of arrays without a tier file)
        self._lock_fd: int | None = None

    def start(self) -> ShardKeeper:
        """Own the part folder (owner-only, one agent at a time: else :class:`ShardError`) and clear what a
        previous agent left in it."""
        limit_malloc_retention()  # this process moves shards through MB-sized buffers from now on
        ensure_private_dir(self.folder, "the PS agent's part folder")
        fd = try_flock(self.folder / "agent.lock", fcntl.LOCK_EX)
        if fd is None:
            raise ShardError(f"another agent keeps shards in {self.folder} (give this one --spool DIR)")
        self._lock_fd = fd
        for sub in ("incoming", "restore"):
            shutil.rmtree(self.folder / sub, ignore_errors=True)
            ensure_private_dir(self.folder / sub, "the PS agent's part folder")
        self.files.open()
        return self

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self._lock_fd is None:
            return
        self._drop_restore_files()
        for sub in ("incoming", "restore"):
            shutil.rmtree(self.folder / sub, ignore_errors=True)
        self.files.close()
        os.close(self._lock_fd)
        self._lock_fd = None

    def status(self) -> dict[str, Any]:
        s = self.tier.status()
        return {
            "folder": str(self.folder),
            "store": self.store is not None,
            # held until a fetch from a peer's copy is done (store/opening.py), then opening, open, or failed
            "store_state": self.store.state if isinstance(self.store, StoreOpening) else None,
            "step": s.step,
            "token": s.token,
            "shards": s.tensors,
            "bytes": s.nbytes,
            "dirty_rows": s.dirty_rows,
            "exports": self._exports,
            "exports_reused": self._exports_reused,
            "export_bytes_written": self._export_bytes,
            "tier_files": self.files.status(),
            "fingerprints_kept": self.fp_tier.token is not None and self.fp_tier.token == s.token,
            # beside the tier (the zero-copy restore loads them): memory the agent holds for its own shards too
            "fingerprint_bytes": self.fp_tier.status().nbytes,
            "copy_out": self.sender.status() if self.sender is not None else None,
            "copies_held": self.holder.status(),
            "parity_held": self.parity.status(),
            "rollbacks": self._rollbacks,
        }

    # ------------------------------------------------------------------------------------------ memory tier
    def apply(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Apply one capture's part (``{"part", "step", "token", "parent"}``); the part's files are deleted."""
        part = PartCapture.from_json(doc.get("part"), f"{self.task}: capture part")
        folder = self.folder / "incoming" / part.nonce
        try:
            if part.task != self.task:
                raise CorruptCheckpointError(f"a part for {part.task} sent to the agent of {self.task}")
            step, token, parent = _step(doc), _token(doc, "token"), _maybe_token(doc, "parent")
            if folder.is_symlink() or not folder.is_dir():
                raise CorruptCheckpointError(f"{self.task}: the capture's files are not in {folder}")
            updates: dict[str, TensorUpdate] = {}
            keys: dict[str, tuple[ShardKey, tuple[int, ...]]] = {}
            fps: dict[str, TensorUpdate] | None = {}
            for s in part.shards:
                name = _tier_name(s.key)
                u = updates[name] = self._read_shard(folder, s)
                keys[name] = (s.key, s.shape)
                fp = self._read_fps(folder, s, u)
                fps = None if fp is None or fps is None else {**fps, name: fp}
            self._drop_restore_files()  # a capture comes after the restore it followed was loaded
            return self.apply_updates(
                updates,
                keys,
                step=step,
                token=token,
                parent=parent,
                copy_to=_copy_target(doc.get("copy_to")),
                parity=group_header((doc.get("copy_to") or {}).get("parity")),
                fps=fps,
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def apply_updates(
        self,
        updates: Mapping[str, TensorUpdate],
        keys: Mapping[str, tuple[ShardKey, tuple[int, ...]]],
        *,
        step: int,
        token: str,
        parent: str | None,
        copy_to: tuple[str, str] | None = None,
        parity: Mapping[str, Any] | None = None,
        fps: Mapping[str, TensorUpdate] | None = None,
    ) -> dict[str, Any]:
        """The tier's half of :meth:`apply`, once the part's files are read; then the change goes to the peer
        copy (``copy_to``: the holder's task and URL, as the chief names it; ``parity``: the group whose parity
        block that holder keeps, ``{"group", "urls"}``, for ``copies: parity``). ``fps``: the same update of
        the rows' fingerprints (:meth:`_keep_fps`), None when the capture sent none."""
        with self._lock:
            copying = self.sender is not None and copy_to is not None
            old_rows = self._old_rows(updates, fps) if copying and parent is not None else None
            prev_step = self.tier.step
            result = self.tier.apply(updates, step=step, token=token, parent=parent)
            changed = result.ok and result.message != "already applied"
            if result.ok and parent is None:
                self._keys = dict(keys)
            if changed:
                self._keep_fps(fps, step=step, token=token, parent=parent)  # first: the copy takes them along
            if self.sender is not None:
                self._parity = copying and parity is not None
                self.sender.set_target(copy_to, {"parity": dict(parity)} if self._parity and parity else None)
                if not copying:
                    self._digests = None
                elif changed:
                    self._offer_copy(updates, step, token, parent, old_rows, fps)
            if changed:
                self._keep_undo(parent, prev_step, updates, old_rows)
        if copying and result.ok and self.copy_config.wait_for_copy > 0:
            assert self.sender is not None
            self.sender.wait_synced(token, self.copy_config.wait_for_copy)
        s = self.sender.status() if self.sender is not None else {}  # the copy's holder and state, for the chief
        copy = (
            {"holder": s["target"], "step": s["synced_step"], "token": s["synced_token"]} if s.get("target") else None
        )
        return {
            "status": result.status,
            "step": self.tier.step,
            "token": self.tier.token,
            "message": result.message,
            "copy": copy,
        }

    def pull(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """A new agent of a lost node takes its shards from a peer's copy (``{"token", "holder"}``: the chief's
        state, the holder's URL). ``unavailable`` (no copy at that state) or ``refused`` (the digests do not
        match) leave the tier untouched."""
        token = _token(doc, "token")
        holder = doc.get("holder")
        if not isinstance(holder, str) or not holder.startswith(("http://", "https://")):
            raise CorruptCheckpointError("bad 'holder' in a pull request")
        if self._read_copy is None:
            raise ShardError(f"the agent of {self.task} cannot fetch peer copies")
        opening = self.store if isinstance(self.store, StoreOpening) else None
        if opening is not None:
            opening.keep_held()  # its imports would slow the fetch, and the restore after it
        answer: dict[str, Any] = {}
        try:
            with self._pull_lock:  # one fetch at a time: the export ahead of a restore and the restore's own
                answer = self._pull(token, holder)
                return answer
        finally:
            if opening is not None:  # after a fetch that did not work the log is read next
                opening.release(later=answer.get("status") == "ok")

    def _pull(self, token: str, holder: str) -> dict[str, Any]:
        assert self._read_copy is not None
        if self.tier.token == token:
            return {"status": "ok", "step": self.tier.step, "token": token, "bytes": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        try:
            info, arrays = fetch_copy(
                self.task,
                holder,
                token,
                self._read_copy,
                self.copy_config,
                lambda shape, dtype: self.files.new(shape, dtype, reserve=False),
                self._read_copy_into,
                self.files.write_rows,
            )
            arrays = {n: self.files.adopt(a) for n, a in arrays.items()}  # any not fetched into a tier file moves
        except CorruptCheckpointError as e:
            log.error("event=peer_copy_refused task=%s holder=%s error=%r", self.task, holder, str(e))
            return {"status": "refused", "message": str(e)}
        except (PsguardError, OSError) as e:
            return {"status": "unavailable", "message": str(e)}
        layout: dict[str, tuple[ShardKey, tuple[int, ...]]] = {}
        fps: dict[str, np.ndarray] = {}
        for t in info.get("tensors") or []:
            if "fp_of" in t:
                fps[str(t["fp_of"])] = arrays.pop(str(t["name"]))
                continue
            k = t["key"]
            layout[str(t["name"])] = (ShardKey(str(k[0]), int(k[1]), int(k[2])), tuple(int(x) for x in t["shape"]))
        with self._lock:
            self._void_take()
            metadata = info.get("metadata")
            self.tier.seed(
                int(info["step"]),
                arrays,
                token=token,
                durable=False,  # which rows the log holds is unknown here: the next durable save writes them all
                metadata=metadata if isinstance(metadata, dict) else {},
            )
            self._keys = layout
            fps_kept = self._seed_fps(int(info["step"]), token, fps)
            # The digests the copy was verified against: the next delta updates them and goes to the same holder
            # without a whole copy first; unless they name fingerprints this tier does not follow.
            ok = "digests" in info and (fps_kept or not fps)
            self._digests = digests_from(info.get("digests")) if ok else None
            if self.sender is not None and self._digests is not None:
                self.sender.synced_with(holder, int(info["step"]), token)
        nbytes = sum(a.nbytes for a in arrays.values())
        seconds = time.perf_counter() - t0
        log.info(
            "event=peer_copy_restored task=%s holder=%s step=%s fingerprints=%s bytes=%d seconds=%.3f",
            self.task,
            holder,
            info["step"],
            "kept" if fps_kept else "none",
            nbytes,
            seconds,
        )
        return {"status": "ok", "step": info["step"], "token": token, "bytes": nbytes, "seconds": seconds}

    def _read_fps(self, folder: Path, s: ShardFiles, update: TensorUpdate) -> TensorUpdate | None:
        """The fingerprints of the rows in ``update`` (one int64 each), or None when the capture sent none."""
        if not s.fps:
            return None
        shape = (s.key.rows,)
        if isinstance(update, Same):
            return Same(shape, np.dtype(np.int64))
        what = f"{self.task}: {s.key.label} fingerprints"
        path = folder / f"{s.stem}.fps"
        if isinstance(update, Full):
            return Full(read_tensor_file(path, dtype="int64", shape=shape, what=what, allocate=self.files.new))
        assert isinstance(update, Rows)
        return Rows(update.ids, read_tensor_file(path, dtype="int64", shape=(s.count,), what=what), shape)

    def _read_shard(self, folder: Path, s: ShardFiles) -> TensorUpdate:
        inner = s.shape[1:]
        what = f"{self.task}: {s.key.label}"
        if s.kind == "full":
            path, shape = folder / f"{s.stem}.full", (s.key.rows, *inner)
            if path.is_file() and not path.is_symlink():
                # A trainer of psguard before 2026-12-05 (420f2bf) wrote a tensor file (serialize_tensor): read as
                # then, so that its agent can be upgraded first.
                return Full(read_tensor_file(path, dtype=s.dtype, shape=shape, what=what, allocate=self.files.new))
            # A bundle (SaveV2 on the PS), read where the tier keeps it (its file): the apply takes it without a copy.
            return Full(read_bundle(path, dtype=s.dtype, shape=shape, what=what, allocate=self.files.new))
        if s.kind == "same":
            return Same((s.key.rows, *inner), dtype_from_name(s.dtype))
        ids = read_tensor_file(folder / f"{s.stem}.ids", dtype="int64", shape=(s.count,), what=what)
        if ids.size and (ids[0] < 0 or ids[-1] >= s.key.rows or np.any(np.diff(ids) <= 0)):
            raise CorruptCheckpointError(f"{what}: row ids not sorted, unique and within the shard")
        values = read_tensor_file(folder / f"{s.stem}.rows", dtype=s.dtype, shape=(s.count, *inner), what=what)
        return Rows(ids, values, (s.key.rows, *inner))

    def export(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Every shard as a file its PS loads, at ``token`` (the chief's state): else ``mismatch`` or ``empty``.
        Without ``peer_copies`` (no pull from a peer may follow) a store held back for such a fetch opens now."""
        expected = _maybe_token(doc, "token")
        if expected is not None:
            self._roll_back_to(expected)
        with self._export_lock:
            answer = self._reuse_export(expected) or self._export(expected)
        if answer["status"] != "ok" and doc.get("peer_copies") is not True and isinstance(self.store, StoreOpening):
            self.store.release()  # no peer copy to fetch first (store/opening.py): the log is read next
        return answer

    def stripe(self, doc: Mapping[str, Any]) -> bytes:
        """This PS's tier as its parity stripe (``{"token"}``: only at that state, one capture undone first when
        that gives it), for the holder of its group's parity rebuilding a lost member."""
        token = _token(doc, "token")
        self._roll_back_to(token)
        with self.tier.export() as snap:
            return stripe_frame(token, snap.token, snap.tensors)

    def _reuse_export(self, expected: str | None) -> dict[str, Any] | None:
        """The last export's answer when the tier still holds its state (a token names one state) and its files
        are all there."""
        if self._exported is None or expected is None:
            return None
        token, answer = self._exported
        if token != expected or self.tier.token != token:
            return None
        prefixes = [p for f in answer["files"] for p in (f["path"], f.get("fp_path")) if p]
        if not all(p.is_file() for prefix in prefixes for p in bundle_files(prefix)):
            return None
        self._exports_reused += 1
        return answer

    def _export(self, expected: str | None) -> dict[str, Any]:
        """Restore files for the tier's state: per shard its tier file hard-linked with an index, or a bundle
        written out, and its fingerprints (``fp_path``) when kept for that state. A linked file's export lease is
        kept until the files are dropped, so the tier never writes it while its PS may read it."""
        nonce = secrets.token_hex(8)
        restore = self.folder / "restore"
        snap = self.tier.export()
        fp_snap = self.fp_tier.export()
        kept = False
        try:
            if snap.empty:
                return {"status": "empty", "step": None, "token": None}
            if expected is not None and snap.token != expected:
                return {"status": "mismatch", "step": snap.step, "token": snap.token}
            self._drop_restore_files_locked()  # one restore at a time: the previous one was loaded or abandoned
            tmp = restore / f"{nonce}.tmp"
            tmp.mkdir(mode=0o700)
            files = []
            linked = False
            with_fps = fp_snap.token == snap.token and set(fp_snap.tensors) == set(snap.tensors)
            for i, (name, value) in enumerate(snap.tensors.items()):
                key, shape = self._keys[name]
                mine = self._bundle(value, tmp / str(i))
                linked = mine or linked
                entry = {
                    "name": key.name,
                    "offset": key.offset,
                    "rows": key.rows,
                    "shape": list(shape),
                    "dtype": dtype_name(value.dtype),
                    "path": str(restore / nonce / str(i)),  # the bundle's prefix
                    "linked": mine,  # the tier's own file: the PS may map it (psguard.handoff.mapped)
                }
                fps = fp_snap.tensors.get(name) if with_fps else None
                if fps is not None and fps.shape == (key.rows,) and fps.dtype == np.int64:
                    linked = self._bundle(fps, tmp / f"{i}.fp") or linked
                    entry["fp_path"] = str(restore / nonce / f"{i}.fp")
                files.append(entry)
            os.rename(tmp, restore / nonce)
            self._exports += 1
            if linked:  # written files are copies: nothing to keep them from
                self._export_lease, kept = [snap, fp_snap], True
            answer = {"status": "ok", "step": snap.step, "token": snap.token, "files": files}
            if snap.token is not None:
                self._exported = (snap.token, answer)
            return answer
        finally:
            if not kept:
                snap.release()
                fp_snap.release()

    def _bundle(self, value: np.ndarray, prefix: Path) -> bool:
        """The bundle at ``prefix`` from ``value``'s tier file (True) or written out (False)."""
        if self.files.export(value, prefix):
            return True
        write_bundle(prefix, value)  # what RestoreV2 reads on the PS
        self._export_bytes += value.nbytes
        return False

    def load(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Read the rows this PS hosts now (``shards``: ``[[name, offset, rows], ...]``) of durable ``checkpoint``
        into the tier, under its token: for a PS whose tier is gone or that must restore an older state.
        ``durable``: it is the log's newest, so the next durable saves may be deltas over it."""
        checkpoint = _token(doc, "checkpoint")
        if self.store is None:
            raise ShardError(f"the agent of {self.task} has no durable store (start it with --store)")
        keys = shard_keys(doc.get("shards"), "a load request")
        if not keys:
            raise CorruptCheckpointError("no 'shards' in a load request")
        manifest = self.store.manifest(checkpoint)
        arrays: dict[str, np.ndarray] = {}
        layout: dict[str, tuple[ShardKey, tuple[int, ...]]] = {}
        for key in keys:
            entry = manifest.tensors.get(key.name)
            if entry is None:
                raise ShardError(f"checkpoint {checkpoint} has no tensor {key.name!r}")
            name = _tier_name(key)
            # Into a tier file shard by shard: the node holds at most one shard twice.
            rows = self.store.read_rows(checkpoint, key.name, key.offset, key.offset + key.rows)
            arrays[name] = self.files.adopt(rows)
            layout[name] = (key, tuple(entry.shape))
        token = manifest.metadata.get(TOKEN_KEY)
        with self._lock:
            self._void_take()
            self.tier.seed(
                manifest.step,
                arrays,
                token=str(token) if token else None,
                durable=doc.get("durable") is True,
                metadata=dict(manifest.metadata),
            )
            self._keys = layout
            self._digests = None
            self._drop_fps()  # the log keeps no fingerprints
        return {
            "status": "ok",
            "step": manifest.step,
            "token": self.tier.token,
            "bytes": sum(a.nbytes for a in arrays.values()),
        }

    def _drop_restore_files(self) -> None:
        """Drop the restore files (a second copy on this node's tmpfs) once loaded: the next capture or restore."""
        with self._export_lock:
            self._drop_restore_files_locked()

    def _drop_restore_files_locked(self) -> None:
        self._exported = None
        for old in (self.folder / "restore").iterdir():
            shutil.rmtree(old, ignore_errors=True)
        for k, lease in enumerate(self._export_lease):
            # The tier may write the arrays again, but the shards' never in place: their PS may have mapped them.
            # (The fingerprints were read by RestoreV2, a copy.)
            lease.release(hand_off=k == 0)
        self._export_lease = []

    # ------------------------------------------------------------------------------------------ durable log
    def _void_take(self) -> None:
        """Abort the open durable take, if any (under ``_lock``): the tier takes another state, or a new take."""
        if self._take is not None:
            self._take[1].abort()
            self._take = None

    def take(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Phase one of a durable save: set aside what the log lacks, if this tier holds ``token``."""
        checkpoint, token = _token(doc, "checkpoint"), _token(doc, "token")
        base = doc.get("base") is True
        with self._lock:
            self._void_take()  # a coordinator that died between phases
            if self.tier.token != token:
                return {"status": "mismatch", "step": self.tier.step, "token": self.tier.token}
            take = self.tier.take_dirty(base=base)
            if take is None:
                return {"status": "empty"}
            self._take = (checkpoint, take)
            return {"status": "ok", "step": take.step, "token": take.token, "base": take.base}

    def write(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Phase two: write the taken shards' chunks; the part entries go to the chief, who commits."""
        checkpoint = _token(doc, "checkpoint")
        dedup = _maybe_token(doc, "dedup_against")
        if self.store is None:
            raise ShardError(f"the agent of {self.task} has no durable store (start it with --store)")
        with self._lock:
            if self._take is None or self._take[0] != checkpoint:
                raise ShardError(f"{self.task}: no durable take open for {checkpoint}")
            take = self._take[1]
        parts: dict[str, list[dict[str, Any]]] = {}
        for name, update in take.updates.items():
            key, shape = self._keys[name]
            entry = self.store.write_part(key.name, update, shape=shape, offset=key.offset, dedup_against=dedup)
            parts.setdefault(key.name, []).append(entry)
        return {"status": "ok", "parts": parts, "payload_bytes": take.payload_bytes}

    def finish(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Close the take: committed (its rows are durable) or not (they stay dirty for the next save)."""
        checkpoint = _token(doc, "checkpoint")
        committed = doc.get("committed") is True
        with self._lock:
            if self._take is None or self._take[0] != checkpoint:
                return {"status": "none"}
            take = self._take[1]
            self._take = None
        take.commit() if committed else take.abort()
        return {"status": "ok"}
