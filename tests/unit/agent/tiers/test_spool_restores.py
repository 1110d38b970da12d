"""The agent's answers to restore requests: one export of the PS agents' files per restore, taken ahead when a new
generation starts."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.spool_restores import RestoreAnswers
from psguard.agent.tiers.spool_server import SpoolServer
from psguard.handoff.spool import Capture, SpoolPaths
from psguard.tensors import Full, TensorUpdate
from psguard.trainer.spool_writer import SpoolWriter


def whole(value: float) -> dict[str, TensorUpdate]:
    return {"w": Full(np.full(8, value, np.float32))}


class _Shards:
    """The PS agents' side of a restore, counted: every export of the state the tier holds answers its files."""

    timeout = 10.0

    def __init__(self) -> None:
        self.active: tuple[str, ...] = ()
        self.order = threading.Lock()
        self.exports: list[tuple[tuple[str, ...], str]] = []

    def export(self, tasks: tuple[str, ...], token: str) -> list[dict[str, object]]:
        self.exports.append((tuple(tasks), token))
        return []


def test_a_restore_after_an_export_ahead_takes_its_answer_and_exports_once(tmp_path: Path) -> None:
    """A recovery exported twice: ahead of the restore (while the PS restart and the trainer rebuilds), then again
    for the restore, N more round trips to the PS agents. The restore takes the answer ahead for the same state;
    a second restore, or one of another state, asks the PS agents again."""
    spool, shards, tier = tmp_path / "spool", _Shards(), MemoryTier()
    srv = SpoolServer(spool, tier, shards=shards).start(watch=False)  # type: ignore[arg-type]
    try:
        with SpoolWriter(spool) as w:
            handle = w.submit(Capture(1, whole(1)))
            srv.process_once()
            handle.result(timeout=10)
            shards.active = ("ps:0", "ps:1")  # as a capture with shards on those PS leaves it
            ahead = srv.export_ahead()
            assert ahead is not None
            ahead.join(10)
            for _ in range(2):
                restore = w.request_restore()
                srv.process_once()
                assert restore.result(timeout=10).step == 1
    finally:
        srv.stop()
    assert shards.exports == [(("ps:0", "ps:1"), tier.token)] * 2  # ahead, then the second restore's own


def test_an_export_ahead_for_some_ps_only_is_no_answer_for_a_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replacement PS agent fetches its shards ahead (``only``: that PS); the restore still asks every PS agent,
    and answers with the tier's state."""
    paths, shards, tier = SpoolPaths(tmp_path / "spool"), _Shards(), MemoryTier()
    assert tier.apply(whole(1), step=7, token="t7", parent=None).ok
    shards.active = ("ps:0", "ps:1")
    srv = SpoolServer(paths.root, tier, shards=shards).start(watch=False)  # type: ignore[arg-type]
    assert isinstance(srv, RestoreAnswers)  # the spool server's restore half, driven here by itself
    monkeypatch.setattr(srv, "_writer_alive", lambda _: True)  # the request's writer is no process here
    try:
        ahead = srv.export_ahead(only=["ps:1"])
        assert ahead is not None
        ahead.join(10)
        request = paths.requests / "restore-0000abcd-00000000000a.json"
        request.write_text("{}")
        served = srv.serve(request, "0000abcd-00000000000a", "0000abcd")
    finally:
        srv.stop()
    assert served == (7, "ok")
    assert shards.exports == [(("ps:1",), "t7"), (("ps:0", "ps:1"), "t7")]
    assert (paths.restore / "0000abcd-00000000000a" / "manifest.json").is_file() and not request.exists()
