"""TensorFlow's channels honour the reconnect backoff a psguard agent gives every task it starts
(``supervisor.reconnect_backoff``, through ``TF_GRPC_DEFAULT_OPTIONS``): after a call refused by a PS being
restarted, a process reaches the new PS as soon as it serves, not 1 s (0.8-1.2) after the refusal.

Real processes: the agent's built-in PS server, a warm standby of it told to go once the first is killed (a restart
in ~0.1 s, as the agent's), and a TensorFlow client with the environment ``task_env`` gives a task.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest

from psguard.agent.config import AgentConfig
from psguard.agent.process.lifecycle import SupervisorConfig
from psguard.agent.task import task_env
from psguard.handoff.standby import GO, READY_ENV, STANDBY_ENV
from psguard.ports import free_ports
from tests.support.processes import wait_until

pytestmark = pytest.mark.slow

CLIENT = r"""
import json, sys, time
import tensorflow as tf
from tensorflow.python.eager import context

spec = json.loads(sys.argv[1])
tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec), job_name="chief", task_index=0)


def call():
    with tf.device("/job:ps/task:0"):
        return int((tf.constant(1) + 1).numpy())


assert call() == 2
print("ready", flush=True)
sys.stdin.readline()  # the PS is dead now
try:
    call()
    print("not refused", flush=True)
except Exception:
    print("refused", flush=True)
sys.stdin.readline()  # its replacement was told to go
t0 = time.monotonic()
failed = 0
while True:
    try:
        context.context().update_server_def(context.get_server_def())
        assert call() == 2
        break
    except Exception:
        failed += 1
        time.sleep(0.01)
print(f"reached {time.monotonic() - t0:.3f} after {failed} failed tries", flush=True)
"""


def _server(spec: dict[str, list[str]], env: dict[str, str], **kwargs: object) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "psguard.agent.process.tf_server", "--cluster-spec", json.dumps(spec)]
    argv += ["--job", "ps", "--index", "0", "--parent-pid", str(os.getpid())]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]


def _line(stream: IO[str] | None) -> str:
    assert stream is not None
    return stream.readline().strip()


def _seconds_to_reach_a_restarted_ps(tmp_path: Path, backoff: float) -> float:
    """Seconds from the replacement PS's go until a client (with ``task_env``'s environment at ``backoff``) that
    was refused by the dead PS has reset its context and run an op on the new one."""
    ps_port, chief_port = free_ports(2)
    spec = {"ps": [f"127.0.0.1:{ps_port}"], "chief": [f"127.0.0.1:{chief_port}"]}
    config = AgentConfig(supervisor=SupervisorConfig(reconnect_backoff=backoff))
    env = task_env(spec, "chief", 0, url="http://127.0.0.1:9", token_file=None, config=config, spool_dir=None)
    env.pop("TF_CONFIG")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path.cwd()), env.get("PYTHONPATH")]))
    ready = tmp_path / f"standby-{backoff}"
    first = _server(spec, env)
    standby = _server(spec, {**env, STANDBY_ENV: "1", READY_ENV: str(ready)}, stdin=subprocess.PIPE)
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, json.dumps(spec)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert _line(client.stdout) == "ready"
        wait_until(ready.exists, timeout=120, what="the standby imported what it needs")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert client.stdin is not None and standby.stdin is not None
        client.stdin.write("\n")
        client.stdin.flush()
        assert _line(client.stdout) == "refused"
        standby.stdin.write(GO)
        standby.stdin.flush()
        client.stdin.write("\n")
        client.stdin.flush()
        reached = _line(client.stdout)
        assert reached.startswith("reached "), reached
        return float(reached.split()[1])
    finally:
        for proc in (client, first, standby):
            proc.kill()
            proc.wait(timeout=30)


def test_a_task_reaches_a_restarted_ps_once_it_serves_not_after_tensorflows_one_second_backoff(
    tmp_path: Path,
) -> None:
    default = _seconds_to_reach_a_restarted_ps(tmp_path, 0.0)  # TensorFlow's own: 1 s after the refusal
    ours = _seconds_to_reach_a_restarted_ps(tmp_path, 0.05)
    assert default >= 0.6, f"TensorFlow's backoff was {default:.2f}s: the test no longer shows the wait"
    assert ours < default / 2, f"{ours:.2f}s with a 50 ms backoff against {default:.2f}s without"
