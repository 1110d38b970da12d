"""The soak's parts without a cluster: its fault schedule, its checkers fed hand-made histories (each must be able
to fail: a leak, a recovery that slows down, retention), and the command's refusals."""

from __future__ import annotations

import itertools
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from psguard.chaos.checkers import check_all
from psguard.chaos.outcomes import fault_outcomes
from psguard.chaos.report import write_report
from psguard.chaos.scenario import ClusterSpec, SoakKind, SoakSpec, load_scenario
from psguard.errors import ConfigError
from tests.support.chaos import H, T
from tests.support.paths import ROOT

SOAK_RUN = {"duration": 600.0, "warmup": 60.0, "state_bytes": 256 << 20,
            "bounds": {"agent_rss_pct_of_state": 1.0, "agent_rss_floor_mb": 8.0, "process_rss_mb": 64.0,
                       "fds": 20.0, "threads": 20.0, "children_max": 4, "tmpfs_mb": 64.0, "store_mb": 1024.0,
                       "store_settle": 660.0, "logs_mb": 64.0,
                       "recovery_slowdown": 2.0, "recovery_noise": 10.0}}  # fmt: skip


# ------------------------------------------------------------------------------------------------ schedule
def test_the_same_seed_replays_the_same_schedule_and_gaps_average_the_mean_interval() -> None:
    spec = SoakSpec(mean_interval=60.0, first_after=30.0, quiet_tail=45.0)
    cluster = ClusterSpec(ps=2, workers=2)
    a, b, c = spec.draw(7, 36_000, cluster), spec.draw(7, 36_000, cluster), spec.draw(8, 36_000, cluster)
    assert a == b and a != c
    times = [f.at_time for f in a if f.at_time is not None]
    assert len(times) == len(a) and times == sorted(times)
    assert times[0] >= 30.0 and times[-1] < 36_000 - 45.0  # nothing in the first or the quiet last seconds
    gaps = [y - x for x, y in itertools.pairwise(times)]
    # exponential gaps of mean 60 s, plus each fault's own duration (1-3 s) before the next gap is drawn
    assert 55.0 < statistics.mean(gaps) < 70.0
    assert {f.target for f in a} >= {"ps:0", "ps:1", "worker:0", "worker:1", "chief"}  # ps:* expands
    assert {f.action for f in a} == {"kill", "kill-agent", "pause"}


def test_the_ci_soak_faults_a_few_times_in_its_five_minutes() -> None:
    scenario = load_scenario(ROOT / "chaos" / "soak-ci.yaml")
    assert scenario.soak is not None
    assert len(scenario.soak.draw(0, 300, scenario.cluster)) >= 3


def test_a_soak_kind_is_checked_when_the_scenario_loads(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'store' for storage-outage"):
        SoakKind("storage-outage", "ps:0")
    base = (ROOT / "chaos" / "soak-ci.yaml").read_text()
    bad = tmp_path / "soak-bad.yaml"
    bad.write_text(base + "    - {action: storage-outage, target: store}\n")
    with pytest.raises(ConfigError, match=r"soak\.kinds\[5\]\.action: expected storage-outage with storage\.kind"):
        load_scenario(bad)


# ------------------------------------------------------------------------------------------------ checkers
def _soak(target: int = 60, *, training: dict[str, Any] | None = None, **soak: Any) -> H:
    """A hand-made soak history: the run record (invoke and ok) says ``soak``, with ``soak`` and ``training``
    settings merged in."""
    h = H(target)
    run = dict(h.records[0].value)
    run.update(soak={**SOAK_RUN, **soak}, target_step=None, training={**run["training"], **(training or {})})
    h.records[0] = replace(h.records[0], value=run)
    h.records[1] = replace(h.records[1], value=run)
    return h


def _sample(h: H, values: dict[str, float], pids: dict[str, int] | None = None) -> None:
    h.op("harness", "resources", {}, {"values": values, **({"pids": pids} if pids is not None else {})})


def _samples(h: H, minutes: int, per_minute: dict[str, float], base: dict[str, float] | None = None) -> None:
    """One sample a minute for ``minutes`` minutes, each series growing by ``per_minute``."""
    for m in range(minutes):
        h.t += 60.0
        _sample(h, {k: (base or {}).get(k, 10.0) + v * m for k, v in per_minute.items()})


def _finished(h: H, step: int) -> H:
    h.op("harness", "finish", {"target_step": step}, {"target_step": step})
    h.train(step - 5, step)
    h.finish()
    return h


def _trained(h: H) -> H:
    h.restore(0, source=None)
    h.commit(0, durable=True)
    h.train(0, 5)
    h.commit(5, durable=True)
    return h


def test_a_leaking_agent_fails_the_soak_and_a_flat_one_passes() -> None:
    flat = _trained(_soak())
    _samples(flat, 20, {"agent:ps0/fds": 0.0, "agent:ps0/rss_bytes": 0.0, "server:ps:0/threads": 0.0})
    verdicts = check_all(_finished(flat, 10).records)
    assert verdicts["resources-bounded"].status == "valid", verdicts["resources-bounded"]
    assert "final-loss" not in verdicts  # no fault-free run of a soak's length to compare with

    leak = _trained(_soak())
    # one more fd a minute: 60 an hour, over the bound of 20; RSS +4 MiB a minute: 240 MiB/h > 1% of 256 MiB
    _samples(leak, 20, {"agent:ps0/fds": 1.0, "agent:ps0/rss_bytes": 4 * 2**20, "server:ps:0/threads": 0.0})
    verdict = check_all(_finished(leak, 10).records)["resources-bounded"]
    assert verdict.status == "invalid"
    assert {r["series"] for r in verdict.evidence["over"]} == {"agent:ps0/fds", "agent:ps0/rss_bytes"}

    # The harness is judged as well (its store proxy kept every socket), but not by its children (the run's).
    harness = _trained(_soak())
    _samples(harness, 20, {"harness/fds": 2.0, "harness/children": 0.0}, base={"harness/children": 9.0})
    verdict = check_all(_finished(harness, 10).records)["resources-bounded"]
    assert verdict.status == "invalid" and [r["series"] for r in verdict.evidence["over"]] == ["harness/fds"]
    assert not verdict.evidence["children_over"]


def test_a_restarts_step_is_not_growth_but_children_past_the_bound_are() -> None:
    h = _trained(_soak())
    for m in range(20):  # threads step up at a restart and back at the next: noise around a flat line
        h.t += 60.0
        _sample(h, {"server:worker0/threads": 100.0 + (16.0 if m % 7 in (3, 4) else 0.0), "agent:ps1/children": 3})
    assert check_all(_finished(h, 10).records)["resources-bounded"].status == "valid"
    h = _trained(_soak())
    _samples(h, 20, {"agent:ps1/children": 0.0}, base={"agent:ps1/children": 6.0})  # flat, but too many
    verdict = check_all(_finished(h, 10).records)["resources-bounded"]
    assert verdict.status == "invalid" and verdict.evidence["children_over"][0]["max"] == 6.0


def test_trainer_and_workers_are_judged_without_the_threads_tensorflow_keeps_per_recovery() -> None:
    """TF keeps 4 threads behind at every in-process recovery's update_server_def, in the trainer and in each
    worker (a cost per fault): the CI soak's trainer and worker climbed +4 at each PS it lost (+175 threads/h).
    Without them the series are flat; a process that keeps 8 per recovery still fails, and so does a PS
    server (restarted at every recovery in a real run: it keeps none)."""
    for extra, status in ((4.0, "valid"), (8.0, "invalid")):
        h = _trained(_soak())  # trainer-100's first restore: its start, not a recovery
        threads = 107.0
        for m in range(20):
            h.t += 30.0
            if m % 4 == 3:  # a PS lost and recovered in the same process every two minutes
                h.restore(0)
                threads += extra
            _sample(h, {"trainer/threads": threads, "server:worker0/threads": threads - 3},
                    {"trainer": 100, "server:worker0": 7})  # fmt: skip
        verdict = check_all(_finished(h, 10).records)["resources-bounded"]
        assert verdict.status == status, (extra, verdict)
        if status == "invalid":
            assert {r["series"] for r in verdict.evidence["over"]} == {"trainer/threads", "server:worker0/threads"}
    h = _trained(_soak())
    for m in range(20):
        h.t += 30.0
        if m % 4 == 3:
            h.restore(0)
        _sample(h, {"server:ps0/threads": 100.0 + 4 * ((m + 1) // 4)})
    assert check_all(_finished(h, 10).records)["resources-bounded"].status == "invalid"


def test_a_restarted_worker_starts_its_count_of_recoveries_again() -> None:
    """A worker killed mid-run starts lean: the threads TF kept in its last life are gone, and its new life
    keeps 4 per recovery from then on. Counted from the run's start instead, its new life would look 12
    threads short and each recovery after it a climb back."""
    h = _trained(_soak())
    for m in range(24):
        h.t += 30.0
        if m % 4 == 3:
            h.restore(0)
        life = 0 if m < 12 else 1
        kept = 4 * (((m + 1) // 4) - (3 if life else 0))
        _sample(h, {"server:worker0/threads": 100.0 + kept}, {"server:worker0": 200 + life})
    verdict = check_all(_finished(h, 10).records)["resources-bounded"]
    assert verdict.status == "valid", verdict
    row = next(r for r in verdict.evidence["series"] if r["series"] == "server:worker0/threads")
    assert abs(row["slope_per_hour"]) < 1.0, row


def test_the_warm_up_is_left_out_of_the_slope() -> None:
    h = _trained(_soak())
    _sample(h, {"agent:chief/rss_bytes": 0.0})  # the first samples climb while the tiers fill
    h.t += 30.0
    _sample(h, {"agent:chief/rss_bytes": 200.0 * 2**20})
    _samples(h, 20, {"agent:chief/rss_bytes": 0.0}, base={"agent:chief/rss_bytes": 200.0 * 2**20})
    assert check_all(_finished(h, 10).records)["resources-bounded"].status == "valid"


def test_the_store_is_judged_once_gc_can_delete_what_the_first_checkpoints_left() -> None:
    """The store grows by its write rate until gc's chunk grace has passed (it may delete no younger unreferenced
    chunk), then retention holds it: that ramp is not growth. Growth after it is."""
    for after, status in ((0.0, "valid"), (200.0 * 2**20, "invalid")):
        h = _trained(_soak())
        _samples(h, 11, {"folder:store/bytes": 400.0 * 2**20})  # 4 GB in the first 11 minutes, as at 1 GB
        _samples(h, 20, {"folder:store/bytes": after}, base={"folder:store/bytes": 4000.0 * 2**20})
        verdict = check_all(_finished(h, 10).records)["resources-bounded"]
        assert verdict.status == status, verdict
    flat_late = _trained(_soak(bounds={**SOAK_RUN["bounds"], "store_settle": 0.0}))  # the ramp fitted too
    _samples(flat_late, 11, {"folder:store/bytes": 400.0 * 2**20})
    _samples(flat_late, 20, {"folder:store/bytes": 0.0}, base={"folder:store/bytes": 4000.0 * 2**20})
    assert check_all(_finished(flat_late, 10).records)["resources-bounded"].status == "invalid"


def _kill_and_recover(h: H, step: int, pause: float) -> None:
    """A PS killed at ``step``; training back ``pause`` seconds later (a restore, then a chunk, then a capture)."""
    h.fault("kill", "ps:0")
    h.rec(T, "invoke", "train", {"step": step, "steps": 5})
    h.rec(T, "info", "train", {"error": "UnavailableError"})
    h.t += pause
    h.restore(step)
    h.train(step, step + 5)
    h.commit(step + 5, durable=False)  # the first capture after the restore: part of the recovery
    for s in range(step + 5, step + 25, 5):
        h.train(s, s + 5)


@pytest.mark.parametrize(("later", "status"), [(3.0, "valid"), (60.0, "invalid")])
def test_a_recovery_much_slower_than_the_first_of_its_kind_fails_the_soak(later: float, status: str) -> None:
    h = _trained(_soak(100))
    for s in range(5, 30, 5):
        h.train(s, s + 5)
    _kill_and_recover(h, 30, 2.0)
    _kill_and_recover(h, 55, later)
    verdict = check_all(_finished(h, 85).records)["recoveries-not-slower"]
    assert verdict.status == status, verdict


def _outage(h: H, seconds: float) -> None:
    h.fault("storage-stop", "store")
    h.t += seconds
    h.op("nemesis", "storage-start", {"target": "store"}, {"target": "store"})


@pytest.mark.parametrize(("overlapping", "status"), [(True, "valid"), (False, "invalid")])
def test_a_fault_during_another_faults_recovery_is_not_judged_by_its_kinds_pace(overlapping: bool, status: str) -> None:
    """The 1-h soak lost ps:0's node (its new agent up at once: the fault's heal) and the store went down a
    second later, before the restore the node loss caused: that restore was given to the outage alone, and the
    outage's 'recovery' (12 s, the node's) judged against the first outage's 0.5 s. A fault is now active until
    healed and training came back, the restore is both faults', and neither is judged for pace."""
    h = _trained(_soak(200))
    for s in range(5, 30, 5):
        h.train(s, s + 5)
    _outage(h, 0.5)  # the first of its kind: training never stopped
    for s in range(30, 50, 5):
        h.train(s, s + 5)
    h.fault("kill-agent", "ps:0")
    h.rec(T, "invoke", "train", {"step": 50, "steps": 5})
    h.rec(T, "info", "train", {"error": "UnavailableError"})
    h.op("nemesis", "start-agent", {"target": "ps:0"}, {"target": "ps:0"})  # the kill-agent's heal
    if not overlapping:  # the node's recovery is over before the outage
        h.t += 2.0
        h.restore(50)
        for s in range(50, 70, 5):
            h.train(s, s + 5)
    h.t += 1.0
    h.fault("storage-stop", "store")
    if overlapping:
        h.t += 1.0
        h.restore(50)
    h.t += 11.0
    h.op("nemesis", "storage-start", {"target": "store"}, {"target": "store"})
    for s in range(50 if overlapping else 70, 120, 5):
        h.train(s, s + 5)
    _outage(h, 0.5)  # a later outage on its own: judged
    for s in range(120, 140, 5):
        h.train(s, s + 5)
    records = _finished(h, 145).records
    rows = fault_outcomes(records)
    node = next(r for r in rows if r["fault"] == "kill-agent")
    outage = [r for r in rows if r["fault"] == "storage-stop"][1]
    if overlapping:
        assert node["restore_shared_with"] == ["storage-stop store"] and node["restored_step"] == 50
        assert outage["overlaps_with"] == ["kill-agent ps:0"]
    else:
        assert not outage["overlaps_with"] and outage["restored_step"] is None
    verdict = check_all(records)["recoveries-not-slower"]
    assert verdict.status == status, verdict


def test_retention_may_delete_old_commits_but_never_the_newest_kept() -> None:
    def history(keep: int | None, drop: int) -> H:
        h = _soak(training={"max_to_keep": keep})
        h.restore(0, source=None)
        for s in range(0, 30, 5):
            h.commit(s, durable=True)
            h.train(s, s + 5)
        h.op("harness", "finish", {"target_step": 30}, {"target_step": 30})
        h.finish(store=[c for c in h.store() if c["step"] != drop])
        return h

    assert check_all(history(2, drop=0).records)["durable-commits-kept"].status == "valid"  # retired by retention
    assert check_all(history(2, drop=25).records)["durable-commits-kept"].status == "invalid"  # the newest
    assert check_all(history(None, drop=0).records)["durable-commits-kept"].status == "invalid"  # keeps all

    # The 5-minute soak: the trainer was killed before it read the answers of commits 30 and 35; retention kept
    # them as the newest, so the acknowledged 20 and 25 went. Not a loss: two newer commits are there.
    h = _soak(training={"max_to_keep": 2})
    h.restore(0, source=None)
    for s in range(0, 40, 5):
        h.commit(s, durable=True, type="ok" if s < 30 else "info")
        h.train(s, s + 5)
    h.op("harness", "finish", {"target_step": 40}, {"target_step": 40})
    unread = [{"id": f"{s:012d}-aaaaaaaa", "step": s, "ok": True, "problems": []} for s in (30, 35)]
    h.finish(store=unread)
    verdict = check_all(h.records)["durable-commits-kept"]
    assert verdict.status == "valid" and verdict.evidence["retired"] == 6, verdict
    h.records[:] = [r for r in h.records if r.f != "final-store"]
    h.op("harness", "final-store", {}, {"checkpoints": unread[1:]})  # one newer commit only: 25 must be there
    assert check_all(h.records)["durable-commits-kept"].status == "invalid"


def test_the_report_sums_up_the_soak_and_plots_its_resources(tmp_path: Path) -> None:
    h = _trained(_soak(bounds={**SOAK_RUN["bounds"], "store_settle": 60.0}))  # ten minutes: judge the store early
    _samples(h, 10, {"agent:ps0/rss_bytes": 0.0, "folder:store/bytes": 1000.0})
    _kill_and_recover(h, 5, 1.0)
    records = _finished(h, 35).records
    report = write_report(tmp_path, records, check_all(records))
    soak: dict[str, Any] = report["soak"]
    assert soak["faults_by_kind"] == {"kill ps": 1} and soak["recoveries"] >= 1
    assert soak["acknowledged_commits_lost"] == 0
    assert {r["series"] for r in soak["resources"]} == {"agent:ps0/rss_bytes", "folder:store/bytes"}
    assert (tmp_path / "resources.png").stat().st_size > 10_000
    assert "## Soak: 10 minutes" in (tmp_path / "report.md").read_text()


# ------------------------------------------------------------------------------------------------ command
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "psguard.cli", "chaos", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip


def test_soak_and_run_refuse_each_others_scenarios() -> None:
    out = _cli("soak", str(ROOT / "chaos" / "kill-ps.yaml"), "--duration", "5m")
    assert out.returncode == 2 and "not a soak scenario" in out.stderr, out.stderr
    out = _cli("run", str(ROOT / "chaos" / "soak-ci.yaml"))
    assert out.returncode == 2 and "run it with psguard chaos soak" in out.stderr, out.stderr
    out = _cli("soak", str(ROOT / "chaos" / "soak-ci.yaml"), "--duration", "30s")
    assert out.returncode == 2 and "shorter than the soak's first_after + quiet_tail" in out.stderr, out.stderr
    out = _cli("soak", str(ROOT / "chaos" / "soak-ci.yaml"), "--duration", "an hour")
    assert out.returncode == 2 and "--duration" in out.stderr, out.stderr


def test_the_soak_refuses_a_duration_without_room_for_a_fault_and_sizes_its_state() -> None:
    from psguard.chaos.soak import check_soak, state_bytes

    big = load_scenario(ROOT / "chaos" / "soak-256mb.yaml")
    assert state_bytes(big) == 256_000_000  # a 1,000,000 x 32 float32 table and its Adagrad slot
    check_soak(big, 3600.0)
    with pytest.raises(ConfigError, match="shorter than the soak's first_after"):
        check_soak(big, 100.0)
    with pytest.raises(ConfigError, match="not a soak scenario"):
        check_soak(load_scenario(ROOT / "chaos" / "kill-ps.yaml"), 3600.0)


# ------------------------------------------------------------------------------------------------ Prometheus
def _watched(
    alerts: list[dict[str, Any]],
    dashboard: dict[str, int],
    bursts: tuple[str, ...] = ("ps:0",),
    windows: dict[str, float] | None = None,
) -> str:
    """The verdict of a soak with three kills of ps:0 a minute apart and this Prometheus record (alert times
    from the soak's start; a ``last`` of None: still firing when the duration ended)."""
    h = _soak(prometheus=True)
    h.restore(0, source=None)
    h.commit(0, durable=True)
    h.train(0, 5)
    start = h.t
    for _ in range(3):
        h.t += 60.0
        h.fault("kill", "ps:0")
        h.train(5, 10)
    h.t += 30.0  # a quiet tail
    end = h.t
    watched: dict[str, Any] = {"dashboard": dashboard, "restart_bursts": list(bursts)}
    watched["alerts"] = [{**a, "first": start + a["first"], "last": end if a["last"] is None else start + a["last"]}
                         for a in alerts]  # fmt: skip
    if windows is not None:
        watched.update(windows=windows, interval=3.0)
    h.op("harness", "finish", {"target_step": 15}, {"target_step": 15})
    h.op("harness", "prometheus", {}, watched)
    h.train(10, 15)
    h.finish()
    return check_all(h.records)["alerts-watched"].status


def test_the_alerts_must_fire_for_repeated_restarts_only_after_a_fault_and_the_dashboard_show_data() -> None:
    restarting = {"alert": "PsguardTaskRestarting", "labels": {"task": "ps:0"}, "first": 150.0, "last": 200.0}
    assert _watched([restarting], {"psguard_task_up": 4}) == "valid"
    assert _watched([], {"psguard_task_up": 4}) == "invalid"  # ps:0 restarted 3 times in 15 minutes, no alert
    assert _watched([], {"psguard_task_up": 4}, bursts=()) == "valid"  # no task did: nothing was meant to fire
    assert _watched([restarting], {"psguard_task_up": 4}, bursts=("ps:0", "ps:1")) == "invalid"  # ps:1's missing
    early = {"alert": "PsguardAgentDown", "labels": {}, "first": 10.0, "last": 20.0}  # before the first fault
    assert _watched([restarting, early], {"psguard_task_up": 4}) == "invalid"
    assert _watched([restarting], {"psguard_task_up": 4, "rate(psguard_probe_failures_total[5m])": 0}) == "invalid"


def test_the_soaks_prometheus_is_the_shipped_scrape_job_pointed_at_the_run(tmp_path: Path) -> None:
    from psguard.chaos.soak import INTEGRATIONS, dashboard_queries, prometheus_config

    config = prometheus_config(["127.0.0.1:1234", "127.0.0.1:1235"], tmp_path / "token", 2.0)
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "psguard" and job["metrics_path"] == "/metrics"  # the shipped job's
    assert job["scheme"] == "http" and "tls_config" not in job and "kubernetes_sd_configs" not in job
    assert job["static_configs"] == [{"targets": ["127.0.0.1:1234", "127.0.0.1:1235"]}]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": str(tmp_path / "token")}
    assert config["rule_files"] == [str(INTEGRATIONS / "alerts.yaml")]
    assert len(dashboard_queries()) >= 10 and "psguard_task_up" in dashboard_queries()


def _await_query(prom: Any, expr: str, ok: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 60
    answer: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        answer = prom.query(expr)
        if ok(answer):
            break
        time.sleep(0.5)  # Prometheus scrapes on its own clock: nothing to await but its answer
    return answer


def test_a_real_prometheus_scrapes_an_agent_with_its_token_and_loads_the_alerts(tmp_path: Path) -> None:
    import secrets

    from psguard.agent.control.httpd import AgentHTTPServer
    from psguard.agent.control.metrics import AgentMetrics
    from psguard.chaos.soak import prometheus_config
    from psguard.testbed.prometheus import PrometheusServer

    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    metrics = AgentMetrics()
    metrics.record_checkpoint("memory", 40, time.time())
    prom = None
    try:
        with AgentHTTPServer(token=token, registry=metrics.registry, status=dict) as agent:
            target = agent.url.removeprefix("http://")
            prom = PrometheusServer(tmp_path / "prom", prometheus_config([target], token_file, 1.0)).start()
            up = _await_query(prom, 'up{job="psguard"}', lambda a: bool(a) and a[0]["value"][1] == "1")
            assert up and up[0]["value"][1] == "1", up  # the token worked: /metrics answered
            groups = prom._get("/api/v1/rules")["groups"]
            names = {r["name"] for g in groups for r in g["rules"]}
            assert {"PsguardTaskRestarting", "PsguardAgentDown", "PsguardPeerCopyLagging"} <= names
            while_up = time.time()
            assert [s["value"][1] for s in prom.query("psguard_last_checkpoint_step")] == ["40"]
        # The agent is gone (as the chief's is once its trainer finished): its series go stale at the next
        # failed scrape, and only a query as of a time it ran still reads them (the soak's dashboard check).
        down = _await_query(prom, 'up{job="psguard"}', lambda a: bool(a) and a[0]["value"][1] == "0")
        assert down and down[0]["value"][1] == "0", down
        assert prom.query("psguard_last_checkpoint_step") == []
        assert [s["value"][1] for s in prom.query("psguard_last_checkpoint_step", at=while_up)] == ["40"]
    finally:
        if prom is not None:
            prom.stop()


def test_a_restart_burst_counts_only_when_its_condition_held_for_two_evaluations() -> None:
    from psguard.chaos.soak import longest_span

    assert longest_span([]) == 0.0
    assert longest_span([[100, "3"]]) == 0.0  # one point: a wobble around 3 the rule may never evaluate
    gap = [[100, "3"], [101, "3"], [102, "3"], [110, "3"], [111, "3"]]
    assert longest_span(gap) == 2.0  # a gap splits the spans
    assert longest_span([[t, "4"] for t in range(200, 207)]) == 6.0


def test_an_alert_still_firing_at_the_end_must_be_explained_by_a_fault_within_its_range() -> None:
    up = {"psguard_task_up": 4}
    windows = {"PsguardTaskRestarting": 900.0}
    restarting = {"alert": "PsguardTaskRestarting", "labels": {"task": "ps:0"}, "first": 150.0, "last": None}
    assert _watched([restarting], up, windows=windows) == "valid"  # its 15-minute range still holds the kills
    assert _watched([restarting], up, windows={"PsguardTaskRestarting": 1.0}) == "invalid"  # the kills left it
    down = {"alert": "PsguardAgentDown", "labels": {}, "first": 70.0, "last": 100.0}
    assert _watched([restarting, down], up, windows=windows) == "valid"  # fired during a fault, then resolved
    stuck = {**down, "last": None}  # a gauge held for a while: must resolve once the faults are healed
    assert _watched([restarting, stuck], up, windows=windows) == "invalid"
    assert _watched([restarting, stuck], up) == "valid"  # a record from before the harness kept the windows


def test_the_store_listing_follows_objects_that_come_and_go_on_a_real_s3(seaweed: Any, unique: str) -> None:
    """Every listing sees the store as it is now: fsspec's cached instance answered from its listing cache, and
    once an object listed before was deleted (by gc), every later listing raised (the soaks' store series stopped
    after the first minute)."""
    import s3fs

    from psguard.chaos.soak import s3_usage

    url = seaweed.url(unique)
    writer = s3fs.S3FileSystem(**seaweed.storage_options, skip_instance_cache=True, use_listings_cache=False)
    root = url.removeprefix("s3://")
    for i in range(3):
        writer.pipe(f"{root}/chunks/a{i}", b"x" * 100)
    assert s3_usage(url, seaweed.storage_options) == (300.0, 3.0)
    for k in range(3):
        writer.pipe(f"{root}/chunks/b{k}", b"y" * 10)
        writer.rm(f"{root}/chunks/a{k}")  # what gc does between two samples
        assert s3_usage(url, seaweed.storage_options) == (200.0 - 100 * k + 10 * (k + 1), 3.0)
    # Objects written and deleted while it lists (a writer's lock files): no sample fails for them.
    stop = threading.Event()

    def churn() -> None:
        n = 0
        while not stop.is_set():
            writer.pipe(f"{root}/locks/l{n}", b"{}")
            writer.rm(f"{root}/locks/l{n}")
            n += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(8):
            size, objects = s3_usage(url, seaweed.storage_options)
            assert (size, objects) in ((30.0, 3.0), (32.0, 4.0))  # the three chunks, and a lock or none
    finally:
        stop.set()
        thread.join()
