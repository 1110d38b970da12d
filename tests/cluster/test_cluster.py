"""The local PS cluster testbed: real ``tf.distribute.Server`` processes, killed and restarted alone.

Each test starts its own small cluster and stops it before the leak check runs, so the session-wide
cluster that capture tests share is never disturbed by a kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from psguard.ports import port_open
from psguard.testbed.cluster import ClusterError, LocalCluster
from tests.support.paths import QUIET, ROOT
from tests.support.processes import alive, proc_state


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Processes that are not our children cannot be waited for; poll /proc until they are gone."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left


@pytest.fixture
def small_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(num_ps=1, num_workers=1) as cluster:
        yield cluster


def test_failed_start_stops_everything_and_says_why(tmp_path: Path) -> None:
    cluster = LocalCluster(num_ps=1, num_workers=1, python="/bin/false", log_dir=tmp_path)
    with pytest.raises(ClusterError, match="exited with code 1 before serving"):
        cluster.start()
    assert cluster.pids == {("ps", 0): None, ("worker", 0): None}


def test_spec_and_tf_config_describe_the_same_addresses() -> None:
    cluster = LocalCluster(num_ps=2, num_workers=3)
    spec = cluster.cluster_spec()
    assert len(spec["ps"]) == 2 and len(spec["worker"]) == 3
    assert len(set(spec["ps"] + spec["worker"])) == 5
    config = json.loads(cluster.tf_config(chief_port=1234))
    assert config["cluster"]["chief"] == ["127.0.0.1:1234"]
    assert config["cluster"]["ps"] == spec["ps"]
    assert config["task"] == {"type": "chief", "index": 0}
    with pytest.raises(ValueError, match="no task ps:2"):
        cluster.address("ps", 2)


@pytest.mark.slow
def test_start_kill_restart_stop(small_cluster: LocalCluster) -> None:
    cluster = small_cluster
    pids = cluster.pids
    assert all(pid is not None for pid in pids.values())
    host, port = cluster.address("worker", 0).split(":")
    assert port_open(host, int(port))

    cluster.kill("worker", 0)
    assert not cluster.alive("worker", 0)
    assert cluster.pids[("worker", 0)] is None
    assert not port_open(host, int(port))
    assert cluster.alive("ps", 0), "killing one task must leave the others running"

    cluster.restart("worker", 0)
    assert cluster.alive("worker", 0)
    assert cluster.pids[("worker", 0)] not in (None, pids[("worker", 0)])
    assert port_open(host, int(port)), "a restarted task serves on the same address"

    old = [p for p in cluster.pids.values() if p is not None]
    cluster.stop()
    assert not _wait_gone(old, 0.0)
    assert all(p is None for p in cluster.pids.values())
    cluster.stop()  # idempotent


@pytest.mark.slow
def test_restart_swaps_in_the_warm_standby() -> None:
    with LocalCluster(num_ps=1, num_workers=1, standby=True) as cluster:
        standby = cluster.standby_pids[("ps", 0)]
        old = cluster.pids[("ps", 0)]
        assert standby is not None and old is not None and standby != old
        host, port = cluster.address("ps", 0).split(":")
        cluster.kill("ps", 0)
        cluster.restart("ps", 0)
        assert cluster.pids[("ps", 0)] == standby, "the waiting standby became the task"
        assert port_open(host, int(port))
        assert cluster.standby_pids[("ps", 0)] is None, "the next standby waits for fill_standby()"
        cluster.fill_standby()
        refill = cluster.standby_pids[("ps", 0)]
        assert refill is not None and refill != standby
        waiting = [p for p in cluster.standby_pids.values() if p is not None]
    assert not _wait_gone(waiting, 30.0), "stop() must end the standbys too"


@pytest.mark.slow
def test_sigstop_freezes_without_waiting(small_cluster: LocalCluster) -> None:
    cluster = small_cluster
    pid = cluster.pids[("ps", 0)]
    assert pid is not None
    cluster.kill("ps", 0, signal.SIGSTOP)
    assert proc_state(pid) == "T"
    assert cluster.alive("ps", 0)
    cluster.kill("ps", 0, signal.SIGCONT)
    # stop() must also kill a frozen task: freeze it again and leave it to the fixture.
    cluster.kill("ps", 0, signal.SIGSTOP)


@pytest.mark.slow
def test_servers_die_with_a_sigkilled_parent(tmp_path: Path) -> None:
    """The kernel (PR_SET_PDEATHSIG) kills servers whose parent died without running its clean-up."""
    script = textwrap.dedent(
        """
        import json, sys, threading
        from psguard.testbed.cluster import LocalCluster
        c = LocalCluster(num_ps=1, num_workers=1).start()
        print(json.dumps([p for p in c.pids.values()]), flush=True)
        threading.Event().wait()
        """
    )
    env = {**os.environ, **QUIET, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert parent.stdout is not None
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 2 and all(alive(p) for p in pids)
        parent.kill()
        parent.wait(timeout=30)
        assert not _wait_gone(pids, 30.0), "servers outlived their SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait(timeout=30)


@pytest.mark.slow
def test_chief_in_a_subprocess_trains_on_the_cluster(small_cluster: LocalCluster) -> None:
    """A fresh chief is a fresh process: the TF context a chief connects with is per process."""
    script = textwrap.dedent(
        """
        import tensorflow as tf
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            v = tf.Variable(0, dtype=tf.int64)
        @tf.function
        def step():
            v.assign_add(1)
            return v.read_value()
        for _ in range(5):
            coordinator.schedule(step)
        coordinator.join()
        print("RESULT", int(v.numpy()), v.device, flush=True)
        """
    )
    env = {**os.environ, **QUIET, "PYTHONPATH": str(ROOT), "TF_CONFIG": small_cluster.tf_config()}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    _, value, device = line.split()
    assert int(value) == 5
    assert device.startswith("/job:ps/")
