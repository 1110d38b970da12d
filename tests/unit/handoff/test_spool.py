"""The trainer -> agent hand-off: bit-identical round trips, damage detected, either side killed at any point."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import psguard.handoff.spool as spool_mod
import psguard.trainer.spool_writer as spool_writer_mod
from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.persister import Persister, resume
from psguard.agent.tiers.spool_server import SpoolEvent, SpoolServer
from psguard.errors import ConfigError, CorruptCheckpointError, NoCheckpointError, PsguardError, SaveError, StorageError
from psguard.handoff.contract import Tier
from psguard.handoff.parts import ShardFiles, ShardKey
from psguard.handoff.spool import Capture, NeedFullCaptureError, default_spool_dir, read_capture
from psguard.store import Store
from psguard.tensors import Full, Rows, Same, TensorUpdate
from psguard.trainer.spool_writer import SpoolWriter
from tests.support.fifos import Fifos
from tests.support.paths import ROOT
from tests.support.tensors import every_dtype

DURABLE = frozenset({Tier.MEMORY, Tier.DURABLE})


@pytest.fixture
def spool() -> Iterator[Path]:
    """A spool folder on tmpfs, as in production (``/dev/shm``), removed afterwards."""
    path = default_spool_dir(f"test-{uuid.uuid4().hex[:12]}")
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def bits(a: np.ndarray) -> bytes:
    if a.dtype == object:
        return repr([bytes(x) for x in a.reshape(-1)]).encode() + str(a.shape).encode()
    return np.ascontiguousarray(a).tobytes() + str(a.shape).encode() + a.dtype.name.encode()


def assert_same(got: Any, want: dict[str, np.ndarray]) -> None:
    got = dict(got)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert bits(got[name]) == bits(want[name]), name


def whole(tensors: dict[str, np.ndarray]) -> dict[str, TensorUpdate]:
    return {n: Full(v) for n, v in tensors.items()}


def advance(truth: dict[str, np.ndarray], k: int) -> dict[str, TensorUpdate]:
    """Training step ``k`` on ``truth`` (in place); returns its delta capture."""
    rng = np.random.default_rng(100 + k)
    out: dict[str, TensorUpdate] = {n: Same(v.shape, v.dtype) for n, v in truth.items()}
    for name in ("f32", "bf16"):
        ids = np.unique(rng.integers(0, truth[name].shape[0], 6)).astype(np.int64)
        truth[name][ids] = rng.standard_normal((ids.size, truth[name].shape[1])).astype(truth[name].dtype)
        out[name] = Rows(ids, truth[name][ids].copy(), truth[name].shape)
    truth["scalar"] = np.array(k, np.int64)
    out["scalar"] = Full(truth["scalar"].copy())
    ids = np.array([1], np.int64)
    truth["strings"][1, 0] = f"step {k}".encode()
    out["strings"] = Rows(ids, truth["strings"][ids].copy(), truth["strings"].shape)
    return out


def server(spool: Path, tier: MemoryTier | None = None, **kwargs: Any) -> SpoolServer:
    return SpoolServer(spool, tier or MemoryTier(), **kwargs).start(watch=False)


# ----------------------------------------------------------------------------------------------- round trips
def test_round_trip_is_bit_identical_for_every_dtype(spool: Path) -> None:
    truth = every_dtype()
    events: list[SpoolEvent] = []
    with SpoolWriter(spool) as w:
        srv = server(spool, on_event=events.append)
        try:
            h = w.submit(Capture(1, whole(truth), {"data": {"epoch": 0, "offset": 10}}))
            assert srv.process_once() == 1
            ack = h.result(timeout=5)
            assert (ack.status, ack.memory_step, ack.token) == ("ok", 1, h.token)
            for k in range(2, 5):
                h = w.submit(Capture(k, advance(truth, k), {"data": {"epoch": 0, "offset": 10 * k}}))
                srv.process_once()
                assert h.result(timeout=5).memory_step == k
            restore = w.request_restore()
            srv.process_once()
            got = restore.result(timeout=5)
        finally:
            srv.stop()
    assert (got.step, got.metadata, got.token) == (4, {"data": {"epoch": 0, "offset": 40}}, h.token)
    assert_same(got.tensors, truth)
    assert not restore.folder.exists()  # the trainer deletes what it read
    assert [e.status for e in events] == ["ok"] * 4 + ["ok"] and events[-1].kind == "restore"
    assert all(not list((spool / d).iterdir()) for d in ("incoming", "acks", "requests", "restore"))


def test_capture_files_read_back_exactly(spool: Path) -> None:
    truth = every_dtype()
    cap = advance({n: v.copy() for n, v in truth.items()}, 2)
    with SpoolWriter(spool) as w:
        w.parent = "x-1"
        h = w.submit(Capture(2, cap, {"p": 1}, tiers=DURABLE))
        got = read_capture(spool / "incoming" / f"{h.seq:012d}")
    assert (got.step, got.parent, got.token, got.tiers, got.metadata) == (2, "x-1", h.token, DURABLE, {"p": 1})
    for name, u in cap.items():
        g = got.tensors[name]
        assert type(g) is type(u), name
        if isinstance(u, Rows):
            assert isinstance(g, Rows)
            assert g.ids.tolist() == u.ids.tolist() and bits(g.values) == bits(u.values) and g.shape == u.shape
        elif isinstance(u, Full):
            assert isinstance(g, Full) and bits(g.value) == bits(u.value)
        else:
            assert isinstance(g, Same) and (g.shape, np.dtype(g.dtype)) == (u.shape, np.dtype(u.dtype))


def test_watchdog_wakes_the_agent_and_the_startup_scan_finds_earlier_captures(spool: Path) -> None:
    truth = every_dtype()
    with SpoolWriter(spool) as w:
        assert not w.agent_alive()
        early = w.submit(Capture(1, whole(truth)))  # no agent yet: it waits in the spool
        tier = MemoryTier()
        with SpoolServer(spool, tier, poll_interval=60.0) as srv:  # the poll is far: only events wake it
            assert w.agent_alive()
            assert early.result(timeout=10).memory_step == 1
            h = w.submit(Capture(2, advance(truth, 2)))
            assert h.result(timeout=10).memory_step == 2
            got = w.request_restore().result(timeout=10)
            assert srv.status().captures["ok"] == 2
        assert not w.agent_alive()
    assert_same(got.tensors, truth)


def without_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import watchdog...`` fail as it does where the optional dependency is not installed."""
    for name in ("watchdog", "watchdog.events", "watchdog.observers"):
        monkeypatch.setitem(sys.modules, name, None)


def test_without_watchdog_the_agent_polls_the_spool(spool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    without_watchdog(monkeypatch)
    truth = every_dtype()
    with SpoolWriter(spool) as w, SpoolServer(spool, MemoryTier(), poll_interval=60.0) as srv:
        assert srv._observer is None  # no watcher: the processing thread scans every POLL_WITHOUT_WATCHDOG
        assert w.submit(Capture(1, whole(truth))).result(timeout=10).memory_step == 1
        assert_same(w.request_restore().result(timeout=10).tensors, truth)


def test_delta_on_a_lost_state_needs_a_whole_capture(spool: Path) -> None:
    truth = every_dtype()
    tier = MemoryTier()
    with SpoolWriter(spool) as w:
        srv = server(spool, tier)
        try:
            with pytest.raises(ConfigError, match="finite"):
                w.submit(Capture(1, whole(truth), metrics={"loss": float("nan")}))
            with pytest.raises(ConfigError, match="plain JSON"):
                w.submit(Capture(1, whole(truth), metadata={"x": object()}))
            with pytest.raises(ConfigError, match="no parent state"):
                w.submit(Capture(1, advance(truth, 1)))
            w.parent = "gone-7"  # e.g. restored from a durable checkpoint this agent's tier does not hold
            h = w.submit(Capture(2, advance(truth, 2)))
            srv.process_once()
            with pytest.raises(NeedFullCaptureError, match="send a full capture") as info:
                h.result(timeout=5)
            assert info.value.ack.status == "need_full"
            assert w.parent is None  # the chain is broken: the next delta is refused at once
            with pytest.raises(ConfigError):
                w.submit(Capture(3, advance(truth, 3)))
            w.submit(Capture(3, whole(truth)))
            h = w.submit(Capture(4, advance(truth, 4)))
            srv.process_once()
            assert h.result(timeout=5).memory_step == 4
            r = w.request_restore()
            srv.process_once()
            got = r.result(timeout=5)
        finally:
            srv.stop()
        # a restarted trainer restores from the memory tier and continues its chain with deltas
        with SpoolWriter(spool, parent=got.token) as w2:
            srv = server(spool, tier)  # the same agent (a restarted one would answer need_full)
            try:
                h = w2.submit(Capture(5, advance(truth, 5)))
                assert h.seq == 3  # sequence numbers never go back, whoever writes (acks read and gone)
                srv.process_once()
                assert h.result(timeout=5).memory_step == 5
            finally:
                srv.stop()


def test_empty_memory_tier_and_one_agent_per_spool(spool: Path) -> None:
    with SpoolWriter(spool) as w:
        srv = server(spool)
        try:
            with pytest.raises(PsguardError, match="another agent"):
                SpoolServer(spool, MemoryTier(), lock_timeout=0.2).start(watch=False)
            r = w.request_restore()
            srv.process_once()
            with pytest.raises(NoCheckpointError, match="empty"):
                r.result(timeout=5)
            with pytest.raises(TimeoutError, match="an agent holds the spool"):
                w.submit(Capture(1, whole({"a": np.zeros(3)}))).result(timeout=0.05)
        finally:
            srv.stop()


# ----------------------------------------------------------------------------------------------- damage
def test_corrupt_capture_is_rejected_and_changes_nothing(spool: Path) -> None:
    truth = every_dtype()
    tier = MemoryTier()
    with SpoolWriter(spool) as w:
        first = w.submit(Capture(1, whole(truth)))
        bad = w.submit(Capture(2, advance({n: v.copy() for n, v in truth.items()}, 2)))
        folder = spool / "incoming" / f"{bad.seq:012d}"
        entry = next(e for e in json.loads((folder / "capture.json").read_bytes())["tensors"] if e["kind"] == "rows")
        path = folder / entry["values"]["file"]
        data = bytearray(path.read_bytes())
        data[3] ^= 0x01  # one bit flipped in tmpfs
        path.write_bytes(bytes(data))
        srv = server(spool, tier)
        try:
            srv.process_once()
            assert first.result(timeout=5).status == "ok"
            with pytest.raises(SaveError, match="CRC32C"):
                bad.result(timeout=5)
            assert w.parent is None
            truncated = w.submit(Capture(3, whole(truth)))
            (spool / "incoming" / f"{truncated.seq:012d}" / "0.bin").write_bytes(b"\x00")
            garbled = w.submit(Capture(4, whole(truth)))
            (spool / "incoming" / f"{garbled.seq:012d}" / "capture.json").write_bytes(b"{not json")
            srv.process_once()
            with pytest.raises(SaveError, match="has 1 bytes"):
                truncated.result(timeout=5)
            with pytest.raises(SaveError, match="not valid JSON"):
                garbled.result(timeout=5)
            assert srv.status().captures == {"ok": 1, "need_full": 0, "error": 3}
        finally:
            srv.stop()
    with tier.export() as snap:
        assert snap.step == 1 and snap.token == first.token
        assert_same(snap.tensors, truth)


def test_corrupt_restore_is_refused(spool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    truth = every_dtype()
    with SpoolWriter(spool) as w:
        srv = server(spool)
        try:
            w.submit(Capture(1, whole(truth)))
            r = w.request_restore()
            srv.process_once()
        finally:
            srv.stop()
        target = r.folder / "0.bin"
        data = bytearray(target.read_bytes())
        data[-1] ^= 0x80
        target.write_bytes(bytes(data))
        with pytest.raises(CorruptCheckpointError, match="CRC32C"):
            r.result(timeout=5)
        assert not r.folder.exists()


# ----------------------------------------------------------------------------------------------- full tmpfs
def test_disk_full_gives_a_clear_error_and_no_half_capture(spool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = spool_mod._write_blob
    calls = {"n": 0}

    def fills_up(path: Path, data: memoryview) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(spool_mod, "_write_blob", fills_up)
    truth = every_dtype()
    with SpoolWriter(spool) as w:
        with pytest.raises(StorageError, match=r"ENOSPC.*not handed off"):
            w.submit(Capture(1, whole(truth)))
        assert list((spool / "incoming").iterdir()) == []
        h = w.submit(Capture(1, whole(truth)))  # space came back: the same sequence number is used
        assert h.seq == 0


def test_a_real_full_tmpfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mount = tmp_path / "shm"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        big = {"t": np.ones((2 << 20) // 8)}  # 2 MB on a 1 MB tmpfs
        with SpoolWriter(mount / "spool") as w:
            with pytest.raises(StorageError, match="MB free"):
                w.submit(Capture(1, whole(big)))  # refused before writing anything
            monkeypatch.setattr(spool_writer_mod, "payload_bytes", lambda capture: 0)  # skip the check: hit ENOSPC
            with pytest.raises(StorageError, match="ENOSPC"):
                w.submit(Capture(1, whole(big)))
            assert list((mount / "spool" / "incoming").iterdir()) == []
            assert w.submit(Capture(1, whole({"t": np.ones(1000)}))).seq == 0
    finally:
        subprocess.run(["umount", str(mount)], check=True)


# ----------------------------------------------------------------------------------------------- double write
def test_two_threads_waiting_on_one_capture_both_get_its_answers(spool: Path, tmp_path: Path) -> None:
    """A user's thread awaits a save while the step loop's next save settles the same handle (the 5-minute
    soak: the trainer awaited durable commits off its step loop). Each answer file is read and deleted once;
    before, the thread that lost the race polled the deleted file until its timeout."""
    import threading

    with Store.open(str(tmp_path / "store")) as store:
        tier = MemoryTier()
        with Persister(store, tier) as persister, SpoolWriter(spool) as w:
            srv = server(spool, tier, persister=persister)
            try:
                h = w.submit(Capture(1, whole({"t": np.arange(12.0)}), tiers=DURABLE))
                got: dict[str, list[object]] = {"memory": [], "durable": []}
                waiting = threading.Barrier(5)

                def wait(kind: str) -> None:
                    waiting.wait()  # all four wait before the agent answers
                    try:
                        got[kind].append(h.result(10) if kind == "memory" else h.durable(10))
                    except Exception as e:  # the assertion below names it
                        got[kind].append(e)

                threads = [threading.Thread(target=wait, args=(k,)) for k in ("memory", "memory", "durable", "durable")]
                for t in threads:
                    t.start()
                waiting.wait()
                srv.process_once()
                for t in threads:
                    t.join()
            finally:
                srv.stop()
    assert all(not isinstance(a, Exception) for a in got["memory"] + got["durable"]), got
    assert got["memory"][0] is got["memory"][1] and got["durable"][0] is got["durable"][1]
    assert got["durable"][0].durable_step == 1  # type: ignore[attr-defined]


def test_durable_captures_reach_the_log_and_their_acks(spool: Path, tmp_path: Path) -> None:
    truth = every_dtype()
    with Store.open(str(tmp_path / "store")) as store:
        tier = MemoryTier()
        with Persister(store, tier) as persister, SpoolWriter(spool) as w:
            srv = server(spool, tier, persister=persister)
            try:
                h1 = w.submit(Capture(1, whole(truth), {"pos": 1}, tiers=DURABLE, metrics={"loss": 0.5}))
                srv.process_once()
                d1 = h1.durable(timeout=30)
                h2 = w.submit(Capture(2, advance(truth, 2), {"pos": 2}))
                h3 = w.submit(Capture(3, advance(truth, 3), {"pos": 3}, tiers=frozenset({Tier.BASE})))
                srv.process_once()
                d3 = h3.durable(timeout=30)
                assert [h.result(timeout=5).memory_step for h in (h1, h2, h3)] == [1, 2, 3]
                with pytest.raises(ConfigError):
                    h2.durable(timeout=1)
                r = w.request_restore()
                srv.process_once()
                got = r.result(timeout=5)
            finally:
                srv.stop()
        assert d3.durable_step == 3 and d3.checkpoint is not None
        assert store.manifest(d3.checkpoint).kind == "full"  # BASE asked for a new full base
        assert d1.checkpoint is not None and store.manifest(d1.checkpoint).step == 1
        assert store.manifest(d1.checkpoint).metrics == {"loss": 0.5}  # for keep-best retention
        assert (got.durable_id, got.durable_step) == (d3.checkpoint, 3)
        assert_same(store.load(d3.checkpoint), truth)
        assert_same(got.tensors, truth)
    assert list((spool / "acks").iterdir()) == []


def test_a_successor_settles_durable_saves_its_predecessor_left_pending(spool: Path) -> None:
    with SpoolWriter(spool) as w:
        h = w.submit(Capture(1, whole({"a": np.zeros(4)}), tiers=DURABLE))
        # as if an agent applied and acknowledged it, then died before the log committed it
        (spool / "acks" / f"{h.seq:012d}.pending.json").write_text("{}")
        (spool / "acks" / f"{h.seq:012d}.json").write_text(
            json.dumps({"status": "ok", "memory_step": 1, "token": h.token, "message": ""})
        )
        srv = server(spool)
        try:
            srv.process_once()
            assert h.result(timeout=5).status == "ok"
            with pytest.raises(SaveError, match="restarted before"):
                h.durable(timeout=5)
            assert list((spool / "incoming").iterdir()) == []  # answered before: deleted, not applied again
            assert srv.tier.empty
        finally:
            srv.stop()


# ----------------------------------------------------------------------------------------------- killed processes
def start_child(*args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.unit.handoff.test_spool", *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc


def expect(proc: subprocess.Popen[str], word: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == word, f"child said {line!r}, expected {word!r} (exit {proc.poll()})"


def kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    for f in (proc.stdin, proc.stdout):
        if f:
            f.close()


def park() -> None:
    print("ready", flush=True)
    sys.stdin.read()  # killed here
    raise SystemExit("stdin closed before the kill")


def child_agent(root: str, store_url: str, park_step: int) -> None:
    """An agent (memory tier + persister + spool server) that parks when it is about to apply ``park_step``."""
    tier = MemoryTier()
    real_apply = tier.apply

    def apply(updates: Any, **kw: Any) -> Any:
        if kw["step"] == park_step:
            park()
        return real_apply(updates, **kw)

    tier.apply = apply  # type: ignore[method-assign]
    store = Store.open(store_url)
    persister = Persister(store, tier, last=resume(store, tier)).start()
    srv = SpoolServer(root, tier, persister, poll_interval=0.05).start()
    print("started", flush=True)
    sys.stdin.read()
    srv.stop()
    persister.stop()


def child_writer(root: str) -> None:
    """A trainer that parks halfway through writing a capture's files."""
    real = spool_mod._write_blob
    n = {"files": 0}

    def write_then_park(path: Path, data: memoryview) -> int:
        n["files"] += 1
        if n["files"] == 2:
            park()
        return real(path, data)

    spool_mod._write_blob = write_then_park  # type: ignore[assignment]
    w = SpoolWriter(root)
    w.submit(Capture(1, whole(every_dtype())))


@pytest.mark.slow
def test_killed_agent_leaves_captures_its_successor_applies_in_order(spool: Path, tmp_path: Path) -> None:
    store_url = str(tmp_path / "store")
    agent = start_child("agent", str(spool), store_url, "3")
    try:
        expect(agent, "started")
        truth = every_dtype()
        with SpoolWriter(spool) as w:
            w.submit(Capture(1, whole(truth), tiers=DURABLE)).durable(timeout=60)
            h2 = w.submit(Capture(2, advance(truth, 2), {"pos": 2}, tiers=DURABLE))
            h2.durable(timeout=60)
            left = [w.submit(Capture(3, advance(truth, 3), {"pos": 3}, tiers=DURABLE))]
            expect(agent, "ready")  # the agent is inside step 3's apply
            left += [w.submit(Capture(k, advance(truth, k), {"pos": k})) for k in (4, 5)]
            left.append(w.submit(Capture(6, advance(truth, 6), {"pos": 6}, tiers=DURABLE)))
            kill(agent)
            assert all(not h.done() for h in left)

            # the successor: its tier resumes from the durable log (step 2), then the spool holds steps 3..6
            with Store.open(store_url) as store:
                tier = MemoryTier()
                last = resume(store, tier)
                assert last is not None and last.step == 2 and tier.token == h2.token
                events: list[SpoolEvent] = []
                with Persister(store, tier, last=last) as persister:
                    srv = server(spool, tier, persister=persister, on_event=events.append)
                    try:
                        assert srv.process_once() == 4
                    finally:
                        srv.stop()
                    assert [e.seq for e in events] == [h.seq for h in left]  # in order
                    assert [h.result(timeout=5).memory_step for h in left] == [3, 4, 5, 6]
                    d6 = left[-1].durable(timeout=60)
                    assert 3 <= (left[0].durable(timeout=60).durable_step or 0) <= 6  # coalesced or not
                assert d6.checkpoint is not None
                assert_same(store.load(d6.checkpoint), truth)
            with tier.export() as snap:
                assert_same(snap.tensors, truth)
                assert snap.metadata == {"pos": 6}
    finally:
        if agent.poll() is None:
            kill(agent)


@pytest.mark.slow
def test_killed_trainer_leaves_a_tmp_folder_the_agent_ignores_and_cleans(spool: Path) -> None:
    writer = start_child("writer", str(spool))
    try:
        expect(writer, "ready")
        (tmp,) = (spool / "incoming").iterdir()
        assert ".tmp-" in tmp.name
        with SpoolWriter(spool) as live:
            mine = spool / "incoming" / f"{10**6}.tmp-{live.generation}"
            mine.mkdir()  # a live writer's folder in progress must survive the agent's cleaning
            srv = server(spool)
            try:
                srv.process_once()  # the killed writer still holds its lock: nothing removed, nothing applied
                assert tmp.exists() and srv.tier.empty
                kill(writer)
                srv.process_once()
                assert not tmp.exists() and mine.exists() and srv.tier.empty
                assert list((spool / "acks").iterdir()) == []
                assert [p.name for p in (spool / "writers").iterdir()] == [f"{live.generation}.lock"]
            finally:
                srv.stop()
            live.close()
            srv = server(spool)
            try:
                srv.process_once()
                assert not mine.exists()
            finally:
                srv.stop()
    finally:
        if writer.poll() is None:
            kill(writer)


def test_answers_nobody_will_read_are_pruned(spool: Path) -> None:
    w = SpoolWriter(spool)
    srv = server(spool, ack_ttl=0.0)
    try:
        w.submit(Capture(1, whole({"a": np.zeros(4)})))
        r = w.request_restore()
        srv.process_once()
        assert list((spool / "acks").iterdir()) == []  # older than ack_ttl: pruned
        assert r.folder.is_dir()  # its trainer is alive and may still read it
        w.close()  # the trainer is gone without reading
        srv.process_once()
        assert not r.folder.exists()
    finally:
        srv.stop()
        w.close()


def child_submitter(root: str, count: int) -> None:
    """A trainer that opens its writer, says "ready", waits for "go", then submits ``count`` whole captures as
    fast as it can and prints one JSON line per capture: its seq, token and what its handle reported."""
    w = SpoolWriter(root)
    print("ready", flush=True)
    sys.stdin.readline()
    handles = [w.submit(Capture(k, {"v": Full(np.full(64, k, np.float32))})) for k in range(count)]
    for h in handles:
        try:
            status = h.result(timeout=120).status
        except SaveError as e:
            status = f"error: {e}"
        print(json.dumps({"seq": h.seq, "token": h.token, "status": status}), flush=True)
    print("done", flush=True)
    w.close()


@pytest.mark.slow
def test_two_writers_in_two_processes_never_share_a_seq_and_every_ok_was_applied_once(spool: Path) -> None:
    """An orphaned trainer and its replacement on one spool, both opened before either submits (so both
    start from the same spool state), then submitting concurrently against a watching agent."""
    applied: list[str] = []
    tier = MemoryTier()
    real_apply = tier.apply

    def recording_apply(updates: Any, **kw: Any) -> Any:
        result = real_apply(updates, **kw)
        applied.append(kw["token"])
        return result

    tier.apply = recording_apply  # type: ignore[method-assign]
    count = 40
    writers = [start_child("submitter", str(spool), str(count)) for _ in range(2)]
    try:
        with SpoolServer(spool, tier, poll_interval=0.05):
            for w in writers:
                expect(w, "ready")
            for w in writers:
                assert w.stdin is not None
                w.stdin.write("go\n")
                w.stdin.flush()
            reports: list[dict[str, Any]] = []
            for w in writers:
                assert w.stdout is not None
                lines = [w.stdout.readline() for _ in range(count + 1)]
                assert lines[-1].strip() == "done", lines[-1]
                reports += [json.loads(line) for line in lines[:-1]]
                assert w.wait(timeout=30) == 0
    finally:
        for w in writers:
            if w.poll() is None:
                kill(w)
            for f in (w.stdin, w.stdout):
                if f:
                    f.close()
    seqs = [r["seq"] for r in reports]
    assert len(set(seqs)) == len(seqs) == 2 * count  # reserved atomically: no seq handed out twice
    ok = [r["token"] for r in reports if r["status"] == "ok"]
    assert len(ok) == 2 * count, [r for r in reports if r["status"] != "ok"][:3]
    assert sorted(applied) == sorted(ok)  # every acknowledged capture applied exactly once, nothing else


def test_a_handle_never_takes_another_captures_answer_for_its_own(spool: Path) -> None:
    """Two captures under one seq (a writer of an older version that did not reserve its numbers): the ack
    names the capture it answers, and the other capture's handle reports an error, not ok."""
    with SpoolWriter(spool) as w:
        h = w.submit(Capture(1, {"v": Full(np.zeros(4, np.float32))}))
        shutil.rmtree(spool / "incoming" / f"{h.seq:012d}")  # the agent applied the other capture instead
        other = f"{'0' * 8}-{h.seq}"
        spool_mod.atomic_write_json(
            spool / "acks" / f"{h.seq:012d}.json",
            {"seq": h.seq, "status": "ok", "memory_step": 1, "token": other, "message": "", "capture": other},
        )
        with pytest.raises(SaveError, match="is for capture"):
            h.result(timeout=5)


if __name__ == "__main__":
    if sys.argv[1] == "agent":
        child_agent(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "writer":
        child_writer(sys.argv[2])
    elif sys.argv[1] == "submitter":
        child_submitter(sys.argv[2], int(sys.argv[3]))


def test_watchdogs_stop_race_message_is_not_logged_as_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """watchdog logs an ERROR for an event that races its own stop; the agent printed it at every stop."""
    tier = MemoryTier()
    with SpoolServer(tmp_path / "spool", tier):
        pass
    logger = logging.getLogger("watchdog.observers.inotify")
    with caplog.at_level(logging.ERROR, logger="watchdog.observers.inotify"):
        logger.error("InotifyEmitter.queue_events() called when the thread is inactive")
        logger.error("a real watchdog error")
    assert [r.getMessage() for r in caplog.records] == ["a real watchdog error"]


# ------------------------------------------------------------------------------------------------ other users
def test_the_spool_folder_is_private_and_a_foreign_or_open_one_is_refused(tmp_path: Path) -> None:
    """Another local user who makes /dev/shm/psguard-<job> first must not be able to hand the agent a model."""
    import stat as stat_mod

    from psguard.agent.tiers.memory_tier import MemoryTier
    from psguard.errors import ConfigError
    from psguard.trainer.spool_writer import SpoolWriter

    root = tmp_path / "fresh"
    with SpoolWriter(root) as w:
        w.heartbeat(1, None)
    assert stat_mod.S_IMODE(root.stat().st_mode) == 0o700
    assert stat_mod.S_IMODE((root / "heartbeat.json").stat().st_mode) == 0o600
    assert all(stat_mod.S_IMODE(p.stat().st_mode) == 0o700 for p in root.iterdir() if p.is_dir())

    open_root = tmp_path / "open"
    open_root.mkdir()
    open_root.chmod(0o777)  # as another user's pre-created folder would be
    with pytest.raises(ConfigError, match="group or others write"):
        SpoolWriter(open_root)
    with pytest.raises(ConfigError, match="group or others write"):
        SpoolServer(open_root, MemoryTier()).start(watch=False)
    link = tmp_path / "link"
    link.symlink_to(root)
    with pytest.raises(ConfigError, match="not a folder"):
        SpoolWriter(link)
    if os.geteuid() != 0:
        pytest.skip("the other-owner case needs root to give a folder away (the mode cases above ran)")
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)  # nobody
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        SpoolWriter(foreign)


def test_a_fifo_as_the_seq_file_or_an_ack_is_refused_not_waited_on(spool: Path, fifos: Fifos) -> None:
    """The trainer's end reads the spool as the agent's does: only its own private regular files, never blocking."""
    with SpoolWriter(spool) as w:
        fifos.put(spool / "seq")
        h = fifos.within(lambda: w.submit(Capture(1, whole({"t": np.arange(4, dtype=np.float32)}))))
        assert (spool / "seq").read_text() == str(h.seq)  # numbered from the folders; the FIFO replaced
        fifos.put(spool / "acks" / f"{h.seq:012d}.json")
        with pytest.raises(CorruptCheckpointError, match=r"\.json is a FIFO"):
            fifos.within(lambda: h.result(timeout=5))


def test_a_stray_huge_sequence_number_is_ignored_not_obeyed(tmp_path: Path) -> None:
    from psguard.agent.tiers.memory_tier import MemoryTier
    from psguard.trainer.spool_writer import SpoolWriter

    root = tmp_path / "spool"
    with SpoolWriter(root) as w:
        (root / "incoming" / ("9" * 255)).mkdir()
        server = SpoolServer(root, MemoryTier()).start(watch=False)
        try:
            handle = w.submit(Capture(1, whole({"t": np.arange(4, dtype=np.float32)})))
            server.process_once()
            assert handle.result(timeout=10).status == "ok"
        finally:
            server.stop()


def test_a_restore_names_each_shards_fingerprints_when_its_agent_kept_them(tmp_path: Path) -> None:
    """``fp_path`` beside a part's ``path`` reaches the trainer as ``Restored.part_fps``; a part without it
    (an agent without fingerprints, an older agent) has none, and its PS hashes the rows."""
    part = {"name": "t", "offset": 0, "rows": 10, "task": "ps:0", "dtype": "float32", "path": "/p/0"}
    doc = {
        "format": spool_mod.RESTORE_FORMAT,
        "version": spool_mod.VERSION,
        "status": "ok",
        "step": 3,
        "metadata": {},
        "tensors": [],
        "parts": [{**part, "fp_path": "/p/0.fp"}, {**part, "offset": 10, "path": "/p/1"}],
    }
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    restored = spool_mod.read_restore(tmp_path)
    assert restored.parts == {ShardKey("t", 0, 10): "/p/0", ShardKey("t", 10, 10): "/p/1"}
    assert restored.part_fps == {ShardKey("t", 0, 10): "/p/0.fp"}

    shard = ShardFiles(ShardKey("t", 0, 10), (20, 4), "float32", "rows", 2, "0-1", fps=True)
    assert ShardFiles.from_json(shard.to_json(), "test") == shard
    older = {k: v for k, v in shard.to_json().items() if k != "fps"}
    assert ShardFiles.from_json(older, "test").fps is False
