"""Shared fixtures: leak checks for every test, and real storage servers shared per session.

Every test is checked for leaked threads and child processes (watchdog's conftest does this for threads;
psguard also runs processes). Servers that live for the whole session are started inside
:func:`~tests.support.processes.allow_new_children`, which exempts the processes it creates.

Fixtures only the TF-cluster tests use (the shared ``chief``, ``agents``) are in tests/cluster/conftest.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.fifos import Fifos
from tests.support.processes import ALLOWED_PIDS, allow_new_children, children, cmdline

# Threads that libraries start once per process and keep on purpose.
_ALLOWED_THREAD_PREFIXES = ("fsspecIO", "asyncio_", "pydevd", "Dummy-", "ThreadPoolExecutor-")

#: The folder of the tests that start TensorFlow clusters, agents or trainers (from the repository's root, as
#: xdist's node ids are). Under ``make test`` (``pytest -n 2 --dist loadgroup``) each folder in it is one lane: its
#: tests run one after another in one worker. Two lanes of clusters run at once (of tests/cluster/ itself,
#: tests/cluster/e2e/: whole jobs run through the CLI, tests/cluster/node/: node loss in those jobs,
#: tests/cluster/soak/: the 5-minute soak), the other worker taking every other test once its lane is done. More
#: than two clusters at once overload a 2-core machine and timing-sensitive waits fail.
CLUSTER_DIR = "tests/cluster/"


def cluster_lane(nodeid: str) -> str:
    """The lane of a test: its folder when it is under tests/cluster/, else the test alone."""
    if not nodeid.startswith(CLUSTER_DIR):
        return nodeid
    return nodeid.split("::", 1)[0].rsplit("/", 1)[0] + "/"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with the groups made here, by folder (xdist's own ``xdist_group`` markers do not reach
    its scheduler under pytest 9): every folder under tests/cluster/ is one unit of work, every other test its own.
    xdist hands out the largest units first, so both cluster lanes start at once."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ClusterLanes(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return cluster_lane(nodeid)

    return ClusterLanes(config, log)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    threads_before = set(threading.enumerate())
    children_before = children()
    yield
    deadline = time.monotonic() + 10.0
    while True:
        extra_threads = [
            t
            for t in threading.enumerate()
            if t not in threads_before and t.is_alive() and not t.name.startswith(_ALLOWED_THREAD_PREFIXES)
        ]
        extra_children = children() - children_before - ALLOWED_PIDS
        if not extra_threads and not extra_children:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    names = [t.name for t in extra_threads]
    cmdlines = []
    for pid in sorted(extra_children):
        line = cmdline(pid)
        cmdlines.append(f"{pid}: {line[:200]}" if line else str(pid))
    pytest.fail(f"{request.node.nodeid} leaked threads {names} and/or processes {cmdlines}")


@pytest.fixture
def unique() -> str:
    """A fresh name for a prefix or folder, so tests sharing one server never see each other's objects."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def fifos() -> Iterator[Fifos]:
    """FIFOs a test puts in place of files psguard reads (:class:`~tests.support.fifos.Fifos`)."""
    made = Fifos()
    yield made
    made.close()


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
def gcs() -> Iterator[Any]:
    """A real GCS emulator on a free loopback port: fake-gcs-server, the closer to GCS of the two the package
    registries hold (it refuses a second ``ifGenerationMatch=0`` upload with 412, as GCS does; gcp-storage-emulator
    ignores preconditions and overwrites, so the store's create-if-absent commit could not be tested on it; why in
    full: psguard/testbed/gcs.py)."""
    from psguard.testbed.gcs import FakeGcs

    yield from _session_server(FakeGcs)


@pytest.fixture(scope="session")
def hdfs() -> Iterator[Any]:
    from psguard.testbed.hdfs import HdfsCluster

    yield from _session_server(HdfsCluster)
