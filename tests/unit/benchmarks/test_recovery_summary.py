"""The node-loss comparison of ``psguard bench recovery`` (copies on against off), on documents of known runs."""

from __future__ import annotations

from typing import Any

import pytest

from psguard.benchmarks.recovery_summary import compare_no_copies, compare_ps_kill

MB = 1 << 20


def _run(recovery_s: float, steady: dict[str, int], covers: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "recovery_s": recovery_s,
        "lost_steps": 5 if covers else 49,
        "restored_from": "peer" if covers else "durable",
        "steps_per_s": 10.0,
        "settle_wait_s": 2.0 if covers else 1.0,
        "ps_agent_steady_growth_bytes": steady,
        "copies_cover_bytes": covers or {},
    }


def test_the_copys_memory_is_the_holders_quiet_growth_with_copies_on_less_off_over_the_shards_it_covers() -> None:
    # ps:1's copy covers 500 MB of ps:0's shards: 600 MB more than with copies off at the same step (ps:0 was
    # replaced: left out).
    on = _run(4.0, {"ps:0": 1100 * MB, "ps:1": 1200 * MB}, {"ps:0": 512 * MB, "ps:1": 500 * MB})
    off = _run(8.0, {"ps:0": 580 * MB, "ps:1": 600 * MB})
    result = compare_no_copies([on], [off], [4.0])
    assert result["peer_rss_vs_no_copies_ratio"] == pytest.approx(600 / 500)
    assert result["recovery_vs_no_copies_ratio"] == pytest.approx(0.5)
    assert result["psguard_no_copies_lost_steps"] == 49 and result["psguard_no_copies_restored_from"] == ["durable"]
    assert result["goodput_copies_on_vs_off"] == pytest.approx(1.0) and result["first_copy_s"] == pytest.approx(1.0)
    assert result["goodput_steps_per_s_runs"] == {"on": [10.0], "off": [10.0]}


def test_a_parity_blocks_memory_is_counted_over_the_whole_groups_shards() -> None:
    # ps:2 holds the 341 MB block of ps:0 and ps:1 (682 MB of shards): 345 MB more than with copies off.
    on = _run(4.0, {"ps:0": 1, "ps:1": 700 * MB, "ps:2": 1045 * MB}, {"ps:2": 682 * MB})
    off = _run(8.0, {"ps:0": 1, "ps:1": 700 * MB, "ps:2": 700 * MB})
    assert compare_no_copies([on], [off], [4.0])["peer_rss_vs_no_copies_ratio"] == pytest.approx(345 / 682)


def test_no_memory_figure_without_a_quiet_sample_of_both_runs() -> None:
    on = _run(4.0, {"ps:0": 1, "ps:1": 2}, {"ps:1": 500 * MB})
    off = _run(8.0, {"ps:0": 1})  # ps:1's agent was gone when sampled
    assert "peer_rss_vs_no_copies_ratio" not in compare_no_copies([on], [off], [4.0])


def test_a_chief_kills_recovery_is_judged_against_the_ps_kills_beside_it() -> None:
    ps_kill = [
        {"recovery_s": 4.0, "lost_steps": 4, "phases": {"restore_s": 0.5}},
        {"recovery_s": 6.0, "lost_steps": 4, "phases": {"restore_s": 0.7}},
    ]
    result = compare_ps_kill(ps_kill, [9.0, 11.0])
    assert result["recovery_vs_ps_kill_ratio"] == pytest.approx(10.0 / 5.0)
    assert result["psguard_ps_kill_recovery_s_runs"] == [4.0, 6.0] and result["psguard_ps_kill_lost_steps"] == 4
    assert result["psguard_ps_kill_phases_s"] == {"restore_s": 0.6}
