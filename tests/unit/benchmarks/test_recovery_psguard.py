"""psguard's side of ``psguard bench recovery``: the memory figures from what the agents held (a known run)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from psguard.benchmarks.common import RssWatch
from psguard.benchmarks.recovery_job import Params, Records
from psguard.benchmarks.recovery_psguard import Held, memory_figures, recovery_phases
from tests.support.bench_records import job_records

MB = 1 << 20


def watched(start: dict[str, int], peak: dict[str, int]) -> RssWatch:
    rss = RssWatch()
    rss.start_rss.update(start)
    rss.peak.update(peak)
    return rss


RECORDS = Records(
    [
        {"event": "ready", "rss": 100 * MB, "t": 0.0},
        {"event": "restore", "built_rss": 180 * MB, "hwm": 200 * MB, "t": 1.0},
        {"event": "state", "state_bytes": 1000 * MB, "ps_bytes": {"ps:0": 500 * MB, "ps:1": 500 * MB}},
        {"event": "trainer-peak", "hwm": 260 * MB, "t": 9.0},
    ]
)


def test_each_copy_costs_its_holders_growth_beyond_its_own_shards_over_the_shards_it_covers() -> None:
    p = Params(fault="node", copies="full")
    # ps:1 holds its own 500 MB, their 32 MB of fingerprints and a copy of ps:0's 500 MB; grew 1100 MB at its peak
    # and 1050 MB just before the kill.
    held = Held(
        {"ps:0": 0, "ps:1": 500 * MB},
        {"ps:1": 32 * MB},
        {"ps:0": 0, "ps:1": 500 * MB},
        {"ps:0": set(), "ps:1": {"ps:0"}},
    )
    rss = watched(
        {"trainer": 100 * MB, "chief-agent": 50 * MB, "ps1": 40 * MB}, {"chief-agent": 90 * MB, "ps1": 1140 * MB}
    )
    got = memory_figures(p, RECORDS, rss, {"ps:1": 1050 * MB}, held)
    assert got["peer_rss_peak_ratio"] == pytest.approx((1100 - 500 - 32) / 500)
    assert got["peer_rss_ratio"] == pytest.approx((1050 - 500 - 32) / 500)
    assert got["copies_cover_bytes"] == {"ps:0": 0, "ps:1": 500 * MB}
    assert got["copy_overhead_ratio"] == pytest.approx(0.5)
    # ps:0 was replaced with its node: its shards' bytes come from the state record, its growth is not judged.
    assert got["ps_shard_bytes"] == {"ps:0": 500 * MB, "ps:1": 500 * MB}
    assert got["ps_agent_peak_rss_ratio"] == pytest.approx(1100 / 500)
    # The trainer counted from its build (260 - 180 MB) plus its agent (40 MB); with the build from its start.
    assert got["chief_rss_growth_bytes"] == 80 * MB + 40 * MB
    assert got["chief_rss_growth_with_build_bytes"] == 160 * MB + 40 * MB
    assert got["trainer_rss_after_build_bytes"] == 80 * MB


def test_without_copies_nothing_is_charged_to_them_and_ps0s_agent_counts() -> None:
    p = replace(Params(), copies="none")
    held = Held({"ps:0": 500 * MB, "ps:1": 500 * MB}, {}, {"ps:0": 0, "ps:1": 0}, {"ps:0": set(), "ps:1": set()})
    rss = watched({"ps0": 0, "ps1": 0}, {"ps0": 750 * MB, "ps1": 600 * MB})
    got = memory_figures(p, RECORDS, rss, {}, held)
    assert got["copy_overhead_ratio"] is None and got["peer_rss_ratio"] is None
    assert got["ps_agent_peak_rss_ratio"] == pytest.approx(1.5)  # ps:0's 750 MB over its 500 MB


def test_a_new_trainer_process_s_recovery_is_split_at_its_start_its_connection_and_its_restore() -> None:
    """``fault="chief"``: the killed trainer's agent starts a new process (its standby told to go at 3.0,
    TensorFlow imported long since), which connects by 3.5 and builds, restores 4.0-5.0, and steps again at 6.0
    (the known run: the kill at 2.5)."""
    docs = [
        *job_records(),
        {"event": "started", "gen": 0, "t": -5.0},
        {"event": "ready", "gen": 0, "pid": 7, "rss": 1, "t": -4.0},
        {"event": "started", "gen": 1, "t": 3.0},
        {"event": "imported", "gen": 1, "t": 3.1},
        {"event": "ready", "gen": 1, "pid": 8, "rss": 1, "t": 3.5},
    ]
    got = recovery_phases(Records(docs), 2.5, "chief")
    assert got == pytest.approx(
        {"start_s": 0.5, "import_s": 0.1, "connect_s": 0.4, "rebuild_s": 1.5, "restore_s": 1.0, "first_step_s": 1.0}
    )
