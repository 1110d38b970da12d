"""One save pipeline, two sinks: what a save, wait() and close() mean with and without an agent, the policy
file's retention and base sections honoured by both, and a watched policy file edited while the manager runs.

The agent side is the real spool server, memory tier and persister in this process (the agent process itself:
test_agent.py and the slow test at the end, which runs a real ``psguard agent``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.persister import Persister
from psguard.agent.tiers.spool_server import SpoolServer
from psguard.errors import SaveError
from psguard.handoff.contract import Tier
from psguard.policy.engine import EverySteps, Retention, Schedule
from psguard.policy.lag import LagBound
from psguard.storage import open_backend
from psguard.store import Store
from psguard.trainer.manager import CheckpointManager, MemoryCheckpoint
from psguard.trainer.options import ManagerOptions
from tests.support.agents import lone_chief_agent
from tests.support.managers import FlakyBackend, GatedBackend, make_local, snapshot, train_local

POLICY = """
durable: {{every_steps: {every}}}
base: {{max_chain: {chain}}}
retention: {{keep_last: {keep}}}
"""


def write_policy(path: Path, *, every: int, keep: int, chain: int = 1000) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(POLICY.format(every=every, keep=keep, chain=chain))
    tmp.rename(path)  # as editors and ConfigMaps do: never a half-written file
    return path


class GatedManifests(GatedBackend):
    """Manifest commits wait for the gate: a durable write that lasts exactly as long as the test wants."""

    def put_new(self, key: str, data: bytes | memoryview) -> None:
        if key.startswith("manifests/"):
            self.entered.set()
            assert self.gate.wait(60), "gate never opened"
        super().put_new(key, data)

    def put(self, key: str, data: bytes | memoryview) -> None:
        super(GatedBackend, self).put(key, data)


class Agent:
    """The agent's parts in this process, over ``store``."""

    def __init__(self, spool: Path, store: Store) -> None:
        self.tier = MemoryTier()
        self.persister = Persister(store, self.tier).start()
        self.server = SpoolServer(spool, self.tier, self.persister).start()

    def stop(self) -> None:
        self.server.stop()
        self.persister.stop(drain=True)


def test_under_an_agent_wait_returns_only_once_the_save_is_durable(tmp_path: Path) -> None:
    gate = threading.Event()
    backend = GatedManifests(open_backend(str(tmp_path / "store")), gate)
    store = Store(backend)
    agent = Agent(tmp_path / "spool", store)
    opened_at: list[float] = []

    def open_gate() -> None:
        assert backend.entered.wait(60)  # the agent is committing step 1 and is held at the manifest
        time.sleep(0.3)  # a slow commit: long enough that a wait() that does not wait would return before it
        opened_at.append(time.monotonic())
        gate.set()

    opener = threading.Thread(target=open_gate)
    try:
        ckpt, emb, dense = make_local()
        # durable_lag report: save() returns at the capture, so what is tested is wait() itself
        report = Schedule(durable_lag=LagBound(on_exceed="report"))
        with CheckpointManager(
            ckpt, str(store.url), options=ManagerOptions(spool=tmp_path / "spool", store=store), policy=report
        ) as m:
            train_local(emb, dense, ckpt, np.random.default_rng(1))
            h = m.save(1)
            opener.start()
            m.wait(timeout=60)
            returned_at = time.monotonic()
            latest = store.latest()
            assert opened_at and returned_at >= opened_at[0], "wait() returned before the commit could happen"
            assert latest is not None and latest.step == 1
            info = h.result(timeout=1)
            assert not isinstance(info, MemoryCheckpoint) and info.id == latest.id
    finally:
        gate.set()
        opener.join()
        agent.stop()
        store.close()


def test_under_an_agent_close_raises_when_a_durable_save_failed(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "store"))
    agent = Agent(tmp_path / "spool", store)
    try:
        ckpt, emb, dense = make_local()
        m = CheckpointManager(ckpt, str(store.url), options=ManagerOptions(spool=tmp_path / "spool"))
        train_local(emb, dense, ckpt, np.random.default_rng(2))
        m.save(1).result(timeout=60)
        agent.persister.stop(drain=True)  # the agent's writer is gone: nothing more becomes durable
        agent.server.stop()
        train_local(emb, dense, ckpt, np.random.default_rng(3))
        m.save(2)
        with pytest.raises(TimeoutError):
            m.wait(timeout=1.0)
        with pytest.raises(TimeoutError):
            m.close(timeout=0.5)  # still pending: close() does not pretend it is durable
    finally:
        store.close()


def test_a_memory_only_save_resolves_to_a_typed_memory_checkpoint(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "store"))
    agent = Agent(tmp_path / "spool", store)
    try:
        ckpt, emb, dense = make_local()
        with CheckpointManager(ckpt, str(store.url), options=ManagerOptions(spool=tmp_path / "spool")) as m:
            train_local(emb, dense, ckpt, np.random.default_rng(4))
            h = m.save(7, tiers=frozenset({Tier.MEMORY}))
            got = h.result(timeout=60)
            assert isinstance(got, MemoryCheckpoint) and got.step == 7 and got.token
            assert not h.durable
            m.wait(timeout=60)
        assert store.latest() is None  # never asked to be durable
    finally:
        agent.stop()
        store.close()


@pytest.mark.parametrize("sink", ["store", "agent"])
def test_the_policy_files_retention_is_applied_by_either_sink(tmp_path: Path, sink: str) -> None:
    policy = write_policy(tmp_path / "policy.yaml", every=1, keep=2, chain=1)
    store = Store.open(str(tmp_path / "store"))
    agent = Agent(tmp_path / "spool", store) if sink == "agent" else None
    try:
        ckpt, emb, dense = make_local()
        spool = tmp_path / "spool" if agent else None
        with CheckpointManager(ckpt, str(store.url), policy=policy, options=ManagerOptions(spool=spool)) as m:
            assert m.retention == Retention(keep_last=2)
            rng = np.random.default_rng(6)
            for step in range(1, 7):
                train_local(emb, dense, ckpt, rng)
                h = m.maybe_save(step)
                assert h is not None
                h.result(timeout=60)
        steps = sorted(i.step for i in store.checkpoints())
        # keep-last 2 (plus the base a kept delta needs: at most one more)
        assert steps[-2:] == [5, 6] and len(steps) <= 3, steps
    finally:
        if agent:
            agent.stop()
        store.close()


def test_explicit_max_to_keep_wins_over_the_policy_file(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml", every=1, keep=2)
    ckpt, _, _ = make_local()
    with CheckpointManager(ckpt, str(tmp_path / "store"), max_to_keep=4, policy=policy) as m:
        assert m.retention == Retention(keep_last=4)
    with pytest.raises(Exception, match=r"either options\.retention or max_to_keep"):
        CheckpointManager(
            ckpt, str(tmp_path / "store"), max_to_keep=4, options=ManagerOptions(retention=Retention(keep_last=1))
        )


def test_the_policy_files_base_section_makes_new_bases_without_an_agent(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml", every=1, keep=100, chain=2)
    store = Store.open(str(tmp_path / "store"))
    try:
        ckpt, emb, dense = make_local()
        with CheckpointManager(ckpt, str(store.url), policy=policy, options=ManagerOptions(new_base_after=0)) as m:
            rng = np.random.default_rng(7)
            for step in range(1, 8):
                train_local(emb, dense, ckpt, rng)
                h = m.maybe_save(step)
                assert h is not None
                h.result(timeout=60)
        chains = [store.manifest(i.id).chain_length for i in store.checkpoints()]
        # new_base_after=0 turned the manager's own rule off: only the policy's base section folds chains (the
        # delta the decision came with is folded into the new base, so a chain reaches max_chain + 1 at most)
        assert max(chains) <= 3, chains
        assert chains.count(0) >= 3, chains
        assert any(i.kind == "full" and i.step > 1 for i in store.checkpoints()), "no new base was made"
    finally:
        store.close()


def test_an_edited_policy_file_changes_a_running_managers_decisions(tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml", every=1000, keep=5)
    ckpt, emb, dense = make_local()
    with CheckpointManager(ckpt, str(tmp_path / "store"), policy=policy) as m:
        watcher = m._policy.watcher
        assert watcher is not None
        rng = np.random.default_rng(8)
        train_local(emb, dense, ckpt, rng)
        assert [m.maybe_save(s) for s in (1, 2, 3)] == [None, None, None]  # every 1000 steps
        generation = watcher.generation
        write_policy(policy, every=1, keep=3)
        reload = watcher.wait_for(generation + 1, timeout=30)
        assert reload is not None and reload.outcome == "applied", reload
        assert m.maybe_save(4) is not None  # every step now
        assert m.retention == Retention(keep_last=3)
        generation = watcher.generation
        invalid = policy.with_suffix(".tmp")
        invalid.write_text("durable: {every_steps: -1}\n")
        invalid.rename(policy)  # invalid: the old policy stays
        reload = watcher.wait_for(generation + 1, timeout=30)
        assert reload is not None and reload.outcome == "rejected", reload
        assert reload.error is not None and "durable.every_steps" in reload.error, reload
        assert m.maybe_save(5) is not None
        m.wait(timeout=60)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("psguard-policy")]  # stopped by close()


def test_a_schedule_object_and_a_preset_are_not_watched(tmp_path: Path) -> None:
    ckpt, _, _ = make_local()
    with CheckpointManager(ckpt, str(tmp_path / "a"), policy=Schedule(durable=EverySteps(5))) as m:
        assert m._policy.watcher is None and m.retention is None
    with CheckpointManager(ckpt, str(tmp_path / "b"), policy="default") as m:
        assert m._policy.watcher is None and m.retention is not None and m.retention.keep_last == 5


def test_a_failed_write_without_an_agent_is_raised_by_wait(tmp_path: Path) -> None:

    backend = FlakyBackend(open_backend(str(tmp_path / "store")))
    store = Store(backend)
    try:
        ckpt, emb, dense = make_local()
        with CheckpointManager(ckpt, str(store.url), options=ManagerOptions(store=store)) as m:
            train_local(emb, dense, ckpt, np.random.default_rng(9))
            backend.failing = True
            h = m.save(1)
            with pytest.raises(SaveError, match="1 save"):
                m.wait(timeout=60)
            assert h.exception(timeout=1) is not None
            backend.failing = False
            m.save(2).result(timeout=60)
    finally:
        store.close()


# --------------------------------------------------------------------------------------------- a real agent
TRAINER = """
import json, sys, time
import numpy as np
import tensorflow as tf
import psguard

store_url, out = sys.argv[1], sys.argv[2]
rows = int(sys.argv[3])
emb = tf.Variable(np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32))
ckpt = tf.train.Checkpoint(emb=emb)
m = psguard.CheckpointManager(ckpt, store_url)
emb.assign_add(tf.ones_like(emb))
t0 = time.monotonic()
m.save(1)
m.wait()
waited = time.monotonic() - t0
latest = psguard.Store.open(store_url).latest()  # the moment wait() returned
m.close()
json.dump({"latest_step": latest.step if latest else None, "waited": waited}, open(out, "w"))
"""


@pytest.mark.slow
def test_a_trainer_under_a_real_agent_finds_its_save_committed_when_wait_returns(tmp_path: Path) -> None:
    """The check of the layout issue: a few hundred MB, a real ``psguard agent --role chief --store DIR``."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    store, out = tmp_path / "store", tmp_path / "out.json"
    rows = 1_000_000  # 1M x 64 float32: 256 MB
    argv = lone_chief_agent(tmp_path, store, [sys.executable, str(script), str(store), str(out), str(rows)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["latest_step"] == 1, result


@pytest.mark.slow
def test_a_restore_holding_the_memory_tier_does_not_wait_for_a_store_that_is_down(
    tmp_path: Path, seaweed: object, unique: str
) -> None:
    from psguard.chaos.http_faults import HttpErrorProxy
    from psguard.trainer.variables import bitwise_equal

    with HttpErrorProxy(seaweed.endpoint_url) as proxy:  # type: ignore[attr-defined]
        options = {**seaweed.storage_options, "endpoint_url": proxy.endpoint_url}  # type: ignore[attr-defined]
        store = Store.open(seaweed.url(unique), options)  # type: ignore[attr-defined]
        agent = Agent(tmp_path / "spool", store)
        try:
            ckpt, emb, dense = make_local()
            rng = np.random.default_rng(10)
            with CheckpointManager(
                ckpt, str(store.url), options=ManagerOptions(spool=tmp_path / "spool", store=store)
            ) as m:
                train_local(emb, dense, ckpt, rng)
                m.save(1).result(timeout=60)
                train_local(emb, dense, ckpt, rng)
                m.save(2, tiers=frozenset({Tier.MEMORY})).result(timeout=60)
                want = snapshot(ckpt)
            proxy.fail_next(1_000_000, status=503, code="ServiceUnavailable")  # the store is down from here
            fresh, _, _ = make_local(seed=3)
            with CheckpointManager(
                fresh, str(store.url), options=ManagerOptions(spool=tmp_path / "spool", store=store)
            ) as m2:
                t0 = time.monotonic()
                restored = m2.restore_or_initialize()
                took = time.monotonic() - t0
                assert restored is not None and restored.startswith("memory:"), restored
                assert took < 30, f"the restore waited {took:.1f}s for a store that was down"
                got = snapshot(fresh)
                assert all(bitwise_equal(want[n], got[n]) for n in want)
                proxy.heal()
        finally:
            proxy.heal()
            agent.stop()
            store.close()
