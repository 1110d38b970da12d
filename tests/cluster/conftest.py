"""Fixtures of the tests that start TensorFlow clusters, agents or trainers.

Everything under tests/cluster/ runs in one xdist lane (tests/conftest.py), so these fixtures never run beside
another cluster.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.agents import AgentProc
from tests.support.clusters import Chief, partitioners
from tests.support.processes import allow_new_children


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
        for name, partitioner in partitioners().items():
            strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
            result.strategies[name] = strategy
            result.coordinators[name] = tf.distribute.coordinator.ClusterCoordinator(strategy)
        result.coordinator = result.coordinators["fixed2"]
        yield result
    finally:
        cluster.stop()


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    """Start real ``psguard agent`` processes (``agents(name, args, command)``); stopped after the test."""
    started: list[AgentProc] = []

    def start(
        name: str, args: Sequence[str], command: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> AgentProc:
        agent = AgentProc(tmp_path, name, args, command, env)
        started.append(agent)
        return agent

    yield start
    for agent in reversed(started):
        agent.close()


@pytest.fixture(scope="session")
def bench_recovery_smoke() -> tuple[Any, dict[str, Any]]:
    """One tiny ``psguard bench recovery`` job (one recovery per side): its parameters and results. Its own
    smoke test judges the results; ``bench scale``'s smoke test has one point, and that point is this job."""
    from psguard.benchmarks.recovery import run
    from psguard.benchmarks.recovery_job import Params

    p = Params(vocab_size=2_000, embedding_dim=4, batch_size=16, durable_every=10, timeout=300)
    return p, run(p, runs=1)


@pytest.fixture(scope="session")
def bench_node_loss_smoke() -> tuple[Any, dict[str, Any]]:
    """The same tiny job with PS 0 lost with its node (``--fault node``, peer copies on, then off): judged by its
    own smoke test, and the node-loss line of ``bench scale``'s."""
    from psguard.benchmarks.recovery import run
    from psguard.benchmarks.recovery_job import Params

    p = Params(vocab_size=2_000, embedding_dim=4, batch_size=16, durable_every=10, timeout=300, fault="node",
               copies="full")  # fmt: skip
    return p, run(p, runs=1)


@pytest.fixture(scope="session")
def bench_chief_kill_smoke() -> tuple[Any, dict[str, Any]]:
    """The same tiny job with the chief's trainer killed (``--fault chief``), and a PS kill beside it on psguard's
    side (``--vs-ps-kill``)."""
    from psguard.benchmarks.recovery import run
    from psguard.benchmarks.recovery_job import Params

    p = Params(vocab_size=2_000, embedding_dim=4, batch_size=16, durable_every=10, timeout=300, fault="chief")
    return p, run(p, runs=1, vs_ps_kill=True)
