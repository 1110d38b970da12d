"""The rows' fingerprints travel with a full peer copy (psguard.agent.tiers.shard_copy): a new agent that fetched
its shards from the copy exports them with its restore files, so its PS loads them instead of hashing every row.

Why it matters: after a node loss the replaced PS hashed 512 MB with ``tf.fingerprint`` on the recovery's critical
path (0.3 CPU-s at 1 GB of state); after a process fault the agent had them. The owner and holder are two
ShardKeepers joined by direct calls, as in test_peer_copy.py (the HTTP hop and real PS: tests/cluster).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.agent.tiers.copy_frames import rows_digest
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.agent.tiers.shard_copy import fp_name
from psguard.agent.tiers.shards import ShardKeeper
from psguard.handoff.tensor_bundle import read_bundle
from psguard.tensors import Full, Rows, Same, TensorUpdate
from tests.support.processes import wait_until
from tests.unit.agent.tiers.test_peer_copy import HOLDER_URL, KEYS, Pair, _delta, _owner_arrays, _state

ROWS = 500


def _fp_of(values: np.ndarray) -> np.ndarray:
    """A stand-in for the PS's farmhash of each row: any int64 per row that follows the row's bytes."""
    return np.ascontiguousarray(values).view(np.int32).astype(np.int64).sum(axis=1) * 2654435761


def _fps(updates: Mapping[str, TensorUpdate]) -> dict[str, TensorUpdate]:
    out: dict[str, TensorUpdate] = {}
    for n, u in updates.items():
        if isinstance(u, Full):
            out[n] = Full(_fp_of(u.value))
        elif isinstance(u, Rows):
            out[n] = Rows(u.ids, _fp_of(u.values), (ROWS,))
        else:
            out[n] = Same((ROWS,), np.dtype(np.int64))
    return out


class FpPair(Pair):
    """A :class:`Pair` whose captures carry their rows' fingerprints, as the capture function sends them."""

    def apply(self, updates: Mapping[str, Any], step: int, token: str, parent: str | None) -> dict[str, Any]:
        return self.owner.apply_updates(
            updates, KEYS, step=step, token=token, parent=parent, copy_to=("ps:1", HOLDER_URL), fps=_fps(updates)
        )


@pytest.fixture
def fp_pair(tmp_path: Path) -> Iterator[FpPair]:
    p = FpPair(tmp_path)
    yield p
    p.close()


def _owner_fps(keeper: ShardKeeper) -> dict[str, np.ndarray]:
    with keeper.fp_tier.export() as snap:
        return {n: np.array(a) for n, a in snap.tensors.items()}


def _follow(p: FpPair, rng: np.random.Generator, steps: int) -> None:
    p.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    for step in range(2, steps + 1):
        updates, _ = _delta(rng, sorted(rng.choice(ROWS, 20, replace=False).tolist()))
        p.apply(updates, step, f"t{step}", f"t{step - 1}")
    wait_until(p.synced, 30, f"the copy at t{steps}")


def _pull_rows_without_fingerprints(fresh: ShardKeeper, owner: ShardKeeper, token: str) -> None:
    """``fresh`` pulls the copy at ``token``: the owner's rows exactly, and no fingerprints kept or exported (its PS
    hashes the rows after the load)."""
    assert fresh.pull({"token": token, "holder": HOLDER_URL})["status"] == "ok"
    got, want = _owner_arrays(fresh), _owner_arrays(owner)
    assert all(np.array_equal(got[n], want[n]) for n in want)
    assert fresh.status()["fingerprints_kept"] is False and fresh.status()["fingerprint_bytes"] == 0
    assert not any("fp_path" in f for f in fresh.export({"token": token})["files"])


def test_the_copy_holds_the_fingerprints_and_a_new_agent_exports_them(fp_pair: FpPair, tmp_path: Path) -> None:
    _follow(fp_pair, np.random.default_rng(11), 4)
    status = fp_pair.owner.sender.status() if fp_pair.owner.sender else {}
    assert (status["whole"], status["deltas"]) == (1, 3), status  # the fingerprints rode along the deltas
    want_fps = _owner_fps(fp_pair.owner)
    copy = fp_pair.copy_arrays()
    assert set(copy) == set(KEYS) | {fp_name(n) for n in KEYS}
    assert all(np.array_equal(copy[fp_name(n)], want_fps[n]) for n in KEYS)

    fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", read_copy=fp_pair.read).start()
    try:
        answer = fresh.pull({"token": "t4", "holder": HOLDER_URL})
        assert answer["status"] == "ok" and answer["bytes"] == sum(a.nbytes for a in _owner_arrays(fresh).values())
        assert fresh.status()["fingerprints_kept"] is True
        # one int64 a row, beside the tier: what the agent holds for its own shards besides their rows
        assert fresh.status()["fingerprint_bytes"] == sum(8 * a.shape[0] for a in _owner_arrays(fresh).values())
        assert set(fresh.tier.names()) == set(KEYS)  # the fingerprints are not tensors of the tier
        files = fresh.export({"token": "t4"})["files"]
        assert len(files) == len(KEYS) and all("fp_path" in f for f in files), files
        for f in files:
            name = f"{f['name']}@{f['offset']}:{f['rows']}"
            assert np.array_equal(read_bundle(f["fp_path"], dtype="int64", shape=(ROWS,)), want_fps[name])
    finally:
        fresh.close()


def test_a_damaged_fingerprint_in_the_copy_refuses_the_fetch(fp_pair: FpPair, tmp_path: Path) -> None:
    """A wrong fingerprint could hide a changed row from the next capture: the copy is checked whole."""
    _follow(fp_pair, np.random.default_rng(12), 2)
    fp_pair.copy_arrays()[fp_name(next(iter(KEYS)))][123] ^= 1
    fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", read_copy=fp_pair.read).start()
    try:
        refused = fresh.pull({"token": "t2", "holder": HOLDER_URL})
        assert refused["status"] == "refused" and "digest" in refused["message"] and fresh.tier.empty
        assert fresh.status()["fingerprints_kept"] is False
    finally:
        fresh.close()


def test_fingerprints_that_do_not_fit_the_tier_are_dropped_and_the_next_copy_is_whole(
    fp_pair: FpPair, tmp_path: Path
) -> None:
    """A holder whose fingerprints agree with its layout and digests yet not with the rows they stand for (one row
    short: a holder of another version, a bug): the rows are used, the fingerprints are not (the PS hashes its rows
    after the load), and the new agent's next capture sends its copy whole, not a delta naming them."""
    rng = np.random.default_rng(17)
    _follow(fp_pair, rng, 2)
    held = fp_pair.holder.holder._copies["ps:0"]
    name = fp_name(next(iter(KEYS)))
    short = np.ascontiguousarray(held.tier._arrays[name][:-1])
    held.tier._arrays[name] = short
    held.layout = [{**t, "array_shape": [ROWS - 1]} if t["name"] == name else t for t in held.layout]
    held.digests = {**held.digests, name: rows_digest(short)}
    fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", send_frame=fp_pair.send, read_copy=fp_pair.read).start()
    try:
        _pull_rows_without_fingerprints(fresh, fp_pair.owner, "t2")
        updates, _ = _delta(rng, [3])
        fresh.apply_updates(updates, KEYS, step=3, token="t3", parent="t2", copy_to=("ps:1", HOLDER_URL))
        assert fresh.sender is not None
        wait_until(lambda: fresh.sender.status()["synced_token"] == "t3", 30, "the holder at t3")  # type: ignore[union-attr]
        assert fresh.sender.status()["whole"] == 1
        assert set(fp_pair.copy_arrays()) == set(KEYS)  # the copy holds no fingerprints now
    finally:
        fresh.close()


def test_a_roll_back_takes_the_fingerprints_back_too_and_the_copy_follows(fp_pair: FpPair) -> None:
    rng = np.random.default_rng(13)
    _follow(fp_pair, rng, 2)
    at_t2 = _owner_fps(fp_pair.owner)
    updates, _ = _delta(rng, [5, 6, 7])
    fp_pair.apply(updates, 3, "t3", "t2")
    answer = fp_pair.owner.export({"token": "t2"})
    assert answer["status"] == "ok" and answer["step"] == 2 and all("fp_path" in f for f in answer["files"])
    assert fp_pair.owner.status()["fingerprints_kept"] is True
    assert all(np.array_equal(_owner_fps(fp_pair.owner)[n], at_t2[n]) for n in KEYS)
    wait_until(fp_pair.synced, 30, "the copy back at t2")
    copy = fp_pair.copy_arrays()
    assert all(np.array_equal(copy[fp_name(n)], at_t2[n]) for n in KEYS)
    status = fp_pair.owner.sender.status() if fp_pair.owner.sender else {}
    assert status["whole"] == 1, status  # the roll-back went as a delta


def test_a_capture_without_fingerprints_sends_the_copy_whole_without_them(fp_pair: FpPair, tmp_path: Path) -> None:
    """The fingerprints stop following the tier (a capture sent none): the copy drops them, whole, and a new
    agent gets exact rows and hashes them itself."""
    rng = np.random.default_rng(14)
    _follow(fp_pair, rng, 2)
    updates, _ = _delta(rng, [9])
    Pair.apply(fp_pair, updates, 3, "t3", "t2")  # no fingerprints
    wait_until(lambda: fp_pair.synced() and fp_pair.owner.sender.status()["whole"] == 2, 30, "a whole copy")  # type: ignore[union-attr]
    assert set(fp_pair.copy_arrays()) == set(KEYS)
    fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", read_copy=fp_pair.read).start()
    try:
        _pull_rows_without_fingerprints(fresh, fp_pair.owner, "t3")
    finally:
        fresh.close()


def test_with_fingerprints_off_the_copy_holds_the_rows_alone(tmp_path: Path) -> None:
    p = FpPair(tmp_path, PeerCopyConfig(fingerprints=False))
    try:
        _follow(p, np.random.default_rng(15), 3)
        assert set(p.copy_arrays()) == set(KEYS)
        assert p.owner.status()["fingerprints_kept"] is True  # its own restores still load them
    finally:
        p.close()


def test_a_new_agent_keeps_its_copy_current_by_deltas_with_the_fingerprints(fp_pair: FpPair, tmp_path: Path) -> None:
    """After the fetch the new agent's next capture goes to the same holder as a delta, fingerprints and all."""
    rng = np.random.default_rng(16)
    _follow(fp_pair, rng, 2)
    fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", send_frame=fp_pair.send, read_copy=fp_pair.read).start()
    try:
        assert fresh.pull({"token": "t2", "holder": HOLDER_URL})["status"] == "ok"
        updates, _ = _delta(rng, [3, 4])
        fresh.apply_updates(
            updates, KEYS, step=3, token="t3", parent="t2", copy_to=("ps:1", HOLDER_URL), fps=_fps(updates)
        )
        assert fresh.sender is not None
        wait_until(lambda: fresh.sender.status()["synced_token"] == "t3", 30, "the holder at t3")  # type: ignore[union-attr]
        assert (fresh.sender.status()["whole"], fresh.sender.status()["deltas"]) == (0, 1)
        copy, fps = fp_pair.copy_arrays(), _owner_fps(fresh)
        assert all(np.array_equal(copy[fp_name(n)], fps[n]) for n in KEYS)
    finally:
        fresh.close()
