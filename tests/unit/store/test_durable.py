"""The one durable writer (psguard.store.durable): the rules both the trainer's writer and the agent's persister
follow, on a real local store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.errors import ConfigError, ParentMissingError
from psguard.policy.engine import ChainLimit, base_rule
from psguard.storage.metered import MeteredBackend
from psguard.store import CheckpointInfo, Store
from psguard.store.durable import ChainState, DurableWriter
from psguard.store.manifest import chunk_key, manifest_key
from psguard.tensors import Full, Rows, TensorUpdate

ROWS = 64


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(str(tmp_path / "store"))
    yield s
    s.close()


def whole(table: np.ndarray) -> dict[str, TensorUpdate]:
    return {"table": Full(table.copy())}


def delta(table: np.ndarray, step: int) -> dict[str, TensorUpdate]:
    ids = np.array([step % ROWS], np.int64)
    table[ids] = float(step)
    return {"table": Rows(ids, table[ids].copy(), table.shape)}


def no_retention(info: CheckpointInfo) -> None:
    return None


def test_a_delta_needs_a_parent_and_a_lost_parent_makes_the_next_save_whole(store: Store) -> None:
    writer = DurableWriter(store, base_rule=lambda c, s: False, retention=no_retention, compact=True)
    table = np.zeros((ROWS, 4), np.float32)
    with pytest.raises(ParentMissingError, match="without a checkpoint to build on"):
        writer.save(1, delta(table, 1), whole=False)
    first = writer.save(1, whole(table), whole=True)
    second = writer.save(2, delta(table, 2), whole=False)
    assert second.parent == first.id and writer.last == second and writer.state.chain_length == 1
    store.backend.delete(manifest_key(second.id))  # gone behind the writer's back (another writer's gc, say)
    with pytest.raises(ParentMissingError):
        writer.save(3, delta(table, 3), whole=False)
    assert writer.last is None and writer.base_due(3)  # forgotten: the next save must be whole
    third = writer.save(3, whole(table), whole=True)
    np.testing.assert_array_equal(store.load(third.id)["table"], table)


def test_a_compacting_writer_folds_the_chain_when_the_rule_says_and_builds_on_the_new_base(store: Store) -> None:
    rule = base_rule(ChainLimit(max_chain=2))
    writer = DurableWriter(store, base_rule=rule, retention=no_retention, compact=True)
    table = np.zeros((ROWS, 4), np.float32)
    for step in (1, 2):
        writer.tidy(writer.save(step, whole(table) if step == 1 else delta(table, step), whole=step == 1))
    saved = writer.save(3, delta(table, 3), whole=False)
    assert writer.last == saved  # the commit is the caller's to acknowledge before anything is folded
    writer.tidy(saved)  # the second link made the rule fire: compacted
    folded = writer.last
    assert saved.kind == "delta" and saved.step == 3  # the caller gets the commit it asked for
    assert folded is not None and folded.kind == "full" and folded.step == 3 and writer.state.chain_length == 0
    nxt = writer.save(4, delta(table, 4), whole=False)
    writer.tidy(nxt)
    assert nxt.parent == folded.id and writer.last == nxt
    writer.tidy(writer.save(5, delta(table, 5), whole=False), new_base=True)  # the caller's policy asked for a base
    asked = writer.last
    assert asked is not None and asked.kind == "full"
    np.testing.assert_array_equal(store.load(asked.id)["table"], table)


def test_a_rewriting_writer_only_says_when_a_base_is_due(store: Store) -> None:
    """The agent holds the whole state: it writes the base itself, nothing is compacted behind it."""
    seen: list[ChainState] = []

    def rule(chain: ChainState, step: int) -> bool:
        seen.append(chain)
        return base_rule(ChainLimit(max_chain=2, max_delta_percent=None))(chain, step)

    writer = DurableWriter(store, base_rule=rule, retention=no_retention, compact=False)
    table = np.zeros((ROWS, 4), np.float32)
    assert writer.base_due(1)  # nothing to build on
    writer.save(1, whole(table), whole=True)
    assert not writer.base_due(2)
    writer.save(2, delta(table, 2), whole=False, payload_bytes=100)
    writer.save(3, delta(table, 3), whole=False, payload_bytes=100)
    assert [c.kind for c in store.checkpoints()] == ["full", "delta", "delta"]  # not compacted
    assert writer.base_due(4) and seen[-1].chain_length == 2 and seen[-1].delta_bytes == 200
    assert writer.save(4, whole(table), whole=True).kind == "full"
    assert not writer.base_due(5)


def test_retention_follows_each_commit_and_a_bad_request_skips_only_the_retention(store: Store) -> None:
    def keep_two(info: CheckpointInfo) -> dict[str, Any] | None:
        if info.step == 4:
            raise ConfigError("a malformed retention request")
        return {"keep_last": 2, "keep_every_hours": None}

    writer = DurableWriter(store, base_rule=lambda c, s: True, retention=keep_two, compact=False)
    table = np.zeros((ROWS, 4), np.float32)
    for step in range(1, 5):
        info = writer.save(step, whole(table), whole=True)
        assert info.id in {i.id for i in store.checkpoints()}  # committed, retention not run yet
        writer.tidy(info)
    assert sorted(i.step for i in store.checkpoints()) == [2, 3, 4]  # step 4's retention was skipped
    writer.save(5, whole(table), whole=True)
    assert sorted(i.step for i in store.checkpoints()) == [2, 3, 4, 5]  # save alone never deletes
    writer.tidy(writer.last)  # type: ignore[arg-type]
    assert sorted(i.step for i in store.checkpoints()) == [4, 5]


def test_adopting_a_checkpoint_reads_its_chain_on_the_writers_next_decision(store: Store) -> None:
    table = np.zeros((ROWS, 4), np.float32)
    first = DurableWriter(store, base_rule=lambda c, s: False, retention=no_retention, compact=True)
    first.save(1, whole(table), whole=True)
    first.save(2, delta(table, 2), whole=False)
    last = first.save(3, delta(table, 3), whole=False)

    successor = DurableWriter(store, base_rule=base_rule(ChainLimit(max_chain=3)), retention=no_retention, compact=True)
    successor.adopt(last.id)  # by id, as after a restore: nothing is read yet
    assert successor.last is None
    assert not successor.base_due(4)  # the read: two links, limit three
    assert successor.last == last and successor.state.chain_length == 2 and successor.state.base_step == 1
    successor.tidy(successor.save(4, delta(table, 4), whole=False))
    folded = successor.last
    assert folded is not None and folded.kind == "full"  # the third link: compacted
    successor.adopt("no-such-checkpoint")
    assert successor.base_due(5) and successor.last is None


def test_retention_after_a_commit_reads_the_new_chunks_not_the_chain_and_leaves_the_sweep_to_deletions(
    tmp_path: Path,
) -> None:
    """Was: every commit's retention verified the whole chain again and listed every chunk (on S3, a 7 MB job's
    commit took 0.2 s at the first delta and 1.3 s at the tenth; at 1 GB it reads the base at every commit)."""
    with Store.open(str(tmp_path / "store"), chunk_grace=0) as store:
        read: list[int] = []
        store.backend = MeteredBackend(store.backend, read.append)
        writer = DurableWriter(
            store,
            base_rule=lambda c, s: s == 6,
            retention=lambda info: {"keep_last": 2, "keep_every_hours": None},
            compact=False,
        )
        table = np.random.default_rng(0).random((4096, 16)).astype(np.float32)
        stray = chunk_key("ab" * 32)
        store.backend.put(stray, b"a killed writer's chunk")
        per_commit = []
        for step in range(1, 8):
            whole_ = step in (1, 6)
            info = writer.save(step, {"table": Full(table.copy())} if whole_ else delta(table, step), whole=whole_)
            read.clear()
            writer.tidy(info)
            per_commit.append(sum(read))
            assert store.backend.exists(stray) == (step < 7), step  # swept once retention deleted a checkpoint
        # 1-2: no more checkpoints than keep_last, no gc. 3: the first gc verifies the chain, the base with it. 4, 5:
        # only the new delta. 6 (a new base): its chunks. 7: the old chain goes, nothing new to verify but the delta.
        assert per_commit[:2] == [0, 0] and per_commit[2] >= table.nbytes, per_commit
        assert max(per_commit[3], per_commit[4], per_commit[6]) < table.nbytes / 10, per_commit
        read.clear()
        store.gc(keep_last=2)  # an operator's gc verifies everything it keeps
        assert sum(read) >= table.nbytes


def test_tidy_after_an_acknowledged_commit_never_raises_and_the_commit_stands(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever fails in compaction or retention (here an OSError no storage wrapper turned into a PsguardError),
    the caller has acknowledged the commit: tidy logs it and returns, and the commit restores."""
    writer = DurableWriter(store, base_rule=lambda c, s: False, retention=lambda i: {"keep_last": 1}, compact=True)
    table = np.zeros((ROWS, 4), np.float32)
    first = writer.save(1, whole(table), whole=True)
    writer.tidy(first)

    def broken(**_: Any) -> None:
        raise OSError("the disk went away")

    monkeypatch.setattr(store, "retain", broken)
    second = writer.save(2, delta(table, 2), whole=False)
    writer.tidy(second)
    assert "compaction or retention after" in caplog.text and "the disk went away" in caplog.text
    assert writer.last == second
    np.testing.assert_array_equal(store.load(second.id)["table"], table)
