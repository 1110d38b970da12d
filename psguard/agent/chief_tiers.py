"""The chief agent's checkpoint tiers: the memory tier fed through the spool, the persister writing it to the
durable log, and the client of the PS agents that hold their shards. The tier is seeded from the durable log at
start, the agent serving HTTP while it waits for a store that does not answer."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psguard.agent.config import AgentConfig
from psguard.agent.control.metrics import AgentMetrics
from psguard.agent.control.peers import PeerSync
from psguard.agent.copies import copies_status
from psguard.agent.process.supervisor import Supervisor
from psguard.agent.recovery import Recovery
from psguard.errors import StorageUnavailableError
from psguard.handoff.contract import ENV_PARTS, default_spool_dir
from psguard.storage.registry import redact
from psguard.storage.waiting import StoreWait

if TYPE_CHECKING:  # numpy and the storage clients: only the chief's agent loads them (ChiefTiers.start)
    from psguard.agent.tiers.memory_tier import MemoryTier
    from psguard.agent.tiers.persister import Persister, PersistEvent
    from psguard.agent.tiers.shard_client import ShardClient
    from psguard.agent.tiers.spool_server import SpoolEvent, SpoolServer
    from psguard.store import Store

log = logging.getLogger(__name__)

#: The persister's part of ``/status`` (``phase``: what the write in flight does, PersisterStatus.phase).
_SHOWN = ("pending_requests", "in_flight", "phase", "checkpoints_written", "bytes_persisted", "failures", "last_error")


@dataclass(eq=False)
class ChiefTiers:
    """The chief's memory tier, persister, spool server and PS-agent client: made by :meth:`start`, released by
    :meth:`stop` (whatever :meth:`start` made before it failed)."""

    task: str
    config: AgentConfig
    _: KW_ONLY
    peers: bool
    peer_sync: PeerSync
    metrics: AgentMetrics
    recovery: Recovery
    stop_requested: threading.Event

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.tier: MemoryTier | None = None
        self.persister: Persister | None = None
        self.spool: SpoolServer | None = None
        self.spool_dir: Path | None = None
        self.heartbeat: Path | None = None  # the trainer's heartbeat file, in the spool folder the server holds
        self.store: Store | None = None
        self.store_wait: StoreWait | None = None  # the resume from the store, waited for
        self.shard_client: ShardClient | None = None  # the calls to the PS agents
        self.resumed_step: int | None = None
        self.resume_seconds: float | None = None
        self._durable_id: str | None = None
        self._durable_step: int | None = None

    def start(self) -> None:
        """Make the tier, resume it from the store, start the persister and the spool server. Returns early,
        nothing started, when the agent is stopped while it waits for the store."""
        # lazy: numpy and the storage clients load only in the chief's agent (a PS agent starts faster)
        from psguard.agent.tiers.memory_tier import MemoryTier
        from psguard.agent.tiers.spool_server import SpoolServer

        cfg = self.config
        tier = self.tier = MemoryTier()
        if self.peers:
            from psguard.agent.tiers.shard_client import ShardClient  # lazy: with the rest of the chief's parts above

            self.shard_client = ShardClient(
                self.peer_sync.tasks,
                self.peer_sync.post,
                copies=cfg.peers.copies,
                placement=cfg.peers.copy_placement,
                parity_group=cfg.peers.parity_group,
                parity_placement=cfg.peers.parity_placement,
                nodes=lambda: dict(self.peer_sync.nodes),
            )
        persister: Persister | None = None
        if cfg.store is not None:
            persister = self._start_persister(tier)
            if persister is None:
                return  # stopped while waiting: start() returns before the task, wait() with the stop's code
        self.spool_dir = Path(cfg.spool) if cfg.spool else default_spool_dir(cfg.job)
        self.spool = SpoolServer(
            self.spool_dir, tier, persister, on_event=self._on_spool_event, shards=self.shard_client
        ).start()
        self.heartbeat = self.spool.heartbeat  # in the folder the server holds, not whatever is at its path
        store_url = redact(cfg.store) if cfg.store else "-"
        log.info("event=spool_serving task=%s spool=%s store=%s", self.task, self.spool_dir, store_url)

    def _start_persister(self, tier: MemoryTier) -> Persister | None:
        """Open the store, seed ``tier`` from its newest checkpoint, and start the persister over it (None: the
        agent was stopped while it waited for the store)."""
        from psguard.agent.tiers.persister import Persister, resume  # lazy: as in start()
        from psguard.store import Store  # lazy: as in start()

        cfg = self.config
        assert cfg.store is not None
        store = self.store = Store.open(cfg.store, dict(cfg.storage_options))
        wait = self.store_wait = StoreWait(store.backend, timeout=cfg.store_wait_timeout, stop=self.stop_requested)
        self.metrics.store_wait_seconds.set_function(wait.seconds)
        t0 = time.perf_counter()
        try:  # the job's state is nowhere else (this tier is new): the store is waited for, not given up on
            last = wait.call(
                lambda: resume(store, tier, skip_sharded=self.shard_client is not None), probe=store.checkpoint_ids
            )
        except StorageUnavailableError:
            if self.stop_requested.is_set():
                return None
            raise
        self.resume_seconds = time.perf_counter() - t0
        if last is not None:
            self.resumed_step = last.step
            self._durable_id, self._durable_step = last.id, last.step
            self.metrics.record_checkpoint("durable", last.step, last.committed_at)
            self.metrics.record_checkpoint("memory", last.step, last.committed_at)
            log.info(
                "event=resumed task=%s checkpoint=%s step=%d seconds=%.3f",
                self.task,
                last.id,
                last.step,
                self.resume_seconds,
            )
        p = cfg.persister
        persister = self.persister = Persister(
            store,
            tier,
            last=last,
            max_chain=p.max_chain,
            max_delta_percent=p.max_delta_percent,
            retry_after=p.retry_after,
            on_event=self._on_persist_event,
            shards=self.shard_client,
        ).start()
        self.metrics.persist_lag_steps.set_function(lambda: float(persister.status().lag_steps or 0))
        self.metrics.persist_queue_depth.set_function(lambda: float(persister.status().pending_requests))
        self.metrics.durable_lag_steps.set_function(lambda: float(persister.status().durable_lag_steps))
        self.metrics.durable_lag_seconds.set_function(lambda: persister.status().durable_lag_seconds)
        return persister

    def announce_parts(self, supervisor: Supervisor) -> None:
        """Tell the trainer where the PS agents keep their shards, when they can take the whole job of it."""
        dirs, stores = self.peer_sync.part_dirs, self.peer_sync.part_stores
        if not dirs:
            return
        lacking = sorted(t for t in dirs if self.config.store and not stores.get(t))
        if lacking:
            log.error(
                "event=ps_side_shards_off task=%s reason=%r",
                self.task,
                f"the agents of {lacking} have no --store: they could not write their shards to the durable log, so "
                "every shard goes through the chief. Give each PS agent the chief's --store",
            )
            return
        supervisor.set_env(ENV_PARTS, json.dumps(dirs, sort_keys=True))
        log.info("event=ps_side_shards task=%s parts=%s", self.task, json.dumps(dirs, sort_keys=True))

    def export_ahead(self, only: list[str] | None = None) -> None:
        """The PS agents (or those in ``only``) write the restore's files now (:meth:`SpoolServer.export_ahead`)."""
        if self.spool is not None:
            self.spool.export_ahead(only)

    def stop(self, attempt: Callable[[Callable[[], object]], None]) -> None:
        """Hand off the trainer's last captures, drain the persister, release the rest; each step through
        ``attempt`` (the agent's stop logs what failed and goes on)."""
        if self.spool is not None:
            if self.spool.status().running:
                attempt(self.spool.process_once)  # the trainer's last captures, handed off before it stopped
            attempt(self.spool.stop)
        if (persister := self.persister) is not None:
            timeout = self.config.persister.drain_timeout

            def drain() -> None:
                if not persister.stop(drain=True, timeout=timeout):
                    log.error("event=persist_not_drained task=%s timeout=%.0fs", self.task, timeout)

            attempt(drain)
        if self.tier is not None:
            with self._lock:
                durable = self._durable_step
            log.info("event=agent_stopped task=%s memory_step=%s durable_step=%s", self.task, self.tier.step, durable)
        for closing in (self.shard_client, self.store):
            if closing is not None:
                attempt(closing.close)
        self.spool = self.persister = self.store = self.shard_client = None

    # ------------------------------------------------------------------------------------------ callbacks
    def _on_spool_event(self, event: SpoolEvent) -> None:
        if event.kind == "capture" and event.stall_seconds is not None:
            self.metrics.checkpoint_stall.observe(event.stall_seconds)
        if event.kind == "capture" and event.status == "ok" and event.step is not None:
            self.metrics.record_checkpoint("memory", event.step, time.time())
            self.recovery.on_capture()

    def _on_persist_event(self, event: PersistEvent) -> None:
        if event.kind == "failed":
            self.metrics.persist_failures.inc()
        if event.kind == "committed" and event.step is not None:
            self.metrics.persisted_bytes.inc(event.bytes_written)
            self.metrics.record_checkpoint("durable", event.step, time.time())
            with self._lock:
                self._durable_id, self._durable_step = event.checkpoint, event.step

    # ------------------------------------------------------------------------------------------ reports
    def readiness(self) -> dict[str, bool]:
        checks = {"spool": self.spool is not None and self.spool.status().running}
        if self.config.store is not None:
            checks["persister"] = self.persister is not None and self.persister.status().running
        return checks

    def status(self) -> dict[str, Any]:
        """The chief's part of the agent's ``/status``: the tiers, the durable log, the spool, the copies."""
        with self._lock:
            durable_id, durable_step = self._durable_id, self._durable_step
        tier = self.tier.status() if self.tier is not None else None
        persister = self.persister.status() if self.persister is not None else None
        spool = self.spool.status() if self.spool is not None else None
        if persister is not None and persister.last_error:
            persister = replace(persister, last_error=redact(persister.last_error))
        return {
            "spool": str(self.spool_dir) if self.spool_dir else None,
            "store": redact(self.config.store) if self.config.store else None,
            "store_wait": self.store_wait.status() if self.store_wait is not None else None,
            "resumed_step": self.resumed_step,
            "resume_seconds": self.resume_seconds,
            "memory_step": tier.step if tier else None,
            "memory_token": tier.token if tier else None,
            "memory_bytes": tier.nbytes if tier else None,
            "durable_step": durable_step,
            "durable_checkpoint": durable_id,
            "persist_lag_steps": persister.lag_steps if persister else None,
            "durable_lag_steps": persister.durable_lag_steps if persister else None,
            "durable_lag_seconds": round(persister.durable_lag_seconds, 3) if persister else None,
            "persister": {k: getattr(persister, k) for k in _SHOWN} if persister else None,
            "captures": dict(spool.captures) if spool else None,
            "spool_error": spool.last_error if spool else None,  # a capture refused, the spool moved
            "copies": copies_status(self.shard_client, tier.token if tier else None),
        }
