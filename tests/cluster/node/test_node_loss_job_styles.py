"""A PS node lost in jobs written as users write them (tests/jobs/, the styles of
tests/cluster/e2e/test_job_styles.py), with peer copies on, under ``psguard wrap``: the agent and its server
killed together, wrap replacing the agent as a cluster manager replaces the pod. Its own folder, so the cluster
tests' scheduler (tests/conftest.py: one lane per folder) runs it beside the e2e lane instead of after it."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import time
from pathlib import Path

import pytest

from psguard.agent.wrap import CHIEF_CONFIG
from psguard.handoff import mapped
from psguard.handoff.client import http_json
from tests.cluster.e2e.test_job_styles import STYLES, check_resumed_and_finished, run_job, with_psguard


def _copy_current(work: Path, token: str) -> bool:
    """The chief's agent says ps:0's peer copy holds the memory tier's newest capture (its acknowledgement)."""
    url = (work / "agents" / "chief" / "url").read_text().strip()
    code, status = http_json("GET", f"{url}/status", token=token)
    part = ((status.get("copies") or {}).get("parts") or {}).get("ps:0") or {}
    return code == 200 and status.get("memory_token") is not None and part.get("token") == status["memory_token"]


def _kill_ps0_node(work: Path, token: str, *, copied: bool) -> int:
    """PS 0's node lost: its agent (memory tier, peer copy) and its server SIGKILLed together; wrap replaces the
    agent as a cluster manager replaces the pod. ``copied``: first wait until the chief's agent has the newest
    capture acknowledged with its peer copy (the capture a node loss must not lose)."""
    deadline = time.monotonic() + 60
    while copied and not _copy_current(work, token):
        assert time.monotonic() < deadline, "ps:0's copy never held the newest capture"
        time.sleep(0.1)
    url = (work / "agents" / "ps0" / "url").read_text().strip()
    code, status = http_json("GET", f"{url}/status", token=token)
    assert code == 200 and status["state"] == "running" and status["pid"] and status["agent_pid"], status
    os.kill(int(status["agent_pid"]), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # gone already with its agent (parent-death signal)
        os.kill(int(status["pid"]), signal.SIGKILL)
    return int(status["pid"])


#: A custom loop and a model.fit job: the node-loss path is the manager's / the callback's, as for a PS kill.
#: Whether the job keeps rows on the PS nodes' agents: the tutorial's embedding has 8 rows (fewer than the
#: capturer's ``row_tracking_min_rows``), so the chief's agent holds all of its state; the TFRS model's
#: 1,501-row movie embedding is captured on its PS nodes, and a lost node's rows come from its peer's copy.
NODE_STYLES = {"tutorial_ctl": False, "tfrs_dcn": True}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NODE_STYLES))
def test_job_style_survives_a_lost_ps_node_from_the_peer_copy(name: str, tmp_path: Path) -> None:
    """PS 0's node lost (its agent and server killed together) in a user's job after the one-line change, with
    peer copies on (``peers: {copies: full}``): the replacement agent takes PS 0's shards from the copy its
    peer holds, not from the durable log, and the job finishes in its newest checkpoint's state."""
    style = STYLES[name]
    store = tmp_path / "store"
    script = tmp_path / "jobs" / Path(style.script).name
    script.parent.mkdir()
    script.write_text(with_psguard(style.source(), fit=style.fit))
    config = tmp_path / "chief.yaml"
    config.write_text(CHIEF_CONFIG.replace("peers: {", "peers: {copies: full, "))
    kill = functools.partial(_kill_ps0_node, copied=NODE_STYLES[name])
    run = run_job(style, script, tmp_path, str(store), store, kill=kill, wrap_args=["--config", str(config)])
    assert "psguard wrap: the agent of ps0 exited -9 while the job ran; starting a replacement (1 of at most 3)" in (
        run.err
    ), run.tail()
    check_resumed_and_finished(style, run, tmp_path, "psguard", store)
    restored = re.findall(r"event=trainer_restored task=chief:0 restored_step=(\d+) source=(\S+)", run.err)
    assert restored and restored[0][1] == "memory", f"restored {restored}: not from the memory tier\n{run.tail()}"
    used = re.findall(r"event=peer_copy_used task=ps:0 holder=(\S+) step=(\d+)", run.err)
    if NODE_STYLES[name]:
        assert used, f"ps:0's shards did not come from a peer's copy\n{run.tail()}"
        assert int(used[0][1]) == int(restored[0][0]), (used, restored)
        # Every PS mapped its shard files (the replaced node's too: fetched into tier files), when the op is built
        # (`make test` builds it); the user's own job restored through the zero-copy path.
        loads = re.findall(
            r"event=trainer_restored task=chief:0 restored_step=\d+ source=\S+ shards_mapped=(\d+)/(\d+)", run.err
        )
        assert loads and int(loads[0][1]) > 0, f"no shard files loaded on the PS nodes\n{run.tail()}"
        if mapped.built() is not None:
            assert loads[0][0] == loads[0][1], f"shard files read, not mapped: {loads}\n{run.tail()}"
    else:
        assert not used, "nothing of this job is kept on the PS nodes: there is no copy to use"
    assert "event=peer_copy_not_used" not in run.err and "event=peer_copy_none" not in run.err, run.tail()
