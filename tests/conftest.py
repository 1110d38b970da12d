"""Shared fixtures: leak checks for every test, and real storage servers shared per session.

Every test is checked for leaked threads and child processes (watchdog's conftest does this for threads;
psguard also runs processes). Servers that live for the whole session are started inside
:func:`allow_new_children`, which exempts the processes it creates.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from psguard.testbed.procs import descendants

_ALLOWED_PIDS: set[int] = set()
# Threads that libraries start once per process and keep on purpose.
_ALLOWED_THREAD_PREFIXES = ("fsspecIO", "asyncio_", "pydevd", "Dummy-", "ThreadPoolExecutor-")


#: Files whose tests start TensorFlow clusters, agents or trainers. Under ``make test`` (``pytest -n 2 --dist
#: loadgroup``) they run one after another in one worker while the other takes every other file: two clusters at
#: once overload a 2-core machine (load 11, slower than one at a time, and timing-sensitive waits fail).
_CLUSTER_FILES = frozenset(
    {
        "test_agent.py",
        "test_agent_finish.py",
        "test_agent_security.py",
        "test_agent_tfjob.py",
        "test_bench_capture.py",
        "test_bench_recovery.py",
        "test_bench_scale.py",
        "test_capture.py",
        "test_chaos_overlap.py",
        "test_chaos_smoke.py",
        "test_cluster.py",
        "test_demo.py",
        "test_examples.py",
        "test_follower.py",
        "test_hang.py",
        "test_hostile_manifests.py",
        "test_job_styles.py",
        "test_keras_callback.py",
        "test_layout.py",
        "test_manager.py",
        "test_manager_pipeline.py",
        "test_manager_sidecar.py",
        "test_prober.py",
        "test_ps_side.py",
        "test_ps_side_agents.py",
        "test_recovery.py",
        "test_supervisor.py",
        "test_wrap.py",
    }
)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with one group made here, by file (xdist's own ``xdist_group`` markers do not reach
    its scheduler under pytest 9): every test of a cluster file is one unit of work, every other test its own."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ClusterLane(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return "cluster" if name in _CLUSTER_FILES else nodeid

    return ClusterLane(config, log)


def _children(pid: int | None = None) -> set[int]:
    """Every live descendant of ``pid`` (this process by default)."""
    return descendants(os.getpid() if pid is None else pid)


@contextlib.contextmanager
def allow_new_children() -> Iterator[None]:
    """Exempt from leak checks the processes started inside this block (long-lived servers)."""
    before = _children()
    try:
        yield
    finally:
        _ALLOWED_PIDS.update(_children() - before)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    threads_before = set(threading.enumerate())
    children_before = _children()
    yield
    deadline = time.monotonic() + 10.0
    while True:
        extra_threads = [
            t
            for t in threading.enumerate()
            if t not in threads_before and t.is_alive() and not t.name.startswith(_ALLOWED_THREAD_PREFIXES)
        ]
        extra_children = _children() - children_before - _ALLOWED_PIDS
        if not extra_threads and not extra_children:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    names = [t.name for t in extra_threads]
    cmdlines = []
    for pid in sorted(extra_children):
        try:
            cmdlines.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            cmdlines.append(str(pid))
    pytest.fail(f"{request.node.nodeid} leaked threads {names} and/or processes {cmdlines}")


@pytest.fixture
def unique() -> str:
    """A fresh name for a prefix or folder, so tests sharing one server never see each other's objects."""
    return f"t-{uuid.uuid4().hex[:12]}"


# ----------------------------------------------------------------------------------------------- servers
def _session_server(make: Callable[[], Any]) -> Iterator[Any]:
    """Start a server for the whole session (exempt from leak checks) and close it (processes and files)."""
    with allow_new_children():
        server = make()
        server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def seaweed() -> Iterator[Any]:
    from psguard.testbed.s3 import SeaweedS3

    yield from _session_server(SeaweedS3)


@pytest.fixture(scope="session")
def moto() -> Iterator[Any]:
    from psguard.testbed.s3 import MotoS3

    yield from _session_server(MotoS3)


@pytest.fixture(scope="session")
def hdfs() -> Iterator[Any]:
    from psguard.testbed.hdfs import HdfsCluster

    yield from _session_server(HdfsCluster)


# ----------------------------------------------------------------------------------------------- TF cluster
def _partitioners() -> dict[str, Any]:
    import tensorflow as tf

    p = tf.distribute.experimental.partitioners
    return {
        "fixed2": p.FixedShardsPartitioner(2),
        "fixed3": p.FixedShardsPartitioner(3),
        "min": p.MinSizePartitioner(min_shard_bytes=4 << 10, max_shards=4),
        "max": p.MaxSizePartitioner(max_shard_bytes=12 << 10),
        "none": None,
    }


@dataclass
class Chief:
    cluster: Any
    strategies: dict[str, Any] = field(default_factory=dict)
    coordinators: dict[str, Any] = field(default_factory=dict)
    coordinator: Any = None


@pytest.fixture(scope="session")
def chief() -> Iterator[Chief]:
    """A 2-PS, 2-worker cluster; this process is its chief for the session.

    A process has one TF context and can be the chief of one cluster only (a second connection with another
    chief address crashed TF 2.21), so every module shares this one. All strategies (one per partitioner) and
    their coordinators are made here, before any test's leak check starts: a coordinator keeps threads for
    the life of the process, and TF creates one behind the scenes for a strategy that lacks it.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    import tensorflow as tf

    from psguard.testbed.cluster import LocalCluster

    with allow_new_children():
        cluster = LocalCluster(num_ps=2, num_workers=2).start()
    try:
        resolver = cluster.cluster_resolver()
        result = Chief(cluster)
        for name, partitioner in _partitioners().items():
            strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
            result.strategies[name] = strategy
            result.coordinators[name] = tf.distribute.coordinator.ClusterCoordinator(strategy)
        result.coordinator = result.coordinators["fixed2"]
        yield result
    finally:
        cluster.stop()


def lone_chief_agent(tmp_path: Path, store: Path, command: list[str], *extra: str) -> list[str]:
    """argv of a real ``psguard agent --role chief`` with no PS (a cluster of the chief alone), its spool and
    store under ``tmp_path``, running ``command``: for tests of the trainer <-> agent hand-off itself."""
    from psguard.ports import free_ports

    (port,) = free_ports(1)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"chief": [f"127.0.0.1:{port}"]}))
    argv = [sys.executable, "-m", "psguard.cli", "agent", "--role", "chief", "--index", "0", "--cluster", str(cluster)]
    argv += ["--store", str(store), "--spool", str(tmp_path / "spool"), "--http-port", "0", *extra]
    if "--config" not in extra:  # its own state folder: other runs' agents on this machine have the same task names
        config = tmp_path / "lone-agent.yaml"
        config.write_text(f"state_dir: {tmp_path / 'agent-state'}\n")
        argv += ["--config", str(config)]
    return [*argv, "--", *command]


# ----------------------------------------------------------------------------------------------- benchmarks
@pytest.fixture(scope="session")
def bench_recovery_smoke() -> tuple[Any, dict[str, Any]]:
    """One tiny ``psguard bench recovery`` job (one recovery per side): its parameters and results. Its own
    smoke test judges the results; ``bench scale``'s smoke test has one point, and that point is this job."""
    from psguard.benchmarks.recovery import Params, run

    p = Params(vocab_size=2_000, embedding_dim=4, batch_size=16, durable_every=10, timeout=300)
    return p, run(p, runs=1)
