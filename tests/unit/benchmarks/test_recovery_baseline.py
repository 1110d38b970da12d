"""The plain-TF side of ``psguard bench recovery``: its figures and the phases of the restart (a known run)."""

from __future__ import annotations

import pytest

from psguard.benchmarks.recovery_baseline import Restart, baseline_figures
from psguard.benchmarks.recovery_job import Params, Records
from tests.support.bench_records import job_records

MB = 1 << 20


def test_the_restart_is_split_into_its_phases_and_each_chief_counts_its_build_peak() -> None:
    docs = job_records()
    for d in docs:
        if d["event"] == "restore":  # the restarted chief's: connected and built from 3.6, restored 4.0-5.0
            d.update(source="tf", built_rss=180 * MB, built_hwm=300 * MB, t0=4.0, t1=5.0)
    docs += [
        {"event": "ready", "gen": 0, "rss": 100 * MB, "t": -1.0},
        {"event": "restore", "gen": 0, "step": 0, "t": 0.0, "t0": 0.0, "t1": 0.0, "build_s": 1.0,
         "built_rss": 170 * MB, "built_hwm": 250 * MB},
        {"event": "failure", "t": 2.7},
        {"event": "trainer-peak", "gen": 0, "hwm": 240 * MB, "t": 2.8},
        {"event": "ready", "gen": 1, "rss": 110 * MB, "t": 3.4},
        {"event": "trainer-peak", "gen": 1, "hwm": 260 * MB, "t": 9.0},
        {"event": "state", "state_bytes": 100 * MB},
    ]  # fmt: skip
    docs.sort(key=lambda d: d.get("t", 0.0))
    got = baseline_figures(Params(memory_every=5, durable_every=10), Records(docs), Restart(2.9, 3.2, 3.5))
    assert got["phases"] == pytest.approx(
        {"detect_s": 0.2, "chief_exit_s": 0.2, "stop_job_s": 0.3, "servers_up_s": 0.3, "chief_start_s": 0.2,
         "connect_build_s": 0.6, "restore_s": 1.0, "first_step_s": 1.0}
    )  # fmt: skip
    assert got["lost_steps"] == 4 and got["state_bytes"] == 100 * MB
    # With its build: each chief's largest peak over its start (the first: 250 - 100; the restarted: 300 - 110).
    assert got["chief_rss_growth_with_build_bytes"] == 190 * MB
    assert got["chief_rss_growth_ratio"] == pytest.approx(got["chief_rss_growth_bytes"] / (100 * MB))


def test_a_killed_chief_is_restarted_alone_and_its_phases_say_where_the_new_ones_time_went() -> None:
    """``fault="chief"``: nothing is stopped; the new chief's start (import), its connection to the servers still
    running and its build are apart."""
    docs = job_records()
    for d in docs:
        if d["event"] == "restore":
            d.update(source="tf", built_rss=180 * MB, built_hwm=300 * MB, t0=4.0, t1=5.0)
    docs += [
        {"event": "ready", "gen": 0, "rss": 100 * MB, "t": -1.0},
        {"event": "restore", "gen": 0, "step": 0, "t": 0.0, "t0": 0.0, "t1": 0.0, "build_s": 1.0,
         "built_rss": 170 * MB, "built_hwm": 250 * MB},
        {"event": "trainer-peak", "gen": 0, "hwm": 240 * MB, "t": 2.45},  # written just before it killed itself
        {"event": "started", "gen": 1, "t": 2.7},
        {"event": "imported", "gen": 1, "t": 3.2},
        {"event": "ready", "gen": 1, "rss": 110 * MB, "t": 3.4},
        {"event": "trainer-peak", "gen": 1, "hwm": 260 * MB, "t": 9.0},
        {"event": "state", "state_bytes": 100 * MB},
    ]  # fmt: skip
    docs.sort(key=lambda d: d.get("t", 0.0))
    p = Params(memory_every=5, durable_every=10, fault="chief")
    got = baseline_figures(p, Records(docs), Restart(2.6, 2.6, 2.6))  # no "failure": the chief died at once
    assert got["phases"] == pytest.approx(
        {"detect_s": 0.1, "chief_start_s": 0.8, "spawn_s": 0.1, "import_s": 0.5, "connect_s": 0.2,
         "connect_build_s": 0.6, "restore_s": 1.0, "first_step_s": 1.0}
    )  # fmt: skip
    assert got["lost_steps"] == 4 and got["chief_rss_growth_with_build_bytes"] == 190 * MB
