"""Probes and the health monitor: fakes for the state machine, real sockets and real TF servers for the probes.

The slow tests are the reason the RPC probe exists: a SIGSTOPped ``tf.distribute.Server`` still accepts TCP
connections, and only a deadline on a real RPC notices that it no longer answers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import pytest

from psguard.agent.control.httpd import AgentHTTPServer
from psguard.agent.control.metrics import AgentMetrics
from psguard.agent.process.lifecycle import EventKind, SupervisorEvent
from psguard.agent.process.prober import (
    GrpcStatusProbe,
    Health,
    HealthMonitor,
    HealthReport,
    HttpProbe,
    ProbeResult,
    ProcessProbe,
    TcpProbe,
)
from psguard.agent.process.supervisor import Supervisor
from psguard.ports import free_port, free_ports, wait_port
from tests.support.paths import QUIET, ROOT
from tests.support.processes import allow_new_children, proc_state, wait_until


def server_cmd(port: int, other_port: int) -> list[str]:
    spec = {"ps": [f"127.0.0.1:{port}"], "worker": [f"127.0.0.1:{other_port}"]}
    return [
        sys.executable,
        "-m",
        "psguard.agent.process.tf_server",
        "--cluster-spec",
        json.dumps(spec),
        "--job",
        "ps",
        "--index",
        "0",
    ]


def server_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), **QUIET)


# ------------------------------------------------------------------------------------------ fast: sockets


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port whose kernel completes handshakes into the backlog but nobody ever reads: a frozen server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


def test_tcp_probe_passes_on_a_listener_that_never_answers(silent_listener: int) -> None:
    assert TcpProbe("127.0.0.1", silent_listener).check(1.0).ok
    refused = TcpProbe("127.0.0.1", free_port()).check(1.0)
    assert not refused.ok and refused.code == "refused"


def test_rpc_probe_fails_with_deadline_exceeded_on_a_silent_port(silent_listener: int) -> None:
    probe = GrpcStatusProbe(f"127.0.0.1:{silent_listener}")
    try:
        result = probe.check(0.3)
        assert not result.ok and result.code == "DEADLINE_EXCEEDED"
        assert 0.25 <= result.latency_seconds < 1.0
        assert "frozen" in result.error
    finally:
        probe.close()


def test_rpc_probe_fails_fast_on_a_closed_port() -> None:
    probe = GrpcStatusProbe(f"grpc://127.0.0.1:{free_port()}")
    try:
        result = probe.check(2.0)
        assert not result.ok and result.code == "UNAVAILABLE" and result.latency_seconds < 1.0
    finally:
        probe.close()


def test_rpc_probe_names_a_server_that_is_not_tensorflow() -> None:
    import grpc

    with futures.ThreadPoolExecutor(max_workers=1) as pool:
        server = grpc.server(pool)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        probe = GrpcStatusProbe(f"127.0.0.1:{port}")
        try:
            result = probe.check(2.0)
            assert not result.ok and result.code == "UNIMPLEMENTED"
            assert "tf.distribute.Server" in result.error
        finally:
            probe.close()
            server.stop(None).wait()


def test_process_probe_sees_running_stopped_and_exited() -> None:
    proc = subprocess.Popen(["sleep", "300"])
    try:
        probe = ProcessProbe(lambda: proc.pid)
        assert probe.check(1.0).ok
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: proc_state(proc.pid) == "T", what="stopped")
        assert probe.check(1.0).code == "stopped"
        proc.kill()
        wait_until(lambda: proc_state(proc.pid) == "Z", what="zombie")
        assert probe.check(1.0).code == "exited"
        proc.wait()
        assert probe.check(1.0).code == "no_process"
    finally:
        proc.kill()
        proc.wait()
    assert ProcessProbe(lambda: None).check(1.0).code == "no_process"


def test_http_probe_readyz_token_and_deadline(silent_listener: int) -> None:
    ready = {"task": True}
    token = "t0ken-for-the-http-probe-test"
    with AgentHTTPServer(token=token, readiness=lambda: ready, status=lambda: {"x": 1}) as server:
        assert HttpProbe(server.url + "/readyz").check(1.0).ok
        ready["task"] = False
        failed = HttpProbe(server.url + "/readyz").check(1.0)
        assert not failed.ok and failed.code == "http_503"
        assert HttpProbe(server.url + "/status").check(1.0).code == "http_401"
        authorized = HttpProbe(server.url + "/status", headers={"Authorization": f"Bearer {token}"}).check(1.0)
        assert authorized.ok and token not in authorized.error
    slow = HttpProbe(f"http://127.0.0.1:{silent_listener}/readyz").check(0.3)
    assert not slow.ok and slow.code == "timeout" and slow.latency_seconds < 1.0
    with pytest.raises(ValueError, match="http://"):
        HttpProbe("ftp://example/readyz")


# ------------------------------------------------------------------------------------------ fast: monitor


class Scripted:
    """A probe whose answer the test sets; counts checks and closes."""

    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.ok = True
        self.code = "boom"  # the failure's code: "stopped" or "DEADLINE_EXCEEDED" for a frozen task
        self.checks = 0
        self.closed = 0
        self._lock = threading.Condition()

    def check(self, timeout: float) -> ProbeResult:
        with self._lock:
            self.checks += 1
            ok = self.ok
            self._lock.notify_all()
        return ProbeResult(self.name, ok, 0.001, "ok" if ok else self.code, "" if ok else "scripted failure")

    def close(self) -> None:
        self.closed += 1


class Recorder:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.reports: list[HealthReport] = []
        self.health: list[Health] = []

    def on_unhealthy(self, report: HealthReport) -> None:
        with self.cond:
            self.reports.append(report)
            self.cond.notify_all()

    def on_health(self, task: str, health: Health) -> None:
        with self.cond:
            self.health.append(health)
            self.cond.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout), f"reports={self.reports} health={self.health}"


def test_monitor_goes_unhealthy_after_the_threshold_and_fires_again_while_broken() -> None:
    probe, rec = Scripted(), Recorder()
    monitor = HealthMonitor(
        "ps:0",
        [probe],
        interval=0.02,
        deadline=0.02,
        failure_threshold=3,
        on_unhealthy=rec.on_unhealthy,
        on_health=rec.on_health,
    )
    with monitor:
        rec.wait(lambda: Health.HEALTHY in rec.health)
        probe.ok = False
        rec.wait(lambda: len(rec.reports) >= 2)
        report = rec.reports[0]
        assert report.task == "ps:0" and report.consecutive_failures == 3
        assert report.last is not None and report.last.code == "boom" and "scripted failure" in report.reason
        assert monitor.health is Health.UNHEALTHY and not monitor.healthy
        probe.ok = True
        rec.wait(lambda: rec.health[-1] is Health.HEALTHY)
        assert monitor.status().consecutive_failures == 0
    assert rec.health[:3] == [Health.HEALTHY, Health.UNHEALTHY, Health.HEALTHY]
    assert probe.closed == 1 and monitor.status().health is Health.STOPPED


def test_a_freeze_shorter_than_hung_after_is_waited_out_and_a_longer_one_restarted() -> None:
    """Was: a PS stopped for 3.7 s was restarted after about 2 s, and the recovery cost 10 steps and 7 s where plain
    TF waited the freeze out (explore seed 21 case 1). A frozen task is now declared hung only once frozen for
    ``hung_after`` (about what a restart costs); a failure that is not a freeze is not delayed (the test above)."""
    probe, rec = Scripted(), Recorder()
    probe.code = "stopped"
    monitor = HealthMonitor(
        "ps:0", [probe], interval=0.02, deadline=0.02, failure_threshold=3, hung_after=2.0,
        on_unhealthy=rec.on_unhealthy, on_health=rec.on_health,
    )  # fmt: skip
    with monitor:
        rec.wait(lambda: Health.HEALTHY in rec.health)
        probe.ok = False
        with probe._lock:  # 10 failed rounds, far past the threshold, well within hung_after
            seen = probe.checks
            assert probe._lock.wait_for(lambda: probe.checks >= seen + 10, 1.5)
        probe.ok = True
        rec.wait(lambda: monitor.status().consecutive_failures == 0)
        assert rec.reports == [] and Health.UNHEALTHY not in rec.health  # a short freeze: waited out
        probe.ok = False
        frozen_at = time.monotonic()
        rec.wait(lambda: len(rec.reports) >= 1)
        waited = time.monotonic() - frozen_at
    assert waited >= 2.0, waited
    assert "frozen" in rec.reports[0].reason and rec.reports[0].last is not None
    assert rec.reports[0].last.code == "stopped"


def test_monitor_ignores_failures_while_starting_until_the_startup_timeout() -> None:
    probe, rec = Scripted(), Recorder()
    probe.ok = False
    monitor = HealthMonitor(
        "worker:1",
        [probe],
        interval=0.02,
        deadline=0.02,
        failure_threshold=2,
        startup_timeout=0.5,
        on_unhealthy=rec.on_unhealthy,
    )
    started = time.monotonic()
    with monitor:
        wait_until(lambda: probe.checks >= 5, what="a few failing rounds")
        assert monitor.health is Health.STARTING and not rec.reports
        rec.wait(lambda: len(rec.reports) == 1)
        assert time.monotonic() - started >= 0.5
        assert "startup timeout" in rec.reports[0].reason
        monitor.reset()  # the task was restarted: failures stop counting again
        assert monitor.health is Health.STARTING
        probe.ok = True
        wait_until(lambda: monitor.healthy, what="healthy after restart")
    assert len(rec.reports) == 1


def test_a_round_stops_at_the_first_failing_probe_and_reports_every_result() -> None:
    first, second = Scripted("process"), Scripted("rpc")
    results: list[tuple[str, ProbeResult]] = []
    lock = threading.Lock()

    def on_result(task: str, result: ProbeResult) -> None:
        with lock:
            results.append((task, result))

    first.ok = False
    with HealthMonitor("ps:1", [first, second], interval=0.02, deadline=0.02, on_result=on_result):
        wait_until(lambda: first.checks >= 3, what="rounds")
    assert second.checks == 0
    assert all(task == "ps:1" and r.probe == "process" and not r.ok for task, r in results)


def test_callback_errors_are_logged_and_monitoring_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    probe = Scripted()

    def broken(task: str, result: ProbeResult) -> None:
        raise RuntimeError("metrics bug")

    with HealthMonitor("ps:0", [probe], interval=0.01, deadline=0.01, on_result=broken):
        wait_until(lambda: probe.checks >= 3, what="rounds")
    assert "callback_failed" in caplog.text


def test_monitor_feeds_the_metrics() -> None:
    metrics = AgentMetrics()
    probe = Scripted("rpc")
    monitor = HealthMonitor(
        "ps:0",
        [probe],
        interval=0.01,
        deadline=0.01,
        on_result=metrics.on_probe_result,
        on_health=metrics.on_health,
    )
    with monitor:
        wait_until(lambda: metrics.task_healthy.labels(task="ps:0").value == 1, what="healthy gauge")
        probe.ok = False
        wait_until(lambda: metrics.probe_failures.labels(task="ps:0", probe="rpc").value >= 3, what="failures")
    text = metrics.registry.render()
    assert 'psguard_probe_latency_seconds_count{task="ps:0",probe="rpc"}' in text


@pytest.mark.serial
def test_agent_modules_do_not_import_tensorflow_and_grpc_is_cheap() -> None:
    code = (
        "import time, sys\n"
        "t = time.perf_counter()\n"
        "import psguard.agent.process.supervisor, psguard.agent.process.prober\n"
        "import psguard.agent.control.metrics, psguard.agent.control.httpd\n"
        "p = psguard.agent.process.prober.GrpcStatusProbe('127.0.0.1:1')\n"
        "took = time.perf_counter() - t\n"
        "rss = int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])\n"
        "print(took, rss, 'tensorflow' in sys.modules, 'grpc' in sys.modules)\n"
    )
    took, rss_kb, tf_loaded, grpc_loaded = _python(code).split()
    print(f"agent modules + grpc: import {float(took) * 1000:.0f} ms, RSS {int(rss_kb) / 1024:.0f} MB")
    assert tf_loaded == "False" and grpc_loaded == "True"
    assert float(took) < 2.0 and int(rss_kb) < 150 * 1024


# ------------------------------------------------------------------------------------------ slow: real TF


@pytest.fixture(scope="module")
def tf_server() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """One PS ``tf.distribute.Server`` for the module; tests that freeze it thaw it before they end."""
    port, other = free_ports(2)
    with allow_new_children():
        proc = subprocess.Popen(
            [*server_cmd(port, other), "--parent-pid", str(os.getpid())],
            env=server_env(),
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_port("127.0.0.1", port, 120, what="tf.distribute.Server")
        yield proc, port
    finally:
        proc.kill()
        proc.wait()


def freeze(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    wait_until(lambda: proc_state(proc.pid) == "T", what="server stopped")


@pytest.mark.slow
def test_rpc_probe_answers_a_live_tf_server(tf_server: tuple[subprocess.Popen[bytes], int]) -> None:
    _, port = tf_server
    probe = GrpcStatusProbe(f"127.0.0.1:{port}")
    try:
        results = [probe.check(2.0) for _ in range(50)]
    finally:
        probe.close()
    assert all(r.ok for r in results), results[0]
    warm = [r.latency_seconds for r in results[1:]]
    print(
        f"GetStatus latency: first {results[0].latency_seconds * 1000:.2f} ms, "
        f"median {statistics.median(warm) * 1000:.3f} ms, max {max(warm) * 1000:.3f} ms"
    )
    assert statistics.median(warm) < 0.05


@pytest.mark.slow
def test_a_frozen_tf_server_passes_tcp_but_fails_the_rpc(tf_server: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = tf_server
    rpc = GrpcStatusProbe(f"127.0.0.1:{port}")
    try:
        assert rpc.check(2.0).ok
        freeze(proc)
        try:
            assert TcpProbe("127.0.0.1", port).check(1.0).ok  # the kernel still completes the handshake
            assert ProcessProbe(lambda: proc.pid).check(1.0).code == "stopped"
            result = rpc.check(0.5)
            assert not result.ok and result.code == "DEADLINE_EXCEEDED"
            assert 0.45 <= result.latency_seconds < 1.5
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        wait_until(lambda: rpc.check(1.0).ok, what="rpc answers after SIGCONT")
    finally:
        rpc.close()


@pytest.mark.slow
def test_monitor_detects_a_frozen_tf_server_within_its_bound(
    tf_server: tuple[subprocess.Popen[bytes], int],
) -> None:
    proc, port = tf_server
    interval, deadline, threshold, hung_after = 0.5, 0.5, 3, 3.0
    rec = Recorder()
    # No process probe: the point is that the RPC, not /proc, catches the freeze.
    monitor = HealthMonitor(
        "ps:0",
        [TcpProbe("127.0.0.1", port), GrpcStatusProbe(f"127.0.0.1:{port}")],
        interval=interval,
        deadline=deadline,
        failure_threshold=threshold,
        hung_after=hung_after,
        on_unhealthy=rec.on_unhealthy,
        on_health=rec.on_health,
    )
    with monitor:
        rec.wait(lambda: Health.HEALTHY in rec.health, timeout=30)
        frozen_at = time.monotonic()
        freeze(proc)
        try:
            rec.wait(lambda: len(rec.reports) >= 1, timeout=30)
            detected = time.monotonic() - frozen_at
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        rec.wait(lambda: rec.health[-1] is Health.HEALTHY, timeout=30)
    report = rec.reports[0]
    assert report.last is not None and report.last.probe == "rpc" and report.last.code == "DEADLINE_EXCEEDED"
    # The first failed round ends within interval + deadline of the freeze; from then on hung_after.
    bound = interval + deadline + hung_after + deadline
    print(f"SIGSTOP detected after {detected:.2f}s (hung_after {hung_after}s, bound {bound:.2f}s)")
    assert hung_after <= detected <= bound + 0.5  # slack for a loaded 2-core machine


@pytest.mark.slow
def test_supervisor_and_monitor_restart_a_frozen_tf_server() -> None:
    """The agent's wiring in miniature: a freeze is detected, the task killed and restarted, and serves again."""
    port, other = free_ports(2)
    restarted = threading.Event()
    monitor: HealthMonitor | None = None

    def on_event(event: SupervisorEvent) -> None:
        if event.kind in (EventKind.STARTED, EventKind.RESTARTED) and monitor is not None:
            monitor.reset()
        if event.kind is EventKind.RESTARTED:
            restarted.set()

    sup = Supervisor(server_cmd(port, other), env=server_env(), name="ps:0", on_event=on_event, stop_timeout=5)

    def restart(report: HealthReport) -> None:
        sup.restart(report.reason)

    monitor = HealthMonitor(
        "ps:0",
        [ProcessProbe(lambda: sup.pid), TcpProbe("127.0.0.1", port), GrpcStatusProbe(f"127.0.0.1:{port}")],
        interval=0.5,
        deadline=0.5,
        failure_threshold=3,
        startup_timeout=60,
        hung_after=1.0,
        on_unhealthy=restart,
    )
    try:
        sup.start()
        monitor.start()
        wait_until(lambda: monitor is not None and monitor.healthy, timeout=60, what="server healthy")
        first_pid = sup.pid
        assert first_pid is not None
        frozen_at = time.monotonic()
        os.kill(first_pid, signal.SIGSTOP)
        assert restarted.wait(30), sup.status()
        detected = time.monotonic() - frozen_at
        wait_until(lambda: monitor is not None and monitor.healthy, timeout=60, what="healthy after restart")
        recovered = time.monotonic() - frozen_at
        status = sup.status()
        assert status.pid != first_pid and status.restarts == 1
        assert "stopped" in status.last_reason
        print(f"frozen PS: restarted after {detected:.2f}s, serving again after {recovered:.2f}s")
    finally:
        monitor.stop()
        sup.stop()


def test_a_starting_task_is_seen_healthy_soon_after_it_answers_not_a_whole_interval_later() -> None:
    """While a task starts, failed rounds repeat every STARTING_POLL, not every ``interval``: a new PS's recovery
    waits for its agent to see it healthy. Once healthy (or unhealthy) the configured interval holds again."""
    probe, rec = Scripted(), Recorder()
    probe.ok = False
    monitor = HealthMonitor("ps:0", [probe], interval=5.0, deadline=5.0, on_health=rec.on_health)
    with monitor:
        wait_until(lambda: probe.checks >= 3, 5, "a few failing rounds while starting, well within one interval")
        probe.ok = True
        answered = time.monotonic()
        rec.wait(lambda: Health.HEALTHY in rec.health, timeout=4.0)  # the old pace: 5 s after the last round
        assert time.monotonic() - answered < 4.0
        checks = probe.checks
        probe.ok = False
        time.sleep(0.3)  # a healthy task is probed every interval: no round in this window (asserting an absence)
        assert probe.checks == checks


def test_a_reset_probes_the_new_run_at_once_not_at_the_healthy_schedule() -> None:
    """A healthy PS restarted by a new generation (the monitor reset): its next round comes at once, then every
    STARTING_POLL, not a whole ``interval`` after its last healthy round (the generation waits for the last PS
    to be seen serving: 0.07-0.43 s at interval 0.5, 1 GB bench)."""
    probe, rec = Scripted(), Recorder()
    monitor = HealthMonitor("ps:1", [probe], interval=30.0, deadline=5.0, on_health=rec.on_health)
    with monitor:
        rec.wait(lambda: Health.HEALTHY in rec.health)
        checks = probe.checks
        probe.ok = False  # the restarted run does not answer yet
        monitor.reset()
        wait_until(lambda: probe.checks >= checks + 3, 5, "rounds right after the reset, 30 s before the next due")
        assert monitor.health is Health.STARTING
        probe.ok = True
        rec.wait(lambda: rec.health[-1] is Health.HEALTHY, timeout=5.0)
    assert rec.health == [Health.HEALTHY, Health.STARTING, Health.HEALTHY]


def test_an_agent_loads_nothing_heavy_before_it_starts_its_task() -> None:
    """Every agent's start pays its imports before it starts its task, and a replaced node's agent is on the
    recovery's path: PyJWT and cryptography (~50 ms) load only when an agent is given JWT settings, and the
    task's record (the folder beside the spool's) once loaded the spool, numpy and the store (0.2-0.4 s)."""
    code = (
        "import sys\n"
        "import psguard.agent.daemon, psguard.agent.cli\n"
        "from psguard.agent.config import AgentConfig\n"
        "from psguard.agent.control.auth import TokenAuth\n"
        "from psguard.agent.task import task_record\n"
        "task_record(AgentConfig(), 'ps:0')\n"
        "print(sorted(m for m in ('jwt', 'cryptography', 'numpy', 'psguard.store') if m in sys.modules))\n"
    )
    loaded = _python(code).strip()
    assert loaded == "[]", loaded


def _python(code: str) -> str:
    """What ``code`` prints, run in a fresh interpreter (a module already imported here proves nothing)."""
    return subprocess.run(
        [sys.executable, "-c", code], env=server_env(), capture_output=True, text=True, check=True, timeout=60
    ).stdout
