"""Peer copies (psguard.agent.tiers.peer_copy): digests, frames, and an owner's tier copied to a holder, fetched
back by a new agent, refused when damaged.

The owner and the holder are two ShardKeepers joined by direct calls in place of the HTTP hop (the hop itself
and a real node loss: tests/cluster/test_ps_side_agents.py).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.agent.tiers.copy_frames import decode_frame, encode_frame, read_frame_into
from psguard.agent.tiers.copy_owner import fetch_copy
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.agent.tiers.peer_copy import CopyHolder
from psguard.agent.tiers.shards import ShardKeeper
from psguard.errors import CorruptCheckpointError, PsguardError
from psguard.handoff.parts import ShardKey
from psguard.store.opening import StoreOpening
from psguard.tensors import Full, Rows, Same
from tests.support.processes import wait_until

EMB = "model/embedding/.ATTRIBUTES/VARIABLE_VALUE"
SLOT = "optimizer/slot/.ATTRIBUTES/VARIABLE_VALUE"
KEYS = {
    f"{EMB}@0:500": (ShardKey(EMB, 0, 500), (1000, 8)),
    f"{SLOT}@0:500": (ShardKey(SLOT, 0, 500), (1000, 8)),
}
HOLDER_URL = "http://holder.invalid:1"


class Pair:
    """An owner (ps:0) whose copy goes to a holder (ps:1), and a way to read the holder as a new agent would."""

    def __init__(self, tmp: Path, config: PeerCopyConfig | None = None) -> None:
        self.holder = ShardKeeper(tmp / "holder", "ps:1").start()
        self.owner = ShardKeeper(
            tmp / "owner", "ps:0", copy_config=config, send_frame=self.send, read_copy=self.read
        ).start()
        self.sent = 0

    def send(self, url: str, frame: bytes, timeout: float) -> dict[str, Any]:
        assert url == HOLDER_URL
        self.sent += 1
        return self.holder.holder.put(frame)

    def read(self, url: str, body: Mapping[str, Any], timeout: float) -> tuple[dict[str, Any], list[np.ndarray]]:
        return decode_frame(bytes(self.holder.holder.read(body)))  # the frame, as it travels over HTTP

    def apply(self, updates: Mapping[str, Any], step: int, token: str, parent: str | None) -> dict[str, Any]:
        return self.owner.apply_updates(
            updates, KEYS, step=step, token=token, parent=parent, copy_to=("ps:1", HOLDER_URL)
        )

    def synced(self) -> bool:
        s = self.owner.sender.status() if self.owner.sender else {}
        return s.get("synced_token") == self.owner.tier.token and not s.get("queued")

    def copy_arrays(self) -> dict[str, np.ndarray]:
        return dict(self.holder.holder._copies["ps:0"].tier._arrays)

    def close(self) -> None:
        self.owner.close()
        self.holder.close()


@pytest.fixture
def pair(tmp_path: Path) -> Any:
    p = Pair(tmp_path)
    yield p
    p.close()


def _state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {n: rng.normal(size=(500, 8)).astype(np.float32) for n in KEYS}


def _delta(rng: np.random.Generator, ids: list[int]) -> tuple[dict[str, Any], np.ndarray]:
    new = rng.normal(size=(len(ids), 8)).astype(np.float32)
    names = list(KEYS)
    return {names[0]: Rows(np.array(ids), new, (500, 8)), names[1]: Same((500, 8), np.dtype(np.float32))}, new


def _owner_arrays(keeper: ShardKeeper) -> dict[str, np.ndarray]:
    with keeper.tier.export() as snap:
        return {n: np.array(a) for n, a in snap.tensors.items()}


def test_the_holder_follows_the_owner_whole_then_by_deltas(pair: Pair) -> None:
    rng = np.random.default_rng(1)
    first = pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    # The whole copy is waited for too (bounded by wait_for_copy): a node lost right after it finds its copy.
    assert first["status"] == "ok" and first["copy"] == {"holder": "ps:1", "step": 1, "token": "t1"}, first
    assert pair.synced()
    parent = "t1"
    for step in range(2, 6):
        updates, _ = _delta(rng, sorted(rng.choice(500, 20, replace=False).tolist()))
        answer = pair.apply(updates, step, f"t{step}", parent)
        # wait_for_copy: the apply answers once the holder has the capture too, and says so
        assert answer["status"] == "ok" and answer["copy"] == {"holder": "ps:1", "step": step, "token": f"t{step}"}
        parent = f"t{step}"
    assert pair.synced()
    copy = pair.copy_arrays()
    for name, value in _owner_arrays(pair.owner).items():
        assert np.array_equal(copy[name], value)
    status = pair.owner.sender.status() if pair.owner.sender else {}
    assert status["whole"] == 1 and status["deltas"] == 4 and status["lag_steps"] == 0
    assert pair.holder.status()["copies_held"]["ps:0"]["token"] == "t5"


def test_a_damaged_copy_is_refused_at_the_next_delta_and_sent_whole_again(pair: Pair) -> None:
    rng = np.random.default_rng(2)
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    wait_until(pair.synced, 30, "the first whole copy")
    name = next(iter(KEYS))
    pair.copy_arrays()[name][7, 0] += 1.0  # a row the next delta overwrites, damaged in the holder's memory
    updates, _ = _delta(rng, [7, 8])
    pair.apply(updates, 2, "t2", "t1")
    wait_until(lambda: pair.synced() and (pair.owner.sender.status()["whole"] == 2), 30, "a second whole copy")
    assert pair.holder.holder.status()["refused_frames"] == 1
    assert np.array_equal(pair.copy_arrays()[name], _owner_arrays(pair.owner)[name])


def test_a_new_agent_takes_its_shards_from_the_copy_only_when_it_verifies(pair: Pair, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    updates, _ = _delta(rng, [1, 2, 3])
    pair.apply(updates, 2, "t2", "t1")
    wait_until(pair.synced, 30, "the copy at t2")
    want = _owner_arrays(pair.owner)

    # The new agent's store opens only after the fetch (its imports slowed the fetch): a pull releases it.
    store = StoreOpening(str(tmp_path / "log"), hold=600)
    fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", store=store, send_frame=pair.send, read_copy=pair.read)
    fresh.start()
    try:
        assert fresh.export({"token": "t2", "peer_copies": True})["status"] == "empty"
        assert store.state == "held"  # the chief asks for a pull next
        lagging = fresh.pull({"token": "t3", "holder": HOLDER_URL})  # the chief is at a state the copy lacks
        assert lagging["status"] == "unavailable" and fresh.tier.empty
        assert store.state != "held"  # the log is read next: its store opens now
        answer = fresh.pull({"token": "t2", "holder": HOLDER_URL})
        assert answer["status"] == "ok" and answer["step"] == 2 and fresh.tier.token == "t2"
        got = _owner_arrays(fresh)
        assert got.keys() == want.keys() and all(np.array_equal(got[n], want[n]) for n in want)
        assert fresh.export({"token": "t2"})["status"] == "ok"  # the restore files of the pulled shards
    finally:
        fresh.close()
        store.close()

    # After a fetch that worked, the restore and the training it resumes come first: the store opens later.
    store = StoreOpening(str(tmp_path / "log"), hold=600)
    again = ShardKeeper(tmp_path / "again", "ps:0", store=store, read_copy=pair.read).start()
    try:
        assert again.pull({"token": "t2", "holder": HOLDER_URL})["status"] == "ok"
        assert store.state == "held"
    finally:
        again.close()
        store.close()

    # With no peer copies in the job, an export that finds the tier empty means the log next: the store opens.
    store = StoreOpening(str(tmp_path / "log"), hold=600)
    alone = ShardKeeper(tmp_path / "no-copies", "ps:0", store=store).start()
    try:
        assert alone.export({"token": "t2", "peer_copies": False})["status"] == "empty"
        assert store.state != "held"
    finally:
        alone.close()
        store.close()

    pair.copy_arrays()[next(iter(KEYS))][400, 3] = np.float32(1e9)  # damaged at rest, no delta since
    damaged = ShardKeeper(tmp_path / "another", "ps:0", read_copy=pair.read).start()
    try:
        refused = damaged.pull({"token": "t2", "holder": HOLDER_URL})
        assert refused["status"] == "refused" and "digest" in refused["message"] and damaged.tier.empty
    finally:
        damaged.close()


def test_a_holder_that_lags_past_the_bound_gets_the_whole_state(tmp_path: Path) -> None:
    config = PeerCopyConfig(max_queue_mb=0)  # every delta is past the bound
    p = Pair(tmp_path, config)
    try:
        rng = np.random.default_rng(4)
        p.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
        wait_until(p.synced, 30, "the first whole copy")
        updates, _ = _delta(rng, [5])
        p.apply(updates, 2, "t2", "t1")
        wait_until(p.synced, 30, "the copy at t2")
        status = p.owner.sender.status() if p.owner.sender else {}
        assert status["dropped"] >= 1 and status["whole"] == 2 and status["deltas"] == 0
        assert all(np.array_equal(p.copy_arrays()[n], a) for n, a in _owner_arrays(p.owner).items())
    finally:
        p.close()


def test_a_copy_needs_an_owner_other_than_the_holder(pair: Pair) -> None:
    frame = encode_frame({"op": "begin", "task": "ps:1", "tensors": []})
    with pytest.raises(CorruptCheckpointError, match="owner"):
        pair.holder.holder.put(frame)


def test_a_capture_during_a_whole_copy_saves_its_rows_instead_of_copying_the_shard(tmp_path: Path) -> None:
    """The whole copy reads the tier in row ranges: a capture applied meanwhile saves the rows it overwrites (a
    few KB), not the 16 KB shards whole, and the holder still gets the state the copy began at, then the delta."""
    import threading

    p = Pair(tmp_path, PeerCopyConfig(chunk_mb=1))
    first_fill = threading.Event()
    go_on = threading.Event()
    send = p.send

    def slow_send(url: str, frame: bytes, timeout: float) -> dict[str, Any]:
        header, _ = decode_frame(frame)
        if header.get("op") == "fill" and not first_fill.is_set():
            first_fill.set()
            assert go_on.wait(30)
        return send(url, frame, timeout)

    p.owner.sender._post = slow_send  # type: ignore[union-attr]
    try:
        rng = np.random.default_rng(5)
        p.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
        assert first_fill.wait(30)
        before = p.owner.tier.status().copy_on_write_bytes
        updates, _ = _delta(rng, [0, 499])
        p.apply(updates, 2, "t2", "t1")  # while the whole copy of t1 is being sent
        grown = p.owner.tier.status().copy_on_write_bytes - before
        go_on.set()
        wait_until(p.synced, 30, "the copy at t2")
        assert grown < 500 * 8 * 4  # less than one shard: rows saved, no whole copy
        assert all(np.array_equal(p.copy_arrays()[n], a) for n, a in _owner_arrays(p.owner).items())
    finally:
        go_on.set()
        p.close()


def test_a_whole_copy_replacing_another_reuses_its_memory(pair: Pair) -> None:
    """A whole copy is sent when the holder's copy is behind (it could not serve a restore): the holder drops the
    old one at the start and fills its arrays in place, never holding two copies of one owner."""
    rng = np.random.default_rng(6)
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    wait_until(pair.synced, 30, "the first whole copy")
    before = {n: id(a) for n, a in pair.copy_arrays().items()}
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 2, "t2", None)  # a whole capture: a whole copy
    wait_until(pair.synced, 30, "the second whole copy")
    assert {n: id(a) for n, a in pair.copy_arrays().items()} == before
    assert all(np.array_equal(pair.copy_arrays()[n], a) for n, a in _owner_arrays(pair.owner).items())


def test_a_tier_one_capture_ahead_of_the_chief_rolls_back_for_the_restore(pair: Pair) -> None:
    """The chief's tier moves only when every PS applied a capture: when the agent of another PS dies in between,
    this PS holds the newer capture and the chief the older one. The restore asks for the chief's state; the
    tier undoes its last delta to it (and its copy follows) instead of sending the restore to the log."""
    rng = np.random.default_rng(7)
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    wait_until(pair.synced, 30, "the first whole copy")
    at_t1 = _owner_arrays(pair.owner)
    updates, _ = _delta(rng, [3, 4, 5])
    pair.apply(updates, 2, "t2", "t1")
    assert pair.owner.export({"token": "t0"})["status"] == "mismatch"  # only one capture back
    answer = pair.owner.export({"token": "t1"})
    assert answer["status"] == "ok" and answer["step"] == 1 and pair.owner.tier.token == "t1"
    now = _owner_arrays(pair.owner)
    assert all(np.array_equal(now[n], at_t1[n]) for n in at_t1)
    assert pair.owner.status()["rollbacks"] == 1
    wait_until(pair.synced, 30, "the copy back at t1")
    assert all(np.array_equal(pair.copy_arrays()[n], at_t1[n]) for n in at_t1)


def test_a_copy_one_capture_ahead_of_the_chief_rolls_back_for_a_new_agent(pair: Pair, tmp_path: Path) -> None:
    """The owner applied a capture and its copy received it, then the owner's node was lost before the chief's
    tier moved: the copy is one capture ahead of the chief's state, and a new agent asking for that state gets
    it, the copy's last delta undone."""
    rng = np.random.default_rng(8)
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    wait_until(pair.synced, 30, "the first whole copy")
    at_t1 = _owner_arrays(pair.owner)
    updates, _ = _delta(rng, [9, 10])
    pair.apply(updates, 2, "t2", "t1")
    assert pair.holder.status()["copies_held"]["ps:0"]["token"] == "t2"
    fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", read_copy=pair.read).start()
    try:
        answer = fresh.pull({"token": "t1", "holder": HOLDER_URL})
        assert answer["status"] == "ok" and answer["step"] == 1
        got = _owner_arrays(fresh)
        assert all(np.array_equal(got[n], at_t1[n]) for n in at_t1)
    finally:
        fresh.close()


def test_a_second_fetch_of_the_same_state_reads_nothing(pair: Pair, tmp_path: Path) -> None:
    """The chief asks a replacement agent for its shards ahead of the restore and again at the restore: the
    second ask finds the tier at that state and fetches nothing."""
    rng = np.random.default_rng(9)
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    wait_until(pair.synced, 30, "the first whole copy")
    reads: list[object] = []

    def counting_read(url: str, body: Mapping[str, Any], timeout: float) -> tuple[dict[str, Any], list[np.ndarray]]:
        reads.append(body)
        return pair.read(url, body, timeout)

    fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", read_copy=counting_read).start()
    try:
        assert fresh.pull({"token": "t1", "holder": HOLDER_URL})["status"] == "ok"
        first = len(reads)
        again = fresh.pull({"token": "t1", "holder": HOLDER_URL})
        assert again["status"] == "ok" and again["bytes"] == 0 and len(reads) == first > 0
    finally:
        fresh.close()


def test_a_fetched_copy_lands_in_the_tiers_files_and_exports_without_a_copy(pair: Pair, tmp_path: Path) -> None:
    """A replacement agent's fetch writes the rows where its tier keeps them (its tier files): no second copy of
    the shard in anonymous memory first, and the restore's export links those files."""
    rng = np.random.default_rng(10)
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    wait_until(pair.synced, 30, "the first whole copy")
    fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", read_copy=pair.read, tier_files=True).start()
    adopt, moved = fresh.files.adopt, []

    def watched_adopt(value: np.ndarray, *, copy: bool = False) -> np.ndarray:
        moved.append(not fresh.files.owns(value))  # an array fetched into anonymous memory, copied now
        return adopt(value, copy=copy)

    fresh.files.adopt = watched_adopt  # type: ignore[method-assign]
    try:
        assert fresh.pull({"token": "t1", "holder": HOLDER_URL})["status"] == "ok"
        assert moved and not any(moved)
        with fresh.tier.export() as snap:
            assert all(fresh.files.owns(np.asarray(a)) for a in snap.tensors.values())
        before = fresh.files.status()["bytes_linked"]
        assert fresh.export({"token": "t1"})["status"] == "ok"
        assert fresh.files.status()["bytes_linked"] - before == sum(a.nbytes for a in pair.copy_arrays().values())
        got, want = _owner_arrays(fresh), _owner_arrays(pair.owner)
        assert all(np.array_equal(got[n], want[n]) for n in want)
    finally:
        fresh.close()


def test_fetch_copy_places_the_rows_in_the_arrays_it_is_given(pair: Pair) -> None:
    rng = np.random.default_rng(11)
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    wait_until(pair.synced, 30, "the first whole copy")
    made: list[np.ndarray] = []

    def alloc(shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
        if made:  # the second array: none given, so anonymous memory
            return None
        made.append(np.full(shape, np.nan, dtype=dtype))
        return made[0]

    _, arrays = fetch_copy("ps:0", HOLDER_URL, "t1", pair.read, PeerCopyConfig(chunk_mb=1), alloc)
    given = [a for a in arrays.values() if a is made[0]]
    assert len(given) == 1 and len(arrays) == 2
    want = _owner_arrays(pair.owner)
    assert all(np.array_equal(arrays[n], want[n]) for n in want)


def test_a_fetch_writes_each_piece_once_as_it_arrives_and_a_full_node_fails_it_cleanly(
    pair: Pair, tmp_path: Path
) -> None:
    """A replacement agent's tier files are made without their pages (allocating 512 MB up front was a third of
    a second before the first request). Each answer's rows come through a small buffer, piece by piece, hashed
    there and written in place once (``pwrite`` into the file: it allocates the pages, and a full tmpfs fails it
    with ``ENOSPC``). A node without room fails the fetch (the log is used), never a SIGBUS."""
    rng = np.random.default_rng(12)
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    wait_until(pair.synced, 30, "the first whole copy")
    written: dict[int, list[tuple[int, int]]] = {}

    def alloc(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.full(shape, np.nan, dtype=dtype)

    def write(arr: np.ndarray, row: int, rows: np.ndarray) -> None:
        assert np.isnan(arr[row : row + len(rows)]).all()  # not written yet
        written.setdefault(id(arr), []).append((row, row + len(rows)))
        arr[row : row + len(rows)] = rows

    def read_into(
        url: str, body: Mapping[str, Any], timeout: float, out: np.ndarray, take: Callable[[int, np.ndarray], None]
    ) -> dict[str, Any]:  # as the HTTP link reads an answer, in pieces of 8 rows of 8 float32
        return read_frame_into(io.BytesIO(bytes(pair.holder.holder.read(body))), out, take, piece_bytes=256)

    config = PeerCopyConfig(chunk_mb=1)
    _, arrays = fetch_copy("ps:0", HOLDER_URL, "t1", pair.read, config, alloc, read_into, write)
    want = _owner_arrays(pair.owner)
    assert all(np.array_equal(arrays[n], want[n]) for n in want)
    for arr in arrays.values():
        pieces = sorted(written[id(arr)])
        assert len(pieces) == -(-arr.shape[0] // 8) and all(b - a == 8 for a, b in pieces[:-1])
        assert pieces[0][0] == 0 and pieces[-1][1] == arr.shape[0]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))  # each row once

    def full(arr: np.ndarray, row: int, rows: np.ndarray) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(PsguardError, match="no memory for ps:0's copy"):
        fetch_copy("ps:0", HOLDER_URL, "t1", pair.read, config, alloc, read_into, full)
    fresh = ShardKeeper(tmp_path / "full-node", "ps:0", read_copy=pair.read, tier_files=True).start()
    try:
        fresh.files.write_rows = full  # type: ignore[method-assign]
        assert fresh.pull({"token": "t1", "holder": HOLDER_URL})["status"] == "unavailable"
        assert fresh.tier.token is None  # nothing seeded from a fetch that could not be placed
    finally:
        fresh.close()


def test_a_holder_lost_mid_whole_copy_gets_the_whole_state_again_and_serves_only_whole(tmp_path: Path) -> None:
    """The holder's agent dies while a whole copy is on its way (after the first fill) and a new agent takes its
    place, empty. The owner's send fails, the owner sends the whole state again (after ``retry_after``), and a
    new agent of the owner fetches it exact; before that the new holder serves nothing (never half a copy)."""
    p = Pair(tmp_path, PeerCopyConfig(chunk_mb=1, retry_after=0.1, wait_for_copy=0.0))
    send = p.send
    lost: dict[str, Any] = {}

    def failing_send(url: str, frame: bytes, timeout: float) -> dict[str, Any]:
        header, _ = decode_frame(frame)
        second_fill = header.get("op") == "fill" and header.get("name") != next(iter(KEYS))  # the first went in
        if second_fill and not lost and p.owner.tier.token == "t2":
            p.holder.close()
            p.holder = ShardKeeper(tmp_path / "holder-again", "ps:1").start()  # its node replaced, empty
            probe = ShardKeeper(tmp_path / "probe", "ps:0", read_copy=p.read).start()
            try:
                lost["mid_copy"] = probe.pull({"token": "t2", "holder": HOLDER_URL})
                lost["probe_empty"] = probe.tier.empty
            finally:
                probe.close()
            raise ConnectionResetError("the holder's agent was killed")
        return send(url, frame, timeout)

    p.owner.sender._post = failing_send  # type: ignore[union-attr]
    try:
        rng = np.random.default_rng(12)
        p.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
        wait_until(p.synced, 30, "the first whole copy")
        p.apply({n: Full(a) for n, a in _state(rng).items()}, 2, "t2", None)  # a whole capture: a whole copy
        wait_until(lambda: p.synced() and bool(lost), 30, "the copy at t2 on the new holder")
        assert lost["mid_copy"]["status"] == "unavailable" and lost["probe_empty"], lost
        status = p.owner.sender.status() if p.owner.sender else {}
        assert status["errors"] >= 1 and status["whole"] == 2 and "killed" in str(status["last_error"])
        fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", read_copy=p.read).start()
        try:
            assert fresh.pull({"token": "t2", "holder": HOLDER_URL})["status"] == "ok"
            got, want = _owner_arrays(fresh), _owner_arrays(p.owner)
            assert all(np.array_equal(got[n], want[n]) for n in want)
        finally:
            fresh.close()
    finally:
        p.close()


@pytest.mark.parametrize("holder_moved", [False, True])
def test_a_new_agent_sends_deltas_to_the_holder_it_fetched_from_without_a_whole_copy_first(
    pair: Pair, tmp_path: Path, holder_moved: bool
) -> None:
    """After a node loss the new agent's tier is the holder's copy: the next capture goes to it as a delta (no
    512 MB sent back at 1 GB while training resumes). Should the copy have moved meanwhile, the holder refuses the
    delta and gets the whole state: it still ends up exact."""
    rng = np.random.default_rng(9)
    pair.apply({n: Full(a) for n, a in _state(rng).items()}, 1, "t1", None)
    updates, _ = _delta(rng, [1, 2, 3])
    pair.apply(updates, 2, "t2", "t1")
    wait_until(pair.synced, 30, "the copy at t2")

    fresh = ShardKeeper(tmp_path / "new-owner", "ps:0", send_frame=pair.send, read_copy=pair.read).start()
    try:
        assert fresh.pull({"token": "t2", "holder": HOLDER_URL})["status"] == "ok"
        if holder_moved:  # the old owner's last capture reached the holder after the fetch
            pair.apply(_delta(rng, [7])[0], 3, "t3-old", "t2")
            wait_until(pair.synced, 30, "the copy at t3-old")
        updates, _ = _delta(rng, [4, 5])
        answer = fresh.apply_updates(updates, KEYS, step=3, token="t3", parent="t2", copy_to=("ps:1", HOLDER_URL))
        assert answer["status"] == "ok"
        assert fresh.sender is not None
        wait_until(lambda: fresh.sender.status()["synced_token"] == "t3", 30, "the holder at t3")  # type: ignore[union-attr]
        status = fresh.sender.status()
        assert (status["whole"], status["deltas"]) == ((1, 0) if holder_moved else (0, 1)), status
        copy = pair.copy_arrays()
        assert all(np.array_equal(copy[n], a) for n, a in _owner_arrays(fresh).items())
    finally:
        fresh.close()


# ------------------------------------------------------------------------------------------------ the holder alone
def test_the_holder_refuses_frames_of_no_ps_and_asks_for_the_whole_of_what_it_cannot_place() -> None:
    """A frame names its owner (a PS other than the holder); a delta onto a state the holder lacks, or rows of a
    whole copy it never began, get ``need_full``: the owner then sends its whole state."""
    holder = CopyHolder("ps:1")
    rows = np.ones((2, 8), np.float32)
    for owner in ("ps:1", "worker:0", None):
        with pytest.raises(CorruptCheckpointError, match="bad owner"):
            holder.put(encode_frame({"task": owner, "op": "delta"}))
    delta = holder.put(encode_frame({"task": "ps:0", "op": "delta", "parent": "t1", "token": "t2", "step": 2}))
    assert delta["status"] == "need_full" and "the copy holds None" in delta["message"]
    fill = holder.put(encode_frame({"task": "ps:0", "op": "fill", "session": "s", "name": EMB, "start": 0}, [rows]))
    assert fill["status"] == "need_full"
    with pytest.raises(CorruptCheckpointError, match="unknown op"):
        holder.put(encode_frame({"task": "ps:0", "op": "copy"}))
    assert holder.status() == {} and decode_frame(bytes(holder.read({"owner": "ps:0"})))[0]["status"] == "empty"
