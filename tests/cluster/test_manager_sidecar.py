"""CheckpointManager with a sidecar: saves go through the spool to the memory tier and on to the durable log.

The agent side here is the real spool server, memory tier and persister in this process (the agent process
itself is tested in test_agent.py); the trainer side is the manager over local variables.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.persister import Persister, resume
from psguard.agent.tiers.spool_server import SpoolServer
from psguard.errors import ConfigError, SaveError
from psguard.handoff.contract import ENV_SPOOL, ENV_STORE, Tier
from psguard.handoff.spool import NeedFullCaptureError
from psguard.policy import LagBound, Schedule
from psguard.store import Store
from psguard.trainer.manager import CheckpointManager, MemoryCheckpoint
from psguard.trainer.options import ManagerOptions
from psguard.trainer.variables import bitwise_equal
from tests.support.agents import AgentProc, write_cluster
from tests.support.managers import assert_restores, make_local, snapshot, train_local


@dataclass
class Sidecar:
    spool: Path
    store: Store
    tier: MemoryTier
    persister: Persister
    server: SpoolServer

    def stop(self) -> None:
        self.server.stop()
        self.persister.stop(drain=True)


def start_sidecar(spool: Path, url: str) -> Sidecar:
    store = Store.open(url)
    tier = MemoryTier()
    last = resume(store, tier)
    persister = Persister(store, tier, last=last).start()
    server = SpoolServer(spool, tier, persister).start()
    return Sidecar(spool, store, tier, persister, server)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    car = start_sidecar(tmp_path / "spool", str(tmp_path / "store"))
    yield car
    car.stop()
    car.store.close()


def test_saves_reach_the_memory_tier_and_the_durable_log(sidecar: Sidecar) -> None:
    ckpt, emb, dense = make_local()
    rng = np.random.default_rng(11)
    with CheckpointManager(ckpt, str(sidecar.store.url), options=ManagerOptions(spool=sidecar.spool)) as m:
        for step in range(1, 4):
            train_local(emb, dense, ckpt, rng)
            info = m.save(step).result(timeout=60)  # durable by default
            assert info.step == step
            assert_restores(sidecar.store, info.id, snapshot(ckpt))
        assert sidecar.tier.step == 3
        kinds = [i.kind for i in sidecar.store.checkpoints()]
        assert kinds[0] == "full" and set(kinds[1:]) == {"delta"}


def test_a_chain_broken_while_a_delta_is_captured_gets_the_state_whole_not_a_crash(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's answer that it did not apply an earlier capture (which breaks the chain of deltas) can come
    while the next delta is being captured, after the manager asked whether it must be whole: the trainer
    crashed on it (``ConfigError: this delta has no parent state``, in a node-loss recovery with parity)."""
    ckpt, emb, dense = make_local()
    rng = np.random.default_rng(5)
    with CheckpointManager(ckpt, str(sidecar.store.url), options=ManagerOptions(spool=sidecar.spool)) as m:
        train_local(emb, dense, ckpt, rng)
        m.save(1).result(timeout=60)
        writer, real = m._sink.spool, m.capturer.capture  # type: ignore[attr-defined]
        fulls: list[bool] = []

        def capture(full: bool = False) -> object:
            fulls.append(full)
            out = real(full=full)
            if not full:
                writer.parent = None  # as the writer's ack handler does for a capture the agent refused
            return out

        monkeypatch.setattr(m.capturer, "capture", capture)
        train_local(emb, dense, ckpt, rng)
        info = m.save(2).result(timeout=60)
        assert fulls == [False, True]  # the delta, then the same state whole
        assert info.step == 2 and sidecar.tier.step == 2
        assert_restores(sidecar.store, info.id, snapshot(ckpt))
        # The answer before the capture (the usual order): the next capture is whole, object graph and all.
        writer.parent = None
        train_local(emb, dense, ckpt, rng)
        info = m.save(3).result(timeout=60)
        assert fulls[2:] == [True] and sidecar.tier.step == 3
        assert_restores(sidecar.store, info.id, snapshot(ckpt))


def test_a_refused_capture_redone_whole_by_the_next_save_does_not_fail_wait(sidecar: Sidecar) -> None:
    """The agent refuses a delta whose parent state its tier does not hold (need_full: after a tier or a peer
    copy was reset); the next save is whole. ``wait()`` then reports nothing lost, while a refused save with
    no later save is still a failure."""
    ckpt, emb, dense = make_local()
    rng = np.random.default_rng(9)
    with CheckpointManager(ckpt, str(sidecar.store.url), options=ManagerOptions(spool=sidecar.spool)) as m:
        train_local(emb, dense, ckpt, rng)
        m.save(1, tiers=frozenset({Tier.MEMORY})).result(timeout=60)
        writer = m._sink.spool  # type: ignore[attr-defined]
        writer.parent = "gone-7"  # a state the tier does not hold
        train_local(emb, dense, ckpt, rng)
        refused = m.save(2, tiers=frozenset({Tier.MEMORY}))
        with pytest.raises(NeedFullCaptureError):
            refused.result(timeout=60)
        train_local(emb, dense, ckpt, rng)
        m.save(3, tiers=frozenset({Tier.MEMORY})).result(timeout=60)  # whole: the chain was broken
        m.wait(60)  # step 2's refusal was redone by step 3
        assert sidecar.tier.step == 3
        writer.parent = "gone-8"
        m.save(4, tiers=frozenset({Tier.MEMORY}))
        with pytest.raises(SaveError, match="not applied"):
            m.wait(60)
        # A durable save is redone only by a later durable one: a memory-only save after it does not count.
        writer.parent = "gone-9"
        with pytest.raises(NeedFullCaptureError):
            m.save(5).result(timeout=60)
        train_local(emb, dense, ckpt, rng)
        m.save(6, tiers=frozenset({Tier.MEMORY}))
        with pytest.raises(SaveError, match="step 5"):
            m.wait(60)


def test_restore_prefers_a_newer_memory_tier(sidecar: Sidecar) -> None:
    ckpt, emb, dense = make_local()
    rng = np.random.default_rng(12)
    url = str(sidecar.store.url)
    with CheckpointManager(ckpt, url, options=ManagerOptions(spool=sidecar.spool)) as m:
        train_local(emb, dense, ckpt, rng)
        m.save(1).result(timeout=60)
        train_local(emb, dense, ckpt, rng)
        h = m.save(2, tiers=frozenset({Tier.MEMORY}))  # restorable, not durable
        memory_only = h.result(timeout=60)
        assert isinstance(memory_only, MemoryCheckpoint) and memory_only.step == 2 and memory_only.token
        want = snapshot(ckpt)
    fresh, _, _ = make_local(seed=5, rows=(3000,))
    with CheckpointManager(fresh, url, options=ManagerOptions(spool=sidecar.spool)) as m2:
        assert m2.restore_or_initialize() is not None
        assert m2.restored is not None and m2.restored.source == "memory" and m2.restored.step == 2
        got = snapshot(fresh)
        assert all(bitwise_equal(want[n], got[n]) for n in want)
        # the next save is a delta over the restored state, accepted by the tier
        train_local(fresh.emb, fresh.dense, fresh, rng)
        info = m2.save(3).result(timeout=60)
        assert info.kind == "delta"
        assert_restores(sidecar.store, info.id, snapshot(fresh))


def test_tfs_restore_lines_take_the_memory_tier_when_nothing_is_durable_yet(sidecar: Sidecar) -> None:
    """``if manager.latest_checkpoint: checkpoint.restore(...)`` after a restart before the first durable commit:
    the memory tier's state, not a fresh start."""
    ckpt, emb, dense = make_local()
    url = str(sidecar.store.url)
    sidecar.persister.stop(drain=False)  # the store takes no commit yet (down, or the first base still on its way)
    with CheckpointManager(ckpt, url, options=ManagerOptions(spool=sidecar.spool)) as m:
        train_local(emb, dense, ckpt, np.random.default_rng(13))
        m.save(4, tiers=frozenset({Tier.MEMORY})).result(timeout=60)
        want = snapshot(ckpt)
    assert sidecar.store.latest() is None
    fresh, _, _ = make_local(seed=6)
    with CheckpointManager(fresh, url, options=ManagerOptions(spool=sidecar.spool)) as m2:
        latest = m2.latest_checkpoint
        assert latest is not None and latest.startswith("memory:")
        status = fresh.restore(latest).assert_consumed()
        assert (status.source, status.step) == ("memory", 4)
        got = snapshot(fresh)
        assert all(bitwise_equal(want[n], got[n]) for n in want)
        m2.save(5, tiers=frozenset({Tier.MEMORY}))
        assert m2.latest_checkpoint is None or not m2.latest_checkpoint.startswith("memory:")


def test_the_first_memory_save_starts_the_logs_base_so_a_lost_node_has_one(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "store"))
    tier = MemoryTier()
    committed = threading.Event()
    persister = Persister(store, tier, on_event=lambda e: committed.set() if e.kind == "committed" else None).start()
    server = SpoolServer(tmp_path / "spool", tier, persister).start()
    try:
        ckpt, emb, dense = make_local()
        with CheckpointManager(ckpt, str(store.url), options=ManagerOptions(spool=tmp_path / "spool")) as m:
            train_local(emb, dense, ckpt, np.random.default_rng(17))
            m.save(3, tiers=frozenset({Tier.MEMORY})).result(timeout=60)  # memory only: nobody asked durable
            want = snapshot(ckpt)
            assert committed.wait(60), "no base was written for the first capture"
        info = store.latest()
        assert info is not None and (info.step, info.kind) == (3, "full")
        assert_restores(store, info.id, want)
    finally:
        server.stop()
        persister.stop()
        store.close()


def test_without_a_live_agent_restore_uses_the_durable_log(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    car = start_sidecar(tmp_path / "spool", url)
    ckpt, emb, dense = make_local()
    with CheckpointManager(ckpt, url, options=ManagerOptions(spool=car.spool)) as m:
        train_local(emb, dense, ckpt, np.random.default_rng(13))
        m.save(4).result(timeout=60)
        want = snapshot(ckpt)
    car.stop()
    car.store.close()
    fresh, _, _ = make_local(seed=6)
    with CheckpointManager(fresh, url, options=ManagerOptions(spool=tmp_path / "spool")) as m2:
        assert m2.restore_or_initialize() is not None
        assert m2.restored is not None and m2.restored.source == "durable" and m2.restored.step == 4
        got = snapshot(fresh)
        assert all(bitwise_equal(want[n], got[n]) for n in want)


def test_a_failed_generation_is_released_without_waiting_for_the_agents_durable_write(tmp_path: Path) -> None:
    """After a cluster failure the in-process rejoin closes the old managers at once: the agent finishes their
    durable writes on its own. ``close`` (end of training) still waits for them."""
    import time

    from psguard.trainer.registry import process_managers

    store = Store.open(str(tmp_path / "store"))
    tier = MemoryTier()
    persister = Persister(store, tier)  # never started: every durable write stays pending
    server = SpoolServer(tmp_path / "spool", tier, persister).start()
    try:
        ckpt, emb, dense = make_local()
        train_local(emb, dense, ckpt, np.random.default_rng(21))
        # Training may not wait for durable writes that never come: the lag is only reported.
        report = Schedule(durable_lag=LagBound(on_exceed="report"))
        waiting = CheckpointManager(
            ckpt, str(store.url), options=ManagerOptions(spool=tmp_path / "spool"), policy=report
        )
        waiting.save(1).restorable(timeout=60)  # in the memory tier, durable never
        with pytest.raises(TimeoutError, match="save of step 1 not durable"):
            waiting.close(timeout=0.5)
        m = CheckpointManager(ckpt, str(store.url), options=ManagerOptions(spool=tmp_path / "spool"), policy=report)
        handle = m.save(2)
        handle.restorable(timeout=60)
        t0 = time.monotonic()
        process_managers.release_after_failure(timeout=600)
        assert time.monotonic() - t0 < 60  # it did not wait for the durable write (which never comes)
        assert not process_managers.is_open(m) and not handle.done()
        m.close(timeout=0.1)  # the user's own close afterwards does nothing: no wait, no TimeoutError
        assert tier.step == 2  # the memory tier has the save: nothing the agent acknowledged is dropped
    finally:
        server.stop()
        persister.stop(drain=False)
        store.close()


def test_the_failure_time_told_to_the_agent_is_the_failed_generations_last_step(tmp_path: Path) -> None:
    """A PS started after that moment holds nothing of the failed generation, so the agent leaves it alone: the
    time the failure was seen would be later than a PS its agent had already restarted (a warm standby, 0.1 s),
    which was then restarted a second time, cold (12.7 s at 1 GB under load)."""
    import time

    from psguard.trainer.recovery import _failure_time
    from psguard.trainer.registry import process_managers

    store = Store.open(str(tmp_path / "store"))
    tier = MemoryTier()
    persister = Persister(store, tier).start()
    server = SpoolServer(tmp_path / "spool", tier, persister).start()
    try:
        ckpt, _, _ = make_local()
        m = CheckpointManager(ckpt, str(store.url), options=ManagerOptions(spool=tmp_path / "spool"))
        before = time.time()
        m.save(1).result(timeout=60)
        ran = process_managers.generation_ran_at()
        assert ran is not None and before <= ran <= time.time()
        assert _failure_time() == ran
        assert _failure_time(ran - 5) == ran - 5  # a failure seen even earlier (the caller's own time) wins
        process_managers.release_after_failure()
        assert process_managers.generation_ran_at() is None  # the next generation has made no step yet
        now = time.time()
        assert _failure_time() >= now
    finally:
        server.stop()
        persister.stop(drain=False)
        store.close()


def test_under_an_agent_max_to_keep_is_applied_and_the_stall_is_reported(tmp_path: Path) -> None:
    """The agent's writer applies the manager's retention; each capture tells the agent its training stall."""
    from psguard.agent.tiers.spool_server import SpoolEvent

    events: list[SpoolEvent] = []
    store = Store.open(str(tmp_path / "store"))
    tier = MemoryTier()
    persister = Persister(store, tier, max_chain=1, max_delta_percent=None).start()
    server = SpoolServer(tmp_path / "spool", tier, persister, on_event=events.append).start()
    try:
        ckpt, emb, dense = make_local()
        rng = np.random.default_rng(5)
        with CheckpointManager(
            ckpt, str(store.url), max_to_keep=2, options=ManagerOptions(spool=tmp_path / "spool")
        ) as m:
            for step in range(1, 7):
                train_local(emb, dense, ckpt, rng)
                m.save(step).result(timeout=60)
            stalls = [e.stall_seconds for e in events if e.kind == "capture"]
            assert len(stalls) == 6 and all(s is not None and 0 <= s < 60 for s in stalls), stalls
            assert stalls[-1] == pytest.approx(m.last_stall_seconds, abs=1e-5)
        # a new base at least every other checkpoint (max_chain 1): keep-last 2 leaves at most 3 manifests, once
        # the retention after the last commit (it follows the commit's acknowledgment) is done
        assert persister.wait_idle(60)
        steps = sorted(i.step for i in store.checkpoints())
        assert steps[-2:] == [5, 6] and len(steps) <= 3, steps
    finally:
        server.stop()
        persister.stop(drain=True)
        store.close()


# ------------------------------------------------------------------ the agent's store against the manager's URL
def test_a_manager_pointed_elsewhere_than_its_agents_store_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--store A with the manager pointed at B would put everything in A and leave B empty: refused, with both."""
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv(ENV_SPOOL, str(tmp_path / "spool"))
    monkeypatch.setenv(ENV_STORE, str(a))
    ckpt, _, _ = make_local()
    with pytest.raises(ConfigError, match=r"writes checkpoints to --store .*/a, but the manager is pointed at .*/b"):
        CheckpointManager(ckpt, str(b))
    assert not b.exists()  # refused before anything was opened
    monkeypatch.setenv(ENV_STORE, f"file://{a}/")  # another spelling of the same store is the same store
    with CheckpointManager(ckpt, str(a)) as m:
        assert type(m._sink).__name__ == "AgentSink"


def test_under_an_agent_without_a_store_the_manager_writes_its_directory_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV_SPOOL, str(tmp_path / "spool"))
    monkeypatch.setenv(ENV_STORE, "")  # the agent was started without --store
    url = str(tmp_path / "store")
    ckpt, emb, dense = make_local()
    with CheckpointManager(ckpt, url) as m:
        train_local(emb, dense, ckpt, np.random.default_rng(3))
        m.save(5).result(timeout=60)
    assert any(
        r.levelname == "WARNING" and "has no --store" in r.getMessage() and f"--store {url}" in r.getMessage()
        for r in caplog.records
    )
    with Store.open(url) as store:
        assert [i.step for i in store.checkpoints()] == [5]


def test_a_url_missing_a_slash_is_refused_not_made_a_local_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt, _, _ = make_local()
    for url in ("s3:/bucket/job", "s3:bucket/job", "hdfs:/nn:8020/x"):
        with pytest.raises(ConfigError, match=r"missing a slash: write (s3://bucket/job|hdfs://nn:8020/x)"):
            CheckpointManager(ckpt, url)
    with pytest.raises(ConfigError, match="write file:///tmp/x"):
        Store.open("file:/tmp/x")
    assert list(tmp_path.iterdir()) == []
    Store.open("./s3:/bucket/job").close()  # said to be local: accepted


# ------------------------------------------------------------------ one rule for new bases, whoever writes the log
NEW_BASE_TRAINER = """
import os, sys
import numpy as np
import tensorflow as tf
import psguard

table = tf.Variable(np.zeros((256, 8), np.float32))
ckpt = tf.train.Checkpoint(table=table)
options = psguard.ManagerOptions(new_base_after=int(sys.argv[1]))
manager = psguard.CheckpointManager(ckpt, os.environ["PSGUARD_STORE"], options=options)
for step in range(1, 8):
    table.scatter_update(tf.IndexedSlices(tf.fill([1, 8], float(step)), tf.constant([step])))
    manager.save(step).result(timeout=120)  # durable: the agent committed it
manager.close()
"""


@pytest.mark.slow
def test_new_base_after_is_honoured_when_the_agent_writes_the_log(
    tmp_path: Path, agents: Callable[..., AgentProc]
) -> None:
    """The agent's own rule would make one base and six deltas (``max_chain`` 16); the trainer's
    ``new_base_after=2`` travels with its captures and the agent's writer follows it, as the manager's own
    writer does without an agent."""
    cluster, _ = write_cluster(tmp_path)
    script = tmp_path / "trainer.py"
    script.write_text(NEW_BASE_TRAINER)
    store_dir = tmp_path / "store"
    args = ["--role", "chief", "--index", "0", "--cluster", str(cluster), "--store", str(store_dir)]
    args += ["--spool", str(tmp_path / "spool")]
    agent = agents("chief", args, [sys.executable, str(script), "2"])
    assert agent.wait_exit(300) == 0, agent.log()
    with Store.open(str(store_dir)) as store:
        made = [(i.step, i.kind, i.chain_length) for i in sorted(store.checkpoints(), key=lambda i: i.step)]
        assert all(store.verify(cid).ok for cid in store.checkpoint_ids())
    # a new base whenever the chain reached 2 deltas: full, delta, delta, full, ...
    assert made == [
        (1, "full", 0),
        (2, "delta", 1),
        (3, "delta", 2),
        (4, "full", 0),
        (5, "delta", 1),
        (6, "delta", 2),
        (7, "full", 0),
    ], made
