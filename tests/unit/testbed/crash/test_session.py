"""A workload's session (psguard.testbed.crash.session): the store over the recorders, the history, the start.

On a store whose requests are the points (S3's way; a memory store here), no file-system recorder is installed,
so the session runs in pytest's own process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psguard.storage.memory import drop
from psguard.testbed.crash.recorder import CrashPlan
from psguard.testbed.crash.session import CHUNK_BYTES, History, Run, Session, read_ops


def test_a_stores_requests_count_once_the_session_begins_and_the_history_says_what_was_acknowledged(
    tmp_path: Path, unique: str
) -> None:
    run = Run(tmp_path, f"memory://{unique}", "s3")
    plan = CrashPlan(None, run.crash_record)
    session = Session(run, plan, roots=[])
    try:
        with session.store() as store:
            assert store.chunk_bytes == CHUNK_BYTES
            store.save(1, {"t": np.zeros(4, np.float32)})  # preparation: not enumerated
            assert plan.calls == []
            session.begin()
            session.invoke("save", steps=[2], new=1)
            info = store.save(2, {"t": np.ones(4, np.float32)})
            session.ok("save", commits=[[info.id, 2]])
        kinds = [c.split(" ", 1)[0] for c in plan.calls]
        assert kinds == ["put", "put", "put_new", "delete", "put_new"]  # lease, chunk, commit, lease gone, journal
        assert plan.calls[2] == f"put_new manifests/{info.id}.json"
        (op,) = read_ops(run.history)
        assert op.done and op.f == "save" and op.invoked == {"steps": [2], "new": 1}
        assert op.value == {"steps": [2], "new": 1, "commits": [[info.id, 2]]}
    finally:
        session.history.close()
        drop(unique)


def test_a_run_says_where_its_store_and_records_are(tmp_path: Path) -> None:
    local = Run(tmp_path, str(tmp_path / "store"), "local", lazyfs=True)
    assert local.store_root == tmp_path / "store" and local.image.parent == tmp_path
    with pytest.raises(ValueError, match="s3 run has no store folder"):
        _ = Run(tmp_path, "s3://bucket/x", "s3").store_root


def test_a_history_cut_by_the_crash_reads_up_to_its_last_whole_record(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    with History(path) as history:
        history.append("invoke", "save", {"steps": [1]})
        history.append("ok", "save", {"commits": [["a", 1]]})
        history.append("invoke", "gc", {"keep_last": 1})
    with open(path, "ab") as f:
        f.write(b'{"type": "ok", "f": "gc", "val')  # the write the crash cut short
    ops = read_ops(path)
    assert [(op.f, op.done) for op in ops] == [("save", True), ("gc", False)]
    assert ops[0].value == {"steps": [1], "commits": [["a", 1]]} and ops[1].invoked == {"keep_last": 1}
