"""The agent's end of the spool against a hostile local user: what is not a file psguard wrote is refused without
being waited on, and a spool folder renamed away and replaced is never read (the round trips, crashes and damage
are tested with both ends in tests/unit/handoff/test_spool.py)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.persister import Persister
from psguard.agent.tiers.spool_server import SpoolServer
from psguard.errors import PsguardError, SaveError
from psguard.handoff.contract import Tier
from psguard.handoff.spool import Capture
from psguard.policy.lag import LagBound
from psguard.storage import RetryConfig, open_backend
from psguard.store import Store
from psguard.tensors import Full, TensorUpdate
from psguard.trainer.durable_lag import LagGuard
from psguard.trainer.sinks import _AgentSaveHandle
from psguard.trainer.spool_writer import SpoolWriter
from tests.support.fifos import Fifos

DURABLE = frozenset({Tier.MEMORY, Tier.DURABLE})
NOBODY = 65534
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there (a store that is down)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user (nobody) needs root")


def whole(value: float) -> dict[str, TensorUpdate]:
    return {"w": Full(np.full(8, value, np.float32))}


# ------------------------------------------------------------------------------------------------ not a file
def test_a_fifo_as_a_captures_json_is_refused_and_the_captures_after_it_applied(tmp_path: Path, fifos: Fifos) -> None:
    """It blocked the agent for good: no capture acknowledged again, nothing in /status, SIGTERM ignored."""
    spool = tmp_path / "spool"
    tier = MemoryTier()
    with SpoolWriter(spool) as w:
        bad = w.submit(Capture(1, whole(1)))
        fifos.put(spool / "incoming" / f"{bad.seq:012d}" / "capture.json")
        srv = SpoolServer(spool, tier).start()  # its own thread and watchdog, as in the agent
        try:
            good = w.submit(Capture(2, whole(2)))
            with pytest.raises(SaveError, match=r"capture\.json is a FIFO"):
                fifos.within(lambda: bad.result(timeout=10), 20)
            assert fifos.within(lambda: good.result(timeout=10), 20).memory_step == 2
            assert "capture.json is a FIFO" in (srv.status().last_error or "")  # what /status shows
        finally:
            fifos.release()  # only does something if the server blocked
            srv.stop()
        assert not srv.status().running  # stop() did not give up on a blocked thread


def test_a_fifo_as_a_restore_request_is_answered_with_an_error(tmp_path: Path, fifos: Fifos) -> None:
    spool = tmp_path / "spool"
    with SpoolWriter(spool) as w:
        restore = w.request_restore()
        fifos.put(spool / "requests" / f"restore-{restore.name}.json")
        srv = SpoolServer(spool, MemoryTier()).start(watch=False)
        try:
            fifos.within(srv.process_once)
            with pytest.raises(PsguardError, match=r"could not export its memory tier: .* is a FIFO"):
                restore.result(timeout=10)
        finally:
            fifos.release()
            srv.stop()


@as_root
def test_a_spool_file_another_user_owns_or_others_can_write_is_refused(tmp_path: Path) -> None:
    """Re-checked on each file read (its descriptor): only this user's files that no one else can write."""
    spool = tmp_path / "spool"
    tier = MemoryTier()
    with SpoolWriter(spool) as w:
        foreign = w.submit(Capture(1, whole(1)))
        os.chown(spool / "incoming" / f"{foreign.seq:012d}" / "capture.json", NOBODY, NOBODY)
        writable = w.submit(Capture(2, whole(2)))
        (spool / "incoming" / f"{writable.seq:012d}" / "0.bin").chmod(0o666)
        srv = SpoolServer(spool, tier).start(watch=False)
        try:
            srv.process_once()
            with pytest.raises(SaveError, match=rf"capture\.json is owned by uid {NOBODY}, not by this user"):
                foreign.result(timeout=5)
            with pytest.raises(SaveError, match=r"0\.bin has mode 0666: group or others could have changed it"):
                writable.result(timeout=5)
        finally:
            srv.stop()
    assert tier.step is None


# ------------------------------------------------------------------------------------------------ hijack
def forge(staging: Path, at: Path, step: int) -> str:
    """Another user's spool put at ``at``: a well-formed capture of ``step`` for the memory tier and the durable
    log, made by psguard's own writer, in a folder (and files) the other user owns and anyone can write; the
    capture's folder name."""
    with SpoolWriter(staging) as theirs:
        forged = theirs.submit(Capture(step, {"w": Full(np.full(8, -1, np.float32))}, tiers=DURABLE))
    shutil.copytree(staging, at)
    for folder, _, files in os.walk(at):
        os.chown(folder, NOBODY, NOBODY)
        os.chmod(folder, 0o777)
        for name in files:
            os.chown(os.path.join(folder, name), NOBODY, NOBODY)
    return f"{forged.seq:012d}"


@as_root
def test_a_spool_renamed_away_and_replaced_is_never_read(tmp_path: Path) -> None:
    """A user who can write the folder above the spool renames the spool away after the agent started and puts
    their own in its place, holding a well-formed capture: it must reach neither the memory tier nor the log."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # the spool's parent: anyone may rename what is in it (no sticky bit)
    spool = shared / "spool"
    truth = np.arange(8, dtype=np.float32)
    with Store.open(str(tmp_path / "store")) as store:
        tier = MemoryTier()
        with Persister(store, tier) as persister, SpoolWriter(spool) as w:
            srv = SpoolServer(spool, tier, persister).start(watch=False)
            try:
                first = w.submit(Capture(1, {"w": Full(truth)}, tiers=DURABLE))
                srv.process_once()
                committed = first.durable(timeout=30).checkpoint

                os.rename(spool, shared / "away")
                forged = forge(tmp_path / "staging", spool, step=10**6)
                srv.process_once()
                assert (tier.step, tier.token) == (1, first.token)  # not applied to the memory tier
                assert store.checkpoint_ids() == [committed]  # nor committed to the log
                assert [p.name for p in (spool / "incoming").iterdir()] == [forged]  # never touched
                assert not list((spool / "acks").iterdir())  # nor answered there
                assert f"the spool path {spool} no longer names the folder this agent opened" in (
                    srv.status().last_error or ""
                )

                # The trainer that started with the agent holds the same folder: its hand-off goes on.
                second = w.submit(Capture(2, {"w": Full(truth + 1)}))
                srv.process_once()
                assert second.result(timeout=10).memory_step == 2
                assert [p.name for p in (spool / "incoming").iterdir()] == [forged]  # nothing written in theirs
            finally:
                srv.stop()
        with tier.export() as snap:
            assert np.array_equal(snap.tensors["w"], truth + 1)


# ------------------------------------------------------------------------------------------- store down
@pytest.mark.slow
def test_a_store_being_retried_is_shown_in_the_pending_answer_so_a_hold_ends_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An S3 outage held training for the store's whole retry deadline (explore case 1/3): the trainer learns
    from the pending durable answer that the store is failing, ends its hold, and the answer still comes."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEYID0000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
    deadline = 20.0  # the store's retry deadline: the hold must end long before it
    backend = open_backend("s3://bucket/job", {"endpoint_url": CLOSED}, retry=RetryConfig(deadline=deadline))
    spool, tier = tmp_path / "spool", MemoryTier()
    with Store(backend) as store, Persister(store, tier, retry_after=None) as persister, SpoolWriter(spool) as w:
        srv = SpoolServer(spool, tier, persister, poll_interval=0.1).start()  # its own thread, as in the agent
        try:
            capture = w.submit(Capture(1, whole(1), tiers=DURABLE))
            handle = _AgentSaveHandle(1, 0.0, capture, store)
            guard = LagGuard(LagBound)
            guard.submitted(handle)
            t0 = time.monotonic()
            guard.check(1)
            held = time.monotonic() - t0
            assert held < deadline / 2, f"held {held:.1f}s: the hold waited for the store's retry deadline"
            retrying = handle.store_retrying()
            assert retrying is not None and "is being retried" in retrying and "127.0.0.1:9" in retrying
            assert guard.status().failing and guard.status().pending == 1  # its answer still counts
            with pytest.raises(SaveError, match="did not become durable"):  # the answer comes at the deadline
                handle.result(timeout=deadline * 3)
            assert handle.store_retrying() is None
        finally:
            srv.stop()
