"""The chief agent's tiers on their own: resumed from the durable log at start, fed through the spool, drained at
stop (the whole agent, with its task and peers: tests/cluster/test_agent.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from psguard.agent.chief_tiers import ChiefTiers
from psguard.agent.config import AgentConfig
from psguard.agent.control.metrics import AgentMetrics
from psguard.agent.control.peers import PeersConfig, PeerSync
from psguard.agent.recovery import Recovery
from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.persister import Persister
from psguard.handoff.contract import Tier
from psguard.handoff.spool import Capture
from psguard.store import Store
from psguard.tensors import Full
from psguard.trainer.spool_writer import SpoolWriter


def tiers(config: AgentConfig) -> ChiefTiers:
    metrics = AgentMetrics()
    recovery = Recovery(
        "chief:0", "chief", restart_ps=False, metrics=metrics, peer_sync=None,  # type: ignore[arg-type]
        supervisor=lambda: None, monitor=lambda: None, export_ahead=lambda: None, on_done=lambda: None,
    )  # fmt: skip
    chief = ChiefTiers(
        "chief:0", config, peers=False, peer_sync=None,  # type: ignore[arg-type]  # no PS agents: never asked
        metrics=metrics, recovery=recovery, stop_requested=threading.Event(),
    )  # fmt: skip
    return chief


def test_the_tiers_resume_from_the_log_and_a_capture_through_the_spool_becomes_durable(tmp_path: Path) -> None:
    store_url, value = str(tmp_path / "store"), np.arange(6, dtype=np.float32)
    with Store.open(store_url) as store:  # an earlier chief agent's commit at step 4
        tier = MemoryTier()
        assert tier.apply({"w": Full(value)}, step=4, token="t4", parent=None).ok
        with Persister(store, tier) as p:
            p.request(4).result(timeout=30)
    chief = tiers(AgentConfig(store=store_url, spool=str(tmp_path / "spool")))
    try:
        chief.start()
        status = chief.status()
        assert (status["resumed_step"], status["durable_step"], status["memory_step"]) == (4, 4, 4)
        assert chief.readiness() == {"spool": True, "persister": True} and chief.heartbeat is not None
        with SpoolWriter(tmp_path / "spool") as w:
            handle = w.submit(Capture(5, {"w": Full(value + 1)}, tiers=frozenset({Tier.MEMORY, Tier.DURABLE})))
            assert handle.result(timeout=30).memory_step == 5  # in the memory tier
            assert handle.durable(timeout=30).durable_step == 5  # and committed to the log
    finally:
        chief.stop(lambda fn, *args: fn(*args))
    assert chief.status()["durable_step"] == 5 and chief.spool is None and chief.persister is None
    with Store.open(store_url) as store:
        assert [c.step for c in store.checkpoints()] == [4, 5]


def test_a_chief_with_peers_stops_cleanly(tmp_path: Path) -> None:
    """With PS peers the tiers hold a ShardClient: every step of the stop runs and raises nothing."""
    chief = tiers(AgentConfig(spool=str(tmp_path / "spool")))
    chief.peers, chief.peer_sync = True, PeerSync("chief:0", [], PeersConfig(), "t" * 16, threading.Event())
    chief.start()
    assert chief.shard_client is not None
    failed: list[BaseException] = []

    def attempt(fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as e:
            failed.append(e)

    chief.stop(attempt)
    assert failed == [] and chief.spool is None and chief.shard_client is None
