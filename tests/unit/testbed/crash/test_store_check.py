"""The check after a crash of a durable-log path (psguard.testbed.crash.store_check) finds what it must.

Stores and histories made by hand, each with one thing wrong (or nothing): a check that passes everything would
let every crash point pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from psguard.store import Store
from psguard.store.manifest import chunk_key, manifest_key
from psguard.tensors import Full
from psguard.testbed.crash.session import CHUNK_BYTES, History, Run
from psguard.testbed.crash.store_check import check_store
from psguard.testbed.crash.store_paths import delta, state, writer


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path, str(tmp_path / "store"), "local")


def two_commits(
    run: Run, *, ack_second: bool = True, invoke_second: bool = True, tidy_second: bool = True
) -> tuple[str, str]:
    """Steps 1 (whole) and 2 (a delta) committed; the history acknowledges the first, and the second as told; an
    acknowledged commit is tidied after (its journal entry), the second's tidying left in flight unless told."""
    with Store.open(run.url, chunk_bytes=CHUNK_BYTES) as store, History(run.history) as history:
        dw = writer(store)
        history.append("invoke", "save", {"steps": [1], "new": 1})
        info = dw.save(1, {n: Full(v) for n, v in state(run.seed, 1).items()}, whole=True)
        history.append("ok", "save", {"commits": [[info.id, 1]]})
        history.append("invoke", "tidy", {"steps": [1], "new": 0, "journal": info.id})
        dw.tidy(info)
        history.append("ok", "tidy", {"commits": []})
        first = info.id
        if invoke_second:
            history.append("invoke", "save", {"steps": [2], "new": 1})
        info = dw.save(2, delta(run.seed, 2), whole=False)
        if ack_second:
            history.append("ok", "save", {"commits": [[info.id, 2]]})
            history.append("invoke", "tidy", {"steps": [2], "new": 0, "journal": info.id})
            if tidy_second:
                dw.tidy(info)
                history.append("ok", "tidy", {"commits": []})
    return first, info.id


def test_an_acknowledged_commit_has_its_journal_entry_unless_its_tidying_was_in_flight(run: Run) -> None:
    """The durable writer journals a commit after acknowledging it: a crash in between leaves no entry, and only
    then may an acknowledged commit lack one."""
    _, second = two_commits(run, tidy_second=False)
    assert check_store(run) == []  # its tidying in flight: no entry yet is right
    with Store.open(run.url) as store:
        store.append_journal(store.manifest(second))
        (first_entry, *_) = store.backend.keys("journal/")
        store.backend.delete(first_entry)
    problems = check_store(run)
    assert any(p.startswith("acknowledged checkpoint ") and p.endswith("has no journal entry") for p in problems)


def test_exactly_the_acknowledged_commits_pass_and_the_next_gc_and_save_go_ahead(run: Run) -> None:
    two_commits(run)
    assert check_store(run) == []
    with Store.open(run.url) as store:
        assert [store.manifest(c).step for c in store.checkpoint_ids()] == [1, 2, 3]  # the check's own next save


def test_a_commit_made_but_not_acknowledged_passes_while_its_operation_is_in_flight_only(run: Run) -> None:
    two_commits(run, ack_second=False)
    assert check_store(run) == []


def test_a_commit_nobody_asked_for_is_found(run: Run) -> None:
    _, second = two_commits(run, ack_second=False, invoke_second=False)
    problems = check_store(run)
    assert f"checkpoint {second} (step 2) was neither acknowledged nor in flight" in problems
    assert "1 unacknowledged checkpoints, the operation in flight makes 0" in problems


def test_an_acknowledged_commit_lost_is_found(run: Run) -> None:
    _, second = two_commits(run)
    with Store.open(run.url) as store:
        store.backend.delete(manifest_key(second))
    problems = check_store(run)
    assert f"acknowledged checkpoint {second} (step 2) is lost" in problems
    assert any("newest acknowledged step 2" in p for p in problems)


def test_a_torn_checkpoint_is_found(run: Run) -> None:
    _, second = two_commits(run)
    with Store.open(run.url) as store:
        victim = next(iter(store.manifest(second).refs())).hash
        store.backend.delete(chunk_key(victim))
    problems = check_store(run)
    assert any(p.startswith(f"checkpoint {second} (step 2) is torn") and victim in p for p in problems), problems


def test_a_checkpoint_that_restores_other_values_is_found(run: Run) -> None:
    with Store.open(run.url, chunk_bytes=CHUNK_BYTES) as store, History(run.history) as history:
        history.append("invoke", "save", {"steps": [1], "new": 1})
        wrong = store.save(1, {n: Full(v) for n, v in state(run.seed, 2).items()}).id
        history.append("ok", "save", {"commits": [[wrong, 1]]})
    assert any(p.startswith(f"checkpoint {wrong} (step 1) does not restore its step") for p in check_store(run))
