"""The agent's answers to a trainer's restore requests through the spool (the protocol: :mod:`psguard.handoff.spool`).

An answer is the memory tier's export: the chief's tensors as files in the spool, and each PS's shards written by
its own agent (``parts``), asked for ahead when a new generation starts. A request naming a durable checkpoint has
every tier load it first, unless the recovery plan says that would lose a newer state (then: ``newer``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.persister import Persister
from psguard.agent.tiers.shard_client import ShardClient
from psguard.agent.tiers.shards import ShardError, StateNotHeldError, shard_keys
from psguard.codec.dtypes import dtype_name
from psguard.errors import CorruptCheckpointError, PsguardError
from psguard.handoff.contract import TOKEN_KEY
from psguard.handoff.plan import Durable, Facts, Memory, plan
from psguard.handoff.spool import (
    AGENT_TMP,
    RESTORE_FORMAT,
    VERSION,
    NewerInMemoryError,
    SpoolPaths,
    read_json_if_present,
    write_array,
    write_private,
)
from psguard.store.manifest import is_checkpoint_id

log = logging.getLogger(__name__)


@dataclass
class _Ahead:
    """An export ahead of a restore: for state ``token`` and PS ``tasks``; ``files`` once it answered."""

    token: str
    tasks: frozenset[str]
    done: threading.Event = field(default_factory=threading.Event)
    files: list[dict[str, Any]] | None = None


class RestoreAnswers:
    """Answers the restore requests of one spool (a base class of
    :class:`~psguard.agent.tiers.spool_server.SpoolServer`, kept apart to keep the server readable); ``_order`` is
    the lock the captures take to move the tiers."""

    _paths: SpoolPaths
    root: Path
    tier: MemoryTier
    persister: Persister | None
    shards: ShardClient | None
    _order: threading.Lock
    _ahead_lock: threading.Lock
    _ahead: _Ahead | None  # the export ahead of the next restore (export_ahead)

    def _writer_alive(self, gen: str) -> bool:
        raise NotImplementedError

    def export_ahead(self, only: Sequence[str] | None = None) -> threading.Thread | None:
        """Have every PS agent (or those in ``only``) write its restore files for the tier's state now, in a
        thread (returned; None: nothing to export), while the PS restart and the trainer rebuilds: the restore
        that follows takes this answer (:meth:`_export_parts`), and a replacement agent fetches its shards from
        its peer copy meanwhile."""
        shards, token = self.shards, self.tier.token
        if shards is None or not shards.active or token is None:
            return None
        tasks = tuple(t for t in shards.active if only is None or t in only)
        if not tasks:
            return None
        ahead = _Ahead(token, frozenset(tasks))
        if only is None:  # a part of the PS is no answer for a restore
            with self._ahead_lock:
                self._ahead = ahead

        def run() -> None:
            t0 = time.perf_counter()
            try:
                ahead.files = shards.export(tasks, token)
            except (OSError, PsguardError) as e:  # the restore's own export will say what is wrong
                log.info("spool %s: exporting ahead of the restore failed: %s", self.root, e)
                return
            finally:
                ahead.done.set()
            log.info("spool %s: the PS agents exported state %s ahead of the restore in %.2fs", self.root, token,
                     time.perf_counter() - t0)  # fmt: skip

        thread = threading.Thread(target=run, name="psguard-export-ahead", daemon=True)
        thread.start()
        return thread

    def _export_parts(self, shards: ShardClient, token: str) -> list[dict[str, Any]]:
        """Every PS agent's restore files for state ``token``: the export ahead's answer when it was for this state
        and every PS (waited for), once; else an export now."""
        with self._ahead_lock:
            ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.token == token and ahead.tasks == frozenset(shards.active):
            ahead.done.wait(shards.timeout)
            if ahead.files is not None:
                log.info("spool %s: the restore takes the files exported ahead for state %s", self.root, token)
                return ahead.files
        return shards.export(shards.active, token)

    def serve(self, request: Path, name: str, gen: str) -> tuple[int | None, str] | None:
        """Answer the restore ``request`` of writer ``gen`` under ``name``: the answer's step and status (None:
        nobody will read an answer)."""
        final = self._paths.restore / name
        if final.exists() or not self._writer_alive(gen):
            with contextlib.suppress(OSError):
                request.unlink()
            return None
        tmp = self._paths.restore / f"{name}{AGENT_TMP}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        durable = self.persister.status() if self.persister is not None else None
        try:
            wanted = read_json_if_present(request) or {}
            if wanted.get("checkpoint") is not None:
                self._load_durable(wanted, durable.last_id if durable else None)
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
                }
                doc["tensors"] = [
                    {"name": n, "dtype": dtype_name(v.dtype), "shape": list(v.shape), **write_array(tmp, f"{i}.bin", v)}
                    for i, (n, v) in enumerate(snap.tensors.items())
                ]
                if self.shards is not None and self.shards.active and not snap.empty and snap.token is not None:
                    # Each PS's agent writes its shards on its own node; the trainer's PS load them there.
                    doc["parts"] = self._export_parts(self.shards, snap.token)
        except (OSError, PsguardError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            status = "newer" if isinstance(e, NewerInMemoryError) else "error"
            reason = "the spool's tmpfs is full" if isinstance(e, OSError) and e.errno == errno.ENOSPC else str(e)
            doc = {"format": RESTORE_FORMAT, "version": VERSION, "status": status, "message": reason}
            log.warning("spool %s: could not export the memory tier: %s", self.root, e)
        write_private(tmp / "manifest.json", json.dumps(doc, allow_nan=False).encode())
        os.rename(tmp, final)
        with contextlib.suppress(OSError):
            request.unlink()
        return doc.get("step"), doc["status"]

    def _load_durable(self, wanted: Mapping[str, Any], last_id: str | None) -> None:
        """Bring every tier to a durable checkpoint (the chief's the small tensors, each PS agent's the rows its PS
        hosts now) under its token, for a trainer that cannot restore from the memory tiers; the export follows."""
        checkpoint = wanted.get("checkpoint")
        raw = wanted.get("shards")
        if not isinstance(checkpoint, str) or not is_checkpoint_id(checkpoint):
            raise CorruptCheckpointError(f"restore request: bad checkpoint {checkpoint!r}")
        if self.persister is None or self.shards is None:
            raise ShardError("this agent has no durable store or no PS agents: the trainer reads the log itself")
        if not isinstance(raw, dict):
            raise CorruptCheckpointError("restore request: bad shards")
        shards = {str(task): shard_keys(keys, f"a restore request, {task}") for task, keys in raw.items()}
        store = self.persister.store
        manifest = store.manifest(checkpoint)
        if not wanted.get("force"):
            self._refuse_over_newer(checkpoint, manifest.step)
        spilled = {k.name for keys in shards.values() for k in keys}
        small = store.load(checkpoint, [n for n in manifest.tensors if n not in spilled])
        token = manifest.metadata.get(TOKEN_KEY)
        durable = checkpoint == last_id  # later durable saves may be deltas over it
        with self._ahead_lock:
            self._ahead = None  # the tiers take another state: an export ahead is no answer for it
        with self._order:
            self.shards.load(shards, checkpoint, durable=durable)
            self.tier.seed(
                manifest.step, small, metadata=manifest.metadata, token=str(token) if token else None, durable=durable
            )
        log.info(
            "spool %s: every tier loaded checkpoint %s (step %d) for a restore", self.root, checkpoint, manifest.step
        )

    def _refuse_over_newer(self, checkpoint: str, step: int) -> None:
        """Raise :class:`NewerInMemoryError` when the recovery plan restores a newer state than ``checkpoint``
        (:meth:`psguard.handoff.plan.RecoveryPlan.loses`): a memory restore that failed for another reason than
        the tiers must not have the log overwrite acknowledged saves. Only PS agents that answer they hold no
        such state let the log in; one that cannot answer stops the load."""
        token, newer, shards = self.tier.token, self.tier.step, self.shards
        if token is None or newer is None or shards is None or not shards.active:
            return
        facts = Facts(memory=Memory(newer, token), durable=Durable.at(step, checkpoint))
        if not plan(facts).loses(step):
            return
        held: bool | None = True
        unknown: ShardError | None = None
        try:
            shards.export(shards.active, token)
        except StateNotHeldError as e:
            held = False
            log.warning("spool %s: the tiers' step %d is not whole on the PS agents (%s): loading checkpoint %s "
                        "(step %d)", self.root, newer, e, checkpoint, step)  # fmt: skip
        except ShardError as e:
            held, unknown = None, e
        if not plan(replace(facts, memory=Memory(newer, token, held=held))).loses(step):
            return
        if unknown is not None:
            raise ShardError(
                f"could not tell whether the PS agents still hold the memory tier's step {newer} ({unknown}): not "
                f"loading the older checkpoint {checkpoint} (step {step}) over it"
            ) from unknown
        raise NewerInMemoryError(
            f"the memory tiers hold step {newer}, newer than checkpoint {checkpoint} (step {step}), and every PS "
            "agent still gives it: restore the memory tier (loading the log would lose acknowledged saves)"
        )
