"""Parity copies (psguard.agent.tiers.parity): two owners' tiers (ps:0, ps:1) XORed into one block on a third
agent (ps:2), kept current by XOR deltas, and a lost member rebuilt from it and the survivor's stripe.

Three real ShardKeepers, each behind a real agent HTTP server on loopback with the job's token, talking through
the real PeerLink (frames to ``/peer-copy/put``, the new agent's ``/peer-copy/read``, the holder's fetch of the
survivor's ``/peer-copy/stripe``). A real node loss: tests/cluster/test_ps_side_agents.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.agent.control.httpd import AgentHTTPServer
from psguard.agent.copies import PeerLink, serve_shards
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.agent.tiers.parity import xor_rows
from psguard.agent.tiers.shards import ShardKeeper
from psguard.handoff.parts import ShardKey
from psguard.tensors import Full, Rows, Same
from tests.support.processes import wait_until

TOKEN = "a-token-the-job-shares"
EMB = "model/embedding/.ATTRIBUTES/VARIABLE_VALUE"
SLOT = "optimizer/slot/.ATTRIBUTES/VARIABLE_VALUE"
ROWS = {"ps:0": 500, "ps:1": 300}  # members of different sizes: the parity is as long as the longest stripe
GROUP = "ps:0,ps:1"
CONFIG = PeerCopyConfig(retry_after=0.05, chunk_mb=1)


def _keys(task: str) -> dict[str, tuple[ShardKey, tuple[int, ...]]]:
    n, offset = ROWS[task], 0 if task == "ps:0" else ROWS["ps:0"]
    return {
        f"{EMB}@{offset}:{n}": (ShardKey(EMB, offset, n), (800, 8)),
        f"{SLOT}@{offset}:{n}": (ShardKey(SLOT, offset, n), (800, 8)),
    }


class Trio:
    """ps:0 and ps:1 (a parity group) and ps:2 (the holder of its parity), each an agent on loopback HTTP."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.link = PeerLink(TOKEN, None)
        self.keepers: dict[str, ShardKeeper] = {}
        self.servers: dict[str, AgentHTTPServer] = {}
        for task in ("ps:0", "ps:1", "ps:2"):
            self.start(task)

    def start(self, task: str, folder: Path | None = None) -> ShardKeeper:
        keeper = ShardKeeper(
            folder or self.tmp / task.replace(":", ""),
            task,
            copy_config=CONFIG,
            send_frame=self.link.send_frame,
            read_copy=self.link.read_copy,
            read_stripe=self.link.read_stripe,
        ).start()
        server = AgentHTTPServer(token=TOKEN)
        serve_shards(server, keeper, CONFIG)
        server.start()
        self.keepers[task], self.servers[task] = keeper, server
        return keeper

    def lose(self, task: str) -> None:
        """The member's node is gone: its agent stops answering and its tier is gone."""
        self.servers.pop(task).stop()
        self.keepers.pop(task).close()

    @property
    def holder_url(self) -> str:
        return self.servers["ps:2"].url

    def apply(self, task: str, updates: dict[str, Any], step: int, token: str, parent: str | None) -> dict[str, Any]:
        parity = {"group": ["ps:0", "ps:1"], "urls": {t: s.url for t, s in self.servers.items() if t != "ps:2"}}
        return self.keepers[task].apply_updates(
            updates,
            _keys(task),
            step=step,
            token=token,
            parent=parent,
            copy_to=("ps:2", self.holder_url),
            parity=parity,
        )

    def synced(self, token: str) -> bool:
        return self.holder_status().get("token") == token

    def holder_status(self) -> dict[str, Any]:
        return self.keepers["ps:2"].status()["parity_held"].get(GROUP) or {}

    def parity(self) -> np.ndarray:
        return self.keepers["ps:2"].parity._groups[GROUP].parity

    def close(self) -> None:
        for task in list(self.servers):
            self.lose(task)


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[Trio]:
    t = Trio(tmp_path)
    yield t
    t.close()


def _arrays(keeper: ShardKeeper) -> dict[str, np.ndarray]:
    with keeper.tier.export() as snap:
        return {n: np.array(a) for n, a in snap.tensors.items()}


def _stripe(keeper: ShardKeeper) -> np.ndarray:
    arrays = _arrays(keeper)
    return np.concatenate([arrays[n].reshape(-1).view(np.uint8) for n in sorted(arrays)])


def _expected_parity(*keepers: ShardKeeper) -> np.ndarray:
    stripes = [_stripe(k) for k in keepers]
    out = np.zeros(max(s.size for s in stripes), np.uint8)
    for s in stripes:
        out[: s.size] ^= s
    return out


def _whole(trio: Trio, rng: np.random.Generator, step: int, token: str) -> None:
    for task in ("ps:0", "ps:1"):
        state = {n: Full(rng.normal(size=(ROWS[task], 8)).astype(np.float32)) for n in _keys(task)}
        assert trio.apply(task, dict(state), step, token, None)["status"] == "ok"


def _delta(trio: Trio, rng: np.random.Generator, task: str, step: int, token: str, parent: str) -> None:
    names = sorted(_keys(task))
    ids = np.sort(rng.choice(ROWS[task], 20, replace=False))
    updates: dict[str, Any] = {
        names[0]: Rows(ids, rng.normal(size=(20, 8)).astype(np.float32), (ROWS[task], 8)),
        names[1]: Same((ROWS[task], 8), np.dtype(np.float32)),
    }
    assert trio.apply(task, updates, step, token, parent)["status"] == "ok"


def _run(trio: Trio, steps: int, seed: int) -> str:
    """A whole capture then ``steps - 1`` deltas on both members, the parity current; the last token."""
    rng = np.random.default_rng(seed)
    _whole(trio, rng, 1, "t1")
    for step in range(2, steps + 1):
        for task in ("ps:0", "ps:1"):
            _delta(trio, rng, task, step, f"t{step}", f"t{step - 1}")
    wait_until(lambda: trio.synced(f"t{steps}"), 30, f"the parity at t{steps}")
    return f"t{steps}"


def _pull(trio: Trio, task: str, token: str) -> tuple[dict[str, Any], ShardKeeper]:
    fresh = ShardKeeper(trio.tmp / f"new-{task.replace(':', '')}", task, read_copy=trio.link.read_copy).start()
    return fresh.pull({"token": token, "holder": trio.holder_url}), fresh


def test_xor_rows_is_its_own_inverse_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64, np.int64, np.float16):
        old, new = (rng.normal(size=(7, 3)).astype(dtype) for _ in range(2))
        x = xor_rows(old, new)
        assert x.shape == new.shape and x.dtype == new.dtype
        assert xor_rows(old, x).tobytes() == new.tobytes() and xor_rows(new, x).tobytes() == old.tobytes()


def test_the_parity_is_the_xor_of_the_stripes_and_as_long_as_the_longest(trio: Trio) -> None:
    held: dict[str, int] = {}
    trio.keepers["ps:2"].parity.on_copy = held.__setitem__  # the agent's psguard_peer_copy_held_bytes
    token = _run(trio, 5, seed=1)
    want = _expected_parity(trio.keepers["ps:0"], trio.keepers["ps:1"])
    assert np.array_equal(trio.parity(), want)
    status = trio.holder_status()
    stripes = {t: _stripe(trio.keepers[t]).nbytes for t in ("ps:0", "ps:1")}
    # 500 x 8 x 4 bytes x 2 tensors = 32000 for ps:0, 19200 for ps:1: the parity holds 32000, a full copy of each
    # would hold 51200
    assert status["bytes"] == trio.parity().nbytes == max(stripes.values()) == 32000 < sum(stripes.values()), stripes
    assert status["members"] == {"ps:0": {"step": 5, "token": token}, "ps:1": {"step": 5, "token": token}}
    assert held == {GROUP: 32000}
    assert trio.keepers["ps:2"].status()["copies_held"] == {}  # no full copy next to the parity
    sent = trio.keepers["ps:0"].status()["copy_out"]
    assert sent["whole"] == 1 and sent["deltas"] == 4 and sent["lag_steps"] == 0


@pytest.mark.parametrize("lost", ["ps:0", "ps:1"])
def test_a_lost_member_is_rebuilt_bit_exact_from_the_parity_and_the_survivor(trio: Trio, lost: str) -> None:
    token = _run(trio, 4, seed=2)
    want = _arrays(trio.keepers[lost])
    trio.lose(lost)
    answer, fresh = _pull(trio, lost, token)
    try:
        assert answer["status"] == "ok" and answer["step"] == 4, answer
        got = _arrays(fresh)
        assert got.keys() == want.keys() and all(got[n].tobytes() == want[n].tobytes() for n in want)
        assert fresh.export({"token": token})["status"] == "ok"  # the restore files of the rebuilt shards
        assert trio.keepers["ps:2"].status()["parity_held"]["restores"] == 1
    finally:
        fresh.close()


def test_a_rebuilt_member_sends_deltas_at_once_and_its_group_is_not_reset(trio: Trio) -> None:
    """The new agent of a lost member fetched its state at t3 from the parity, which holds that member at t3: its
    next captures go to the holder as XOR deltas at once. Before, its first send was whole, which resets the
    group: every member sent its whole state again (at 1 GB over 3 PS, 1 GB of traffic right after the recovery,
    and no parity to restore from until it arrived)."""
    rng = np.random.default_rng(8)
    token = _run(trio, 3, seed=8)
    trio.lose("ps:0")
    fresh = trio.start("ps:0", trio.tmp / "new-ps0")  # a new node: an empty tier, another address
    assert fresh.pull({"token": token, "holder": trio.holder_url})["status"] == "ok"
    for step in (4, 5):
        for task in ("ps:0", "ps:1"):
            _delta(trio, rng, task, step, f"t{step}", f"t{step - 1}")
    wait_until(lambda: trio.synced("t5"), 30, "the parity at t5")
    out = fresh.status()["copy_out"]
    assert (out["whole"], out["deltas"]) == (0, 2), out
    assert trio.keepers["ps:1"].status()["copy_out"]["whole"] == 1  # its first, before the loss, only
    assert trio.holder_status()["resets"] == 0
    assert np.array_equal(trio.parity(), _expected_parity(fresh, trio.keepers["ps:1"]))
    want = _arrays(fresh)  # and the parity it kept current rebuilds it again, bit-exact
    trio.lose("ps:0")
    answer, again = _pull(trio, "ps:0", "t5")
    try:
        assert answer["status"] == "ok" and answer["step"] == 5, answer
        assert all(_arrays(again)[n].tobytes() == want[n].tobytes() for n in want)
    finally:
        again.close()


def test_a_damaged_parity_is_refused_and_nothing_is_restored(trio: Trio) -> None:
    token = _run(trio, 3, seed=3)
    trio.parity()[1234] ^= 0x01  # one bit flipped in the holder's memory, no delta since
    trio.lose("ps:0")
    answer, fresh = _pull(trio, "ps:0", token)
    try:
        assert answer["status"] == "refused" and "digest" in answer["message"], answer
        assert fresh.tier.empty and fresh.tier.token is None
        assert trio.keepers["ps:2"].status()["parity_held"]["refused"] == 1
    finally:
        fresh.close()


@pytest.mark.parametrize("ahead", ["ps:0", "ps:1"])
def test_a_member_one_capture_ahead_is_rolled_back_for_the_rebuild(trio: Trio, ahead: str) -> None:
    """One member applied capture t4 (its tier and the parity have it), the other did not, and ps:0's node was
    lost: the chief is at t3. The parity undoes the member's last XOR delta; when that member is the survivor
    (ps:1) its tier undoes t4 for its stripe too, and its own roll-back delta reaching the parity afterwards is
    taken as already applied (no whole state, no reset). ps:0 comes back at t3, bit-exact."""
    rng = np.random.default_rng(4)
    token = _run(trio, 3, seed=4)
    want = _arrays(trio.keepers["ps:0"])
    _delta(trio, rng, ahead, 4, "t4", token)
    wait_until(lambda: trio.holder_status()["members"][ahead]["token"] == "t4", 30, f"{ahead}'s t4 in the parity")
    trio.lose("ps:0")
    answer, fresh = _pull(trio, "ps:0", token)
    try:
        assert answer["status"] == "ok" and answer["step"] == 3, answer
        got = _arrays(fresh)
        assert all(got[n].tobytes() == want[n].tobytes() for n in want)
    finally:
        fresh.close()
    if ahead == "ps:1":
        survivor = trio.keepers["ps:1"]
        assert survivor.tier.token == token and survivor.status()["rollbacks"] == 1
        wait_until(lambda: survivor.status()["copy_out"]["synced_token"] == token, 30, "ps:1's roll-back sent")
        assert trio.holder_status()["resets"] == 0


def test_a_members_whole_resets_the_parity_and_the_other_member_sends_its_whole(trio: Trio) -> None:
    rng = np.random.default_rng(6)
    token = _run(trio, 3, seed=6)
    state = {n: Full(rng.normal(size=(ROWS["ps:0"], 8)).astype(np.float32)) for n in _keys("ps:0")}
    assert trio.apply("ps:0", dict(state), 4, "t4", None)["status"] == "ok"  # a whole capture of ps:0 alone
    status = trio.holder_status()
    assert status["resets"] == 1 and status["members"]["ps:1"] is None and status["token"] is None, status
    # Until ps:1 sent its whole again the parity describes no state: a restore is not served from it.
    answer, fresh = _pull(trio, "ps:1", token)
    fresh.close()
    assert answer["status"] == "unavailable", answer
    _delta(trio, rng, "ps:1", 4, "t4", token)  # answered need_full: ps:1 sends its whole
    wait_until(lambda: trio.synced("t4"), 30, "the parity at t4")
    assert trio.keepers["ps:1"].status()["copy_out"]["whole"] == 2
    assert np.array_equal(trio.parity(), _expected_parity(trio.keepers["ps:0"], trio.keepers["ps:1"]))
    for step in (5, 6):  # and deltas follow
        for task in ("ps:0", "ps:1"):
            _delta(trio, rng, task, step, f"t{step}", f"t{step - 1}")
    wait_until(lambda: trio.synced("t6"), 30, "the parity at t6")
    assert np.array_equal(trio.parity(), _expected_parity(trio.keepers["ps:0"], trio.keepers["ps:1"]))
    assert trio.holder_status()["resets"] == 1
