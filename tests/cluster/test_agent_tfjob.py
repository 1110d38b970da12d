"""An agent as a Kubeflow TFJob pod runs it: no flags, its task and cluster from the operator's ``TF_CONFIG``.

The operator names every task by its Service (``ctr-42-ps-0.default.svc:2222``), and that Service publishes a pod's
name only once the pod is Ready, which waits for the agent's probes of its server. So the agent must not need its
own name: it probes the built-in server on loopback (the server listens on every interface). Here the PS's own
name cannot resolve at all (``.invalid``), and a real agent still gets a real server ready.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from psguard.ports import free_ports
from tests.support.agents import FAST, AgentProc


@pytest.mark.slow
def test_a_ps_agent_from_tf_config_gets_ready_before_its_own_name_resolves(
    tmp_path: Path, agents: Callable[..., AgentProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    chief, ps0, ps1 = free_ports(3)
    cluster = {
        "chief": [f"ctr-42-chief-0.default.svc.invalid:{chief}"],
        "ps": [f"ctr-42-ps-0.default.svc.invalid:{ps0}", f"ctr-42-ps-1.default.svc.invalid:{ps1}"],
    }
    with pytest.raises(OSError):
        socket.getaddrinfo("ctr-42-ps-1.default.svc.invalid", ps1)  # as in a pod that is not Ready yet
    tf_config = {"cluster": cluster, "task": {"type": "ps", "index": 1}, "environment": "cloud"}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    (tmp_path / "ps1").mkdir()
    (tmp_path / "ps1" / "agent.yaml").write_text(
        FAST + f"state_dir: {tmp_path / 'state'}\nspool: {tmp_path / 'ps1' / 'shards'}\n"  # not in /dev/shm
    )
    agent = agents("ps1", [])  # no --role, --index, --cluster: TF_CONFIG, as the TFJob manifest runs it
    status = agent.wait_status(lambda s: s["ready"], 180, "the PS server ready")
    assert (status["task"], status["address"]) == ("ps:1", cluster["ps"][1])
    probes = {p["probe"]: p for p in status["probes"]}
    assert probes["tcp"]["ok"] and probes["rpc"]["ok"], status["probes"]
