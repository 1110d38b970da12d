"""The peer copies over the agents' real HTTP endpoint (psguard.agent.copies): an owner's copy reaches the
holder's server with the shared token, a new agent fetches it back, and nobody without the token reads it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from psguard.agent.control.httpd import AgentHTTPServer
from psguard.agent.copies import PeerLink, copies_status, serve_shards
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.agent.tiers.shards import ShardKeeper
from psguard.errors import PsguardError
from psguard.handoff.client import http_request
from psguard.handoff.parts import ShardKey
from psguard.tensors import Full, Rows
from tests.support.processes import wait_until

NAME = "model/embedding/.ATTRIBUTES/VARIABLE_VALUE"
TIER = f"{NAME}@0:300"
KEYS = {TIER: (ShardKey(NAME, 0, 300), (600, 4))}
TOKEN = "a-token-the-job-shares"


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[ShardKeeper, str]]:
    keeper = ShardKeeper(tmp_path / "holder", "ps:1").start()
    server = AgentHTTPServer(token=TOKEN)
    serve_shards(server, keeper, PeerCopyConfig())
    with server:
        yield keeper, server.url
    keeper.close()


def test_a_copy_travels_over_http_and_comes_back_verified(tmp_path: Path, holder: tuple[ShardKeeper, str]) -> None:
    keeper, url = holder
    link = PeerLink(TOKEN, None)
    owner = ShardKeeper(tmp_path / "owner", "ps:0", send_frame=link.send_frame, read_copy=link.read_copy).start()
    try:
        value = np.random.default_rng(0).normal(size=(300, 4)).astype(np.float32)
        owner.apply_updates({TIER: Full(value)}, KEYS, step=1, token="t1", parent=None, copy_to=("ps:1", url))
        new = np.ones((2, 4), np.float32)
        owner.apply_updates(
            {TIER: Rows(np.array([0, 299]), new, (300, 4))},
            KEYS,
            step=2,
            token="t2",
            parent="t1",
            copy_to=("ps:1", url),
        )
        wait_until(lambda: (owner.status()["copy_out"] or {}).get("synced_token") == "t2", 30, "the copy at t2")
        assert keeper.status()["copies_held"]["ps:0"]["step"] == 2

        value[[0, 299]] = new
        # As the agent wires it: each answer's rows read straight into the new agent's tier files.
        for into in (None, link.read_copy_into):
            fresh = ShardKeeper(
                tmp_path / f"new-owner-{into is None}", "ps:0", read_copy=link.read_copy, read_copy_into=into,
                tier_files=True,
            ).start()  # fmt: skip
            try:
                assert fresh.pull({"token": "t2", "holder": url})["status"] == "ok"
                with fresh.tier.export() as snap:
                    got = np.array(snap.tensors[TIER])
                    assert fresh.files.owns(np.asarray(snap.tensors[TIER]))
                assert np.array_equal(got, value)
                assert fresh.pull({"token": "t3", "holder": url})["status"] == "unavailable"  # no copy at t3
            finally:
                fresh.close()
        out = np.zeros((300, 4), np.float32)
        header = link.read_copy_into(
            url, {"owner": "ps:0", "token": "t2", "name": TIER, "start": 0, "stop": 300}, 5, out
        )
        assert header["status"] == "ok" and np.array_equal(out, value)
        # The rows went out as views of the holder's copy, under a lease released once they were written (by the
        # server's thread, after the client may already hold every byte).
        tier = keeper.holder._copies["ps:0"].tier
        wait_until(lambda: tier.status().leased_arrays == 0, 10, "the read's export lease released")
        moved = link.read_copy_into(
            url, {"owner": "ps:0", "token": "t0", "name": TIER, "start": 0, "stop": 300}, 5, out
        )
        assert moved["status"] == "mismatch" and np.array_equal(out, value)  # an answer without rows: out untouched
    finally:
        owner.close()


def test_copy_data_needs_the_token(holder: tuple[ShardKeeper, str]) -> None:
    _, url = holder
    code, _, _ = http_request("POST", f"{url}/peer-copy/read", data=b'{"owner": "ps:0"}')
    assert code == 401
    with pytest.raises(PsguardError, match="HTTP 401"):
        PeerLink("wrong", None).send_frame(url, b"PSGCOPY1", 5)
    with pytest.raises(PsguardError, match="HTTP 400"):  # authenticated, but not a frame
        PeerLink(TOKEN, None).send_frame(url, b"not a frame", 5)


def test_the_chief_shows_no_copies_when_they_are_off() -> None:
    assert copies_status(None) is None
