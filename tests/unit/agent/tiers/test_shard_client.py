"""The chief agent's side of the shard tiers (psguard.agent.tiers.shard_client): where peer copies go, and a
restore that takes a lost PS's shards from its copy or says why not. The PS agents' answers are scripted here;
the same calls over real agents: tests/cluster/test_ps_side_agents.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from psguard.agent.tiers.shard_client import ShardClient
from psguard.agent.tiers.shards import ShardError, StateNotHeldError
from psguard.handoff.parts import PartCapture

PEERS = {"ps:0": "http://a:1", "ps:1": "http://b:1", "ps:2": "http://c:1", "worker:0": "http://w:1"}


def client(nodes: Mapping[str, str | None], placement: Mapping[str, str] | None = None, **kw: Any) -> ShardClient:
    return ShardClient(lambda: PEERS, kw.pop("call", lambda *a: {}), copies="full", placement=placement,
                       nodes=lambda: nodes, **kw)  # fmt: skip


def test_copies_go_to_the_next_ps_on_another_node() -> None:
    ring = client({"ps:0": "n0", "ps:1": "n1", "ps:2": "n2", "worker:0": "n0"})
    assert ring.copy_targets() == {"ps:0": "ps:1", "ps:1": "ps:2", "ps:2": "ps:0"}
    shared = client({"ps:0": "n0", "ps:1": "n0", "ps:2": "n1"})  # ps:0 and ps:1 share a node
    assert shared.copy_targets() == {"ps:0": "ps:2", "ps:1": "ps:2", "ps:2": "ps:0"}
    alone = client({"ps:0": "n0", "ps:1": "n0", "ps:2": "n0"})
    assert alone.copy_targets() == {}  # nowhere else to go: no copy (and a warning)
    placed = client({"ps:0": "n0", "ps:1": "n1", "ps:2": "n2"}, {"ps:0": "ps:2", "ps:1": "ps:1"})
    assert placed.copy_targets() == {"ps:0": "ps:2", "ps:2": "ps:0"}  # ps:1 onto itself is refused
    off = ShardClient(lambda: PEERS, lambda *a: {}, copies="none")
    assert off.copy_targets() == {}


def test_a_lost_ps_takes_its_shards_from_its_copy_else_the_restore_fails_with_the_reason() -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    state = {"pull": "ok"}

    def call(url: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        calls.append((url, dict(body)))
        if url == "http://a:1/shards/export":
            pulled = any(u == "http://a:1/shards/pull" for u, _ in calls) and state["pull"] == "ok"
            return {"status": "ok", "files": []} if pulled else {"status": "empty", "step": None}
        if url.endswith("/shards/export"):
            return {"status": "ok", "files": []}
        if url == "http://a:1/shards/pull":
            return {"status": state["pull"], "step": 7, "message": "the holder's copy lags"}
        raise AssertionError(url)

    c = client({"ps:0": "n0", "ps:1": "n1", "ps:2": "n2"}, call=call)
    assert c.export(["ps:0", "ps:1", "ps:2"], "T") == []
    assert ("http://a:1/shards/pull", {"token": "T", "holder": "http://b:1"}) in calls
    assert c.last_restore_sources["ps:0"] == "peer ps:1" and c.peer_restores == 1

    state["pull"] = "unavailable"
    calls.clear()
    with pytest.raises(ShardError, match="ps:0"):  # the trainer goes to the durable log
        c.export(["ps:0", "ps:1", "ps:2"], "T")


def test_a_restore_after_a_fetch_ahead_says_its_shards_came_from_the_peer() -> None:
    """The chief's agent has a replacement agent fetch its copy as soon as it answers (before the restore asks):
    the restore's export then finds ps:0 at the state, fetches nothing, and still reports where it came from."""
    pulls: list[str] = []

    def call(url: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        if url == "http://a:1/shards/pull":
            pulls.append(str(body["token"]))
            return {"status": "ok", "step": 7}
        if url == "http://a:1/shards/export":
            return {"status": "ok", "files": []} if str(body["token"]) in pulls else {"status": "empty"}
        return {"status": "ok", "files": []}

    c = client({"ps:0": "n0", "ps:1": "n1", "ps:2": "n2"}, call=call)
    c.export(["ps:0"], "T")  # ahead of the restore, for the fresh agent alone
    assert pulls == ["T"]
    c.export(["ps:0", "ps:1", "ps:2"], "T")  # the restore's
    assert pulls == ["T"] and c.peer_restores == 1
    assert c.last_restore_sources == {"ps:0": "peer ps:1", "ps:1": "own tier", "ps:2": "own tier"}
    c.export(["ps:0", "ps:1", "ps:2"], "U")  # another state: not the fetched one
    assert c.last_restore_sources["ps:0"] == "peer ps:1" and pulls == ["T", "U"]


def parity(nodes: Mapping[str, str | None], k: int = 2, **kw: Any) -> ShardClient:
    return ShardClient(lambda: PEERS, kw.pop("call", lambda *a: {}), copies="parity", parity_group=k,
                       nodes=lambda: nodes, **kw)  # fmt: skip


def test_a_parity_group_goes_to_the_first_ps_after_it_on_a_node_no_member_is_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    three = {"ps:0": "n0", "ps:1": "n1", "ps:2": "n2"}
    ring = parity(three)
    assert ring.parity_groups() == [("ps:0", "ps:1"), ("ps:2",)]  # the last group may be smaller
    assert ring.copy_targets() == {"ps:0": "ps:2", "ps:1": "ps:2", "ps:2": "ps:0"}
    assert parity(three, k=3).copy_targets() == {}  # every PS is in the group: nobody outside holds it
    assert "event=parity_unplaced group=ps:0,ps:1,ps:2" in caplog.text
    shared = parity({"ps:0": "n0", "ps:1": "n1", "ps:2": "n1"})  # ps:2 shares ps:1's node
    assert shared.copy_targets() == {"ps:2": "ps:0"}
    assert "event=parity_unplaced group=ps:0,ps:1" in caplog.text
    placed = parity(three, parity_placement={"ps:0,ps:1": "ps:2", "ps:2": "ps:1"})
    assert placed.copy_targets() == {"ps:0": "ps:2", "ps:1": "ps:2", "ps:2": "ps:1"}
    inside = parity(three, parity_placement={"ps:0,ps:1": "ps:1"})  # a member cannot hold its own group's parity
    assert inside.copy_targets() == {"ps:2": "ps:0"}


def test_an_apply_names_the_parity_group_and_a_member_is_held_when_its_whole_group_is() -> None:
    sent: dict[str, Any] = {}

    def call(url: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        task = {u: t for t, u in PEERS.items()}[url.removesuffix("/shards/apply")]
        sent[task] = body
        synced = "T0" if task == "ps:1" else "T"  # ps:1's parity is one capture behind
        holder = body["copy_to"]["task"]
        return {"status": "ok", "copy": {"holder": holder, "step": 1, "token": synced}}

    c = parity({"ps:0": "n0", "ps:1": "n1", "ps:2": "n2"}, call=call)
    parts = [PartCapture(t, f"nonce{i}", ()) for i, t in enumerate(("ps:0", "ps:1", "ps:2"))]
    assert c.apply(parts, step=1, token="T", parent=None) == ("ok", "")
    assert sent["ps:0"]["copy_to"] == {
        "task": "ps:2",
        "url": "http://c:1",
        "parity": {"group": ["ps:0", "ps:1"], "urls": {"ps:0": "http://a:1", "ps:1": "http://b:1"}},
    }
    assert sent["ps:2"]["copy_to"]["parity"] == {"group": ["ps:2"], "urls": {"ps:2": "http://c:1"}}
    # ps:0's own frames reached the parity, but ps:1's did not: the block holds neither at T
    assert c.holders_of(["ps:0", "ps:1", "ps:2"], "T") == {"ps:0": None, "ps:1": None, "ps:2": "ps:0"}
    c.copy_state["ps:1"]["token"] = "T"
    assert c.holders_of(["ps:0", "ps:1", "ps:2"], "T") == {"ps:0": "ps:2", "ps:1": "ps:2", "ps:2": "ps:0"}


@pytest.mark.parametrize("copies", ["full", "parity"])
def test_a_lost_ps_whose_copy_holder_lost_its_memory_too_goes_to_the_log_without_asking(copies: str) -> None:
    """ps:0's copy (full) is on ps:1, its group's parity on ps:2; that holder's agent answers ``empty`` too (its
    node lost with ps:0's): the recovery plan has nothing to fetch, and no pull is asked for."""
    holder = "http://b:1" if copies == "full" else "http://c:1"
    asked: list[str] = []

    def call(url: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        asked.append(url)
        lost = url.startswith(("http://a:1", holder))
        return {"status": "empty", "step": None} if lost else {"status": "ok", "files": []}

    nodes = {"ps:0": "n0", "ps:1": "n1", "ps:2": "n2"}
    c = client(nodes, call=call) if copies == "full" else parity(nodes, call=call)
    with pytest.raises(StateNotHeldError, match="ps:0"):
        c.export(["ps:0", "ps:1", "ps:2"], "T")
    assert not [u for u in asked if u.endswith("/shards/pull")], asked


def test_close_ends_the_fan_out_threads() -> None:
    """The chief's stop closes its ShardClient: the threads that called the PS agents must not outlive it."""
    import threading

    c = ShardClient(lambda: PEERS, lambda *a: {"status": "ok"})
    c.finish(["ps:0", "ps:1"], "000000000001-0000abcd", committed=True)  # the calls run on the client's threads
    workers = [t for t in threading.enumerate() if t.name.startswith("psguard-shards")]
    assert workers
    c.close()
    for t in workers:
        t.join(10)
    assert not any(t.is_alive() for t in workers)
