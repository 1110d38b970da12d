"""The persister: full base, deltas, new bases, coalescing behind a slow store, failures, a SIGKILL mid-save."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.persister import Persister, PersistEvent, resume
from psguard.errors import SaveError, StorageUnavailableError
from psguard.handoff.contract import TOKEN_KEY
from psguard.policy.engine import ChainLimit
from psguard.storage.base import Buffer
from psguard.storage.local import LocalBackend
from psguard.storage.memory import MemoryBackend, drop
from psguard.store import Store
from psguard.store.manifest import manifest_key
from psguard.tensors import Full, Rows, Same, TensorUpdate
from tests.support.paths import ROOT


# ----------------------------------------------------------------------------------------------- a model
def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((2000, 16)).astype(np.float32)
    emb.view(np.uint32)[0, 0] = 0x7FC00123  # NaN payload
    emb[0, 1] = -0.0
    return {
        "emb": emb,
        "emb/m": rng.standard_normal((2000, 16)).astype(ml_dtypes.bfloat16),
        "dense": rng.standard_normal((8, 8)),
        "step": np.array(0, dtype=np.int64),
        "vocab": np.array([b"a", b"bc"], dtype=object),
    }


def advance(truth: dict[str, np.ndarray], k: int) -> dict[str, TensorUpdate]:
    """Step ``k`` of training: some rows change, dense changes; returns the delta capture (in place)."""
    rng = np.random.default_rng(1000 + k)
    out: dict[str, TensorUpdate] = {}
    for name in ("emb", "emb/m"):
        ids = np.unique(rng.integers(0, 2000, 25)).astype(np.int64)
        t = truth[name]
        t[ids] = (rng.standard_normal((ids.size, 16))).astype(t.dtype)
        out[name] = Rows(ids, t[ids].copy(), t.shape)
    truth["dense"] = truth["dense"] + 1
    out["dense"] = Full(truth["dense"].copy())
    truth["step"] = np.array(k, dtype=np.int64)
    out["step"] = Full(truth["step"].copy())
    out["vocab"] = Same(truth["vocab"].shape, truth["vocab"].dtype)
    return out


def truth_at(k: int) -> dict[str, np.ndarray]:
    truth = initial()
    for j in range(2, k + 1):
        advance(truth, j)
    return truth


def whole(truth: dict[str, np.ndarray]) -> dict[str, TensorUpdate]:
    return {n: Full(v.copy()) for n, v in truth.items()}


def bits(a: np.ndarray) -> bytes:
    if a.dtype == object:
        return repr([bytes(x) for x in a.reshape(-1)]).encode() + str(a.shape).encode()
    return np.ascontiguousarray(a).tobytes() + str(a.shape).encode() + a.dtype.name.encode()


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert bits(got[name]) == bits(want[name]), name


# ----------------------------------------------------------------------------------------------- a store we control
class GatedBackend(MemoryBackend):
    """Commits (manifest writes) wait on ``gate`` and can be made to fail: a slow or broken store."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_commits = 0
        self.gated = ("manifests/",)  # the writes that wait on the gate (a gc's lease: "locks/gc.json")

    def put_new(self, key: str, data: Buffer) -> None:
        if key.startswith("manifests/") and self.fail_commits > 0:
            self.fail_commits -= 1
            raise StorageUnavailableError(f"injected outage writing {key}")
        if key.startswith(self.gated):
            self.entered.set()
            self.gate.wait()
        super().put_new(key, data)


@pytest.fixture
def backend(unique: str) -> Iterator[GatedBackend]:
    b = GatedBackend(f"memory://{unique}")
    yield b
    b.gate.set()
    drop(unique)


@pytest.fixture
def store(backend: GatedBackend) -> Iterator[Store]:
    s = Store(backend, chunk_bytes=16 << 10, io_threads=2)
    yield s
    s.close()


def check_restores(store: Store, info_id: str, want: dict[str, np.ndarray]) -> None:
    assert_same(store.load(info_id, verify_hash=True), want)


# ----------------------------------------------------------------------------------------------- tests
def test_full_then_deltas_then_new_base_restore_bit_for_bit(store: Store) -> None:
    tier = MemoryTier()
    events: list[PersistEvent] = []
    truth = initial()
    tier.apply(whole(truth), step=1, token="g-1", parent=None, metadata={"pos": 1})
    kinds = []
    with Persister(store, tier, max_chain=2, max_delta_percent=None, on_event=events.append) as p:
        for k in range(1, 7):
            if k > 1:
                assert tier.apply(
                    advance(truth, k), step=k, token=f"g-{k}", parent=f"g-{k - 1}", metadata={"pos": k}
                ).ok
            info = p.request(k).result(timeout=30)
            assert info is not None and info.step == k
            kinds.append(info.kind)
            assert info.metadata == {"pos": k, TOKEN_KEY: f"g-{k}"}
            check_restores(store, info.id, truth)
            st = p.status()
            assert st.last_id == info.id and st.lag_steps == 0 and st.last_error is None
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta"]
    chain = store.chain(store.resolve())
    assert [m.step for m in chain] == [4, 5, 6]
    assert [e.kind for e in events] == ["committed"] * 6
    assert events[1].encoding == "delta" and 0 < events[1].payload_bytes < 10_000
    assert events[3].encoding == "full"
    # the new base was written from memory with dedup: unchanged chunks of the tables were not uploaded again
    base = next(i for i in store.checkpoints() if i.step == 4)
    assert base.stored_bytes < base.logical_bytes


def test_new_base_when_deltas_reach_a_share_of_the_base(store: Store) -> None:
    tier = MemoryTier()
    truth = initial()
    tier.apply(whole(truth), step=1, token="g-1", parent=None)
    policy = ChainLimit(max_delta_percent=3.0)  # a delta here is ~1.7 % of the base
    kinds = []
    with Persister(store, tier, base_policy=policy) as p:
        for k in range(1, 6):
            if k > 1:
                tier.apply(advance(truth, k), step=k, token=f"g-{k}", parent=f"g-{k - 1}")
            info = p.request(k).result(timeout=30)
            assert info is not None
            kinds.append(info.kind)
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    check_restores(store, store.resolve(), truth)


def test_requests_coalesce_behind_a_slow_store(store: Store, backend: GatedBackend) -> None:
    tier = MemoryTier()
    truth = initial()
    tier.apply(whole(truth), step=1, token="g-1", parent=None)
    events: list[PersistEvent] = []
    with Persister(store, tier, on_event=events.append) as p:
        backend.gate.clear()
        try:
            first = p.request(1)
            assert backend.entered.wait(30)  # the first save is committing, held by the store
            handles = []
            for k in range(2, 8):
                tier.apply(advance(truth, k), step=k, token=f"g-{k}", parent=f"g-{k - 1}")
                handles.append(p.request(k))
            assert all(h is handles[0] for h in handles)  # one pending batch, no copies queued
            st = p.status()
            assert st.pending_requests == 6 and st.in_flight and st.last_step is None and st.lag_steps == 7
            assert not first.done()
        finally:
            backend.gate.set()
        one = first.result(timeout=30)
        two = handles[0].result(timeout=30)
    assert one is not None and two is not None
    assert (one.step, two.step) == (1, 7) and two.parent == one.id
    assert len(store.checkpoint_ids()) == 2
    assert events[-1].coalesced == 6 and p.status().lag_steps == 0
    check_restores(store, two.id, truth)


def test_failed_save_is_retried_with_nothing_lost(store: Store, backend: GatedBackend) -> None:
    tier = MemoryTier()
    truth = initial()
    tier.apply(whole(truth), step=1, token="g-1", parent=None)
    events: list[PersistEvent] = []
    with Persister(store, tier, retry_after=None, on_event=events.append) as p:
        base = p.request(1).result(timeout=30)
        assert base is not None
        tier.apply(advance(truth, 2), step=2, token="g-2", parent="g-1")
        backend.fail_commits = 1
        with pytest.raises(StorageUnavailableError, match="injected"):
            p.request(2).result(timeout=30)
        st = p.status()
        assert st.last_error is not None and "injected" in st.last_error and st.consecutive_failures == 1
        assert st.last_id == base.id and st.lag_steps == 1
        assert events[-1].kind == "failed"
        tier.apply(advance(truth, 3), step=3, token="g-3", parent="g-2")
        info = p.request(3).result(timeout=30)
    assert info is not None and info.kind == "delta" and info.parent == base.id
    check_restores(store, info.id, truth)  # step 2's rows, lost with the failed save, are in step 3's delta
    assert p.status().consecutive_failures == 0


def test_retries_by_itself_after_a_failure(store: Store, backend: GatedBackend) -> None:
    tier = MemoryTier()
    truth = initial()
    tier.apply(whole(truth), step=1, token="g-1", parent=None)
    committed = threading.Event()

    def on_event(e: PersistEvent) -> None:
        if e.kind == "committed":
            committed.set()

    backend.fail_commits = 1
    with Persister(store, tier, retry_after=0.05, on_event=on_event) as p:
        with pytest.raises(StorageUnavailableError):
            p.request(1).result(timeout=30)
        assert committed.wait(30)  # no new request: the persister retried on its own
    assert [i.step for i in store.checkpoints()] == [1]


def test_explicit_base_skip_when_unchanged_and_gc_of_the_parent(store: Store) -> None:
    tier = MemoryTier()
    truth = initial()
    tier.apply(whole(truth), step=1, token="g-1", parent=None)
    with Persister(store, tier) as p:
        a = p.request(1).result(timeout=30)
        b = p.request(1).result(timeout=30)  # nothing new: no checkpoint written
        assert a is not None and b is not None and a.id == b.id and len(store.checkpoint_ids()) == 1
        tier.apply(advance(truth, 2), step=2, token="g-2", parent="g-1")
        c = p.request(2, new_base=True).result(timeout=30)
        assert c is not None and c.kind == "full"
        # someone deletes the checkpoint the chain builds on: the persister notices and writes a base
        store.backend.delete(manifest_key(c.id))
        tier.apply(advance(truth, 3), step=3, token="g-3", parent="g-2")
        with pytest.raises(SaveError):
            p.request(3).result(timeout=30)
        d = p.request(3).result(timeout=30)
    assert d is not None and d.kind == "full"
    check_restores(store, d.id, truth)


def test_stop_drains_or_abandons(store: Store, backend: GatedBackend) -> None:
    tier = MemoryTier()
    truth = initial()
    tier.apply(whole(truth), step=1, token="g-1", parent=None)
    p = Persister(store, tier).start()
    backend.gate.clear()
    try:
        first = p.request(1)
        assert backend.entered.wait(30)
        tier.apply(advance(truth, 2), step=2, token="g-2", parent="g-1")
        second = p.request(2)
        assert p.stop(drain=False, timeout=0) is False  # a save is in flight: it is not interrupted
    finally:
        backend.gate.set()
    assert p.stop(drain=False, timeout=30)
    assert first.result(timeout=1) is not None  # the save in flight was not interrupted
    with pytest.raises(SaveError, match="abandoned"):
        second.result(timeout=1)
    with pytest.raises(Exception, match="stopped"):
        p.request(3)
    q = Persister(store, tier, last=first.result()).start()
    h = q.request(2)
    assert q.stop(drain=True)
    info = h.result(timeout=1)
    assert info is not None and info.step == 2


def test_resume_seeds_the_tier_and_continues_the_chain(store: Store) -> None:
    tier = MemoryTier()
    truth = initial()
    tier.apply(whole(truth), step=1, token="g-1", parent=None, metadata={"pos": 1})
    with Persister(store, tier) as p:
        p.request(1).result(timeout=30)
        tier.apply(advance(truth, 2), step=2, token="g-2", parent="g-1", metadata={"pos": 2})
        last = p.request(2).result(timeout=30)
    successor = MemoryTier()
    info = resume(store, successor)
    assert info is not None and last is not None and info.id == last.id
    with successor.export() as snap:
        assert snap.step == 2 and snap.token == "g-2" and snap.metadata == {"pos": 2}
        assert_same(dict(snap.tensors), truth)
    assert successor.apply(advance(truth, 3), step=3, token="g-3", parent="g-2").ok  # the trainer's chain holds
    with Persister(store, successor, last=info) as p2:
        nxt = p2.request(3).result(timeout=30)
    assert nxt is not None and nxt.kind == "delta" and nxt.parent == info.id and nxt.chain_length == 2
    check_restores(store, nxt.id, truth)
    assert resume(Store(MemoryBackend("memory://empty-" + os.urandom(4).hex())), MemoryTier()) is None


# ----------------------------------------------------------------------------------------------- SIGKILL mid-save
class ParkAtThirdCommit(LocalBackend):
    """Parks the process (until killed) just before the third checkpoint's manifest is written."""

    commits = 0

    def put_new(self, key: str, data: Buffer) -> None:
        if key.startswith("manifests/"):
            self.commits += 1
            if self.commits == 3:
                print("ready", flush=True)
                sys.stdin.read()
                raise SystemExit("stdin closed before the kill")
        super().put_new(key, data)


def child(folder: str) -> None:
    store = Store(ParkAtThirdCommit(folder, {"fsync": False}), chunk_bytes=16 << 10, io_threads=2)
    tier = MemoryTier()
    truth = initial()
    tier.apply(whole(truth), step=1, token="c-1", parent=None, metadata={"pos": 1})
    with Persister(store, tier, max_chain=8) as p:
        p.request(1).result()
        for k in (2, 3):
            tier.apply(advance(truth, k), step=k, token=f"c-{k}", parent=f"c-{k - 1}", metadata={"pos": k})
            p.request(k).result()
    raise SystemExit("unreachable: the third save parks")


@pytest.mark.slow
def test_agent_killed_mid_persist_leaves_no_torn_checkpoint_and_a_successor_continues(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.unit.agent.tiers.test_persister", "child", str(folder)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()  # parked inside the third save: no sleeping
    assert line.strip() == "ready", f"child did not reach the third commit: {line!r}, exit {proc.poll()}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdin.close()
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL

    with Store.open(str(folder)) as store:
        infos = store.checkpoints()
        assert [i.step for i in infos] == [1, 2]  # the killed save is simply absent
        assert all(store.verify(i.id).ok for i in infos)
        tier = MemoryTier()
        last = resume(store, tier)
        assert last is not None and last.step == 2 and tier.token == "c-2"
        truth = truth_at(2)
        with tier.export() as snap:
            assert_same(dict(snap.tensors), truth)
            assert snap.metadata == {"pos": 2}
        # the trainer's next delta names the state the dead agent had reached in memory (c-3): refused ...
        advance(truth, 3)
        four_delta = advance(truth, 4)
        assert tier.apply(four_delta, step=4, token="c-4", parent="c-3").status == "need_full"
        # ... so it sends step 4 whole; over the same layout it still goes to the log as a delta of changed rows
        assert tier.apply(whole(truth), step=4, token="d-4", parent=None, metadata={"pos": 4}).ok
        with Persister(store, tier, last=last) as p:
            four = p.request(4).result(timeout=30)
            assert four is not None and four.kind == "delta" and four.parent == last.id
            tier.apply(advance(truth, 5), step=5, token="d-5", parent="d-4", metadata={"pos": 5})
            five = p.request(5).result(timeout=30)
        assert five is not None
        check_restores(store, four.id, truth_at(4))
        check_restores(store, five.id, truth)
        assert store.load_latest().info.id == five.id
        # gc removes what the killed save left (its chunks, its writer lock)
        report = store.gc(keep_last=10)
        assert not report.chunks_deferred and store.backend.leftovers() == []
        assert json.loads(store.backend.get(manifest_key(five.id)))["body"]["parent"] == four.id


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(sys.argv[2])


def test_retention_asked_by_the_trainer_is_applied_after_each_commit(store: Store) -> None:
    """A CheckpointManager under an agent puts its max_to_keep into the capture; the agent's writer obeys it."""
    from psguard.handoff.contract import RETENTION_KEY

    tier = MemoryTier()
    truth = initial()
    keep = {RETENTION_KEY: {"keep_last": 2, "keep_every_hours": None}}
    bad = {RETENTION_KEY: {"keep_last": 0}}
    tier.apply(whole(truth), step=1, token="g-1", parent=None, metadata=keep)
    kept = []
    with Persister(store, tier, max_chain=2, max_delta_percent=None) as p:
        for k in range(1, 7):
            if k > 1:
                meta = keep if k < 6 else bad
                assert tier.apply(advance(truth, k), step=k, token=f"g-{k}", parent=f"g-{k - 1}", metadata=meta).ok
            assert p.request(k).result(timeout=30) is not None
            assert p.wait_idle(30)  # the retention runs after the commit's acknowledgment
            kept.append(sorted(i.step for i in store.checkpoints()))
    # bases at 1 and 4 (max_chain 2): keep_last=2 keeps the newest two and the chains they are built on;
    # the malformed request at step 6 is ignored (a warning), never applied half-way
    assert kept == [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [4, 5], [4, 5, 6]], kept
    check_restores(store, store.resolve(), truth)


def test_the_durable_lag_runs_from_the_saves_due_until_a_commit_covers_them(
    store: Store, backend: GatedBackend
) -> None:
    tier = MemoryTier()
    truth = initial()
    tier.apply(whole(truth), step=1, token="g-1", parent=None)
    with Persister(store, tier) as p:
        assert (p.status().durable_lag_steps, p.status().durable_lag_seconds) == (0, 0.0)  # nothing due
        backend.gate.clear()
        try:
            first = p.request(1)
            assert backend.entered.wait(30)
            for k in range(2, 6):
                tier.apply(advance(truth, k), step=k, token=f"g-{k}", parent=f"g-{k - 1}")
            later = p.request(5)
            st = p.status()
            assert st.durable_lag_steps == 5 and st.durable_lag_seconds > 0  # nothing committed: all 5 at stake
        finally:
            backend.gate.set()
        assert first.result(timeout=30) is not None and later.result(timeout=30) is not None
        assert (p.status().durable_lag_steps, p.status().durable_lag_seconds) == (0, 0.0)


def test_the_first_capture_starts_the_logs_first_base_once(store: Store, backend: GatedBackend) -> None:
    tier = MemoryTier()
    truth = initial()
    tier.apply(whole(truth), step=1, token="g-1", parent=None)
    committed = threading.Event()
    with Persister(store, tier, on_event=lambda e: committed.set() if e.kind == "committed" else None) as p:
        backend.gate.clear()
        try:
            assert p.start_first_base()
            assert backend.entered.wait(30)
            assert not p.start_first_base()  # one on its way already
            assert p.status().durable_lag_steps == 0  # nobody asked for a durable save: no lag
        finally:
            backend.gate.set()
        assert committed.wait(30)
        assert p.status().last_step == 1 and not p.start_first_base()  # the log has its base
    check_restores(store, store.checkpoint_ids()[-1], truth)


def test_the_same_failure_again_and_again_is_one_warning_not_one_per_attempt(
    store: Store, backend: GatedBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A lost PS node's agent holds no state until the recovery rebuilds it, and every capture meanwhile retries
    the persist: the log says so once, then counts, instead of a line per attempt."""
    tier = MemoryTier()
    tier.apply(whole(initial()), step=1, token="g-1", parent=None)
    caplog.set_level(logging.DEBUG, logger="psguard.agent.tiers.persister")
    with Persister(store, tier, retry_after=None) as p:
        backend.fail_commits = 5
        for _ in range(5):
            with pytest.raises(StorageUnavailableError):
                p.request(1).result(timeout=30)
        lines = [r for r in caplog.records if "event=persist_failed" in r.getMessage()]
        assert [r.levelno for r in lines] == [logging.WARNING] + [logging.DEBUG] * 4
        assert p.status().consecutive_failures == 5
        assert p.request(1).result(timeout=30) is not None


def test_the_status_says_what_the_write_in_flight_is(store: Store, backend: GatedBackend) -> None:
    """The chaos harness aims faults at a first base, a new base over a chain (the agent's compaction: it rewrites
    the base from memory), a delta and the retention's gc; ``phase`` is how it sees which one is in flight."""
    from psguard.handoff.contract import RETENTION_KEY

    tier = MemoryTier()
    truth = initial()
    keep = {RETENTION_KEY: {"keep_last": 1, "keep_every_hours": None}}
    tier.apply(whole(truth), step=1, token="g-1", parent=None, metadata=keep)
    phases = []
    with Persister(store, tier, max_chain=1, max_delta_percent=None) as p:
        assert p.status().phase is None
        for k in range(1, 5):
            if k > 1:
                assert tier.apply(advance(truth, k), step=k, token=f"g-{k}", parent=f"g-{k - 1}", metadata=keep).ok
            backend.gated = ("locks/gc.json",) if k == 4 else ("manifests/",)
            backend.entered.clear()
            backend.gate.clear()
            try:
                handle = p.request(k)
                assert backend.entered.wait(30)
                st = p.status()
                phases.append(st.phase)
                assert st.in_flight
                if k == 4:  # the commit is acknowledged while its retention still waits: a held trainer goes on
                    assert handle.result(timeout=30) is not None and p.status().in_flight
            finally:
                backend.gate.set()
            assert handle.result(timeout=30) is not None
            assert p.wait_idle(30)  # this step's retention too, before the next gates another write
        assert p.status().phase is None and not p.status().in_flight
    # 1: the log's first base; 2: a delta over it; 3: a new base (max_chain 1); 4: its delta's commit is done and
    # the retention's gc (keep_last 1) holds its lease
    assert phases == ["first-base", "delta", "base", "retention"]
