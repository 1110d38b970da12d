"""The end of a job: the chief's agent tells its peers the job is done (``POST /finish``), and they exit 0.

Real ``psguard agent`` processes, as in tests/cluster/test_agent.py: a PS agent running a real ``tf.distribute.Server``
and a chief agent whose trainer exits 0. ``POST /finish`` is a control call: without the agents' token it is
refused and nothing stops. ``stop_exit_code`` (143 on Kubernetes Jobs) is what a signalled agent exits with, so
an evicted pod is not taken for a completed one; a finished one exits 0 regardless.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from psguard.agent.config import AgentConfig
from psguard.agent.daemon import Agent
from psguard.config import loads_yaml
from psguard.errors import ConfigError
from psguard.handoff.client import http_json
from psguard.ports import free_ports
from tests.support.agents import FAST, AgentProc, write_cluster
from tests.support.processes import alive, wait_until

JOB_CONFIG = FAST + "stop_exit_code: 143\n"  # as on Kubernetes Jobs
assert "\npeers: {" in FAST
FINISHING_CONFIG = JOB_CONFIG.replace("\npeers: {", "\npeers: {finish_on_success: true, ")


def test_finish_config_keys_load_and_a_bad_exit_code_is_refused() -> None:
    config = loads_yaml(AgentConfig, "peers: {finish_on_success: true}\nstop_exit_code: 143\n")
    assert config.peers.finish_on_success is True and config.stop_exit_code == 143
    assert loads_yaml(AgentConfig, "{}").peers.finish_on_success is False  # wrap, demo and chaos stop their own
    bad = loads_yaml(AgentConfig, "stop_exit_code: 300\n")
    with pytest.raises(ConfigError, match="stop_exit_code"):
        Agent("ps", 0, {"ps": ["127.0.0.1:2222"]}, config=bad)


@pytest.mark.slow
def test_the_chief_finishing_ends_its_peers_and_finish_needs_the_token(
    tmp_path: Path, agents: Callable[..., AgentProc]
) -> None:
    cluster, _ = write_cluster(tmp_path, ps=1, workers=1)
    for name in ("ps0", "worker0", "chief"):
        (tmp_path / name).mkdir()
        # Its own state folder: agents of other tests on this host may run a ps:0 too.
        (tmp_path / name / "agent.yaml").write_text(FINISHING_CONFIG + f"state_dir: {tmp_path / 'state'}\n")
    ps = agents("ps0", ["--role", "ps", "--index", "0", "--cluster", str(cluster)])
    worker = agents("worker0", ["--role", "worker", "--index", "0", "--cluster", str(cluster)])
    ps_url, worker_url = ps.url, worker.url  # (.url asserts the agent still runs)
    ready = ps.wait_status(lambda s: s["ready"], 120, "the PS server serving")
    server_pid = ready["pid"]

    # A control call: no token, a wrong one -> 401 and the PS serves on; GET is not a route.
    assert http_json("POST", f"{ps.url}/finish", body={"reason": "x"})[0] == 401
    assert http_json("POST", f"{ps.url}/finish", body={"reason": "x"}, token="w" * 32)[0] == 401
    assert http_json("GET", f"{ps.url}/finish", token=ps.token)[0] in (404, 405)
    assert http_json("POST", f"{ps.url}/finish", body=["not", "an", "object"], token=ps.token)[0] == 400
    assert ps.proc.poll() is None and ps.status()["pid"] == server_pid

    # The chief's trainer exits 0: its agent tells the PS agent, which stops its server and exits 0 (not 143).
    args = ["--role", "chief", "--index", "0", "--cluster", str(cluster), "--spool", str(tmp_path / "spool")]
    peers = ["--peer", ps_url, "--peer", worker_url]
    chief = agents("chief", [*args, *peers], [sys.executable, "-c", "print('trained')"])
    assert chief.wait_exit(180) == 0, chief.log()
    assert ps.wait_exit(60) == 0, ps.log()
    assert worker.wait_exit(60) == 0, worker.log()
    assert not alive(server_pid)
    line = next(x for x in chief.log().splitlines() if "event=peers_finished" in x)
    assert json.loads(line.split("outcome=", 1)[1]) == {ps_url: "finished", worker_url: "finished"}
    assert 'event=finish_requested task=ps:0 reason="the job is done: chief:0\'s task exited 0"' in ps.log()
    assert ps.token is not None and ps.token not in chief.log() + ps.log()


@pytest.mark.slow
def test_the_chief_has_no_finish_and_a_signalled_agent_exits_with_stop_exit_code(
    tmp_path: Path, agents: Callable[..., AgentProc]
) -> None:
    """No TensorFlow: a chief alone whose trainer sleeps. SIGTERM -> the configured 143 (an evicted Job pod must
    count as failed); POST /finish is not a chief's route."""
    (tmp_path / "chief").mkdir()
    (tmp_path / "chief" / "agent.yaml").write_text(JOB_CONFIG + f"state_dir: {tmp_path / 'state'}\n")
    spec = tmp_path / "cluster.json"
    (port,) = free_ports(1)
    spec.write_text(json.dumps({"chief": [f"127.0.0.1:{port}"]}))
    args = ["--role", "chief", "--index", "0", "--cluster", str(spec), "--spool", str(tmp_path / "spool")]
    chief = agents("chief", args, [sys.executable, "-c", "import time; time.sleep(600)"])
    chief.wait_status(lambda s: s["pid"] is not None, 60, "the trainer running")
    assert http_json("POST", f"{chief.url}/finish", body={}, token=chief.token)[0] == 404
    chief.proc.send_signal(signal.SIGTERM)
    assert chief.wait_exit(60) == 143, chief.log()
    wait_until(lambda: "event=agent_stopped" in chief.log(), 10, "the agent's last line")
