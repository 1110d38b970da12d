"""``psguard bench recovery``: the machinery on a tiny job (one recovery per side), not the figures."""

from __future__ import annotations

import math
from typing import Any

import pytest

from psguard.benchmarks.recovery_job import Params


@pytest.mark.slow
def test_bench_recovery_smoke(bench_recovery_smoke: tuple[Params, dict[str, Any]]) -> None:
    p, results = bench_recovery_smoke  # Params(vocab_size=2_000, embedding_dim=4, batch_size=16, durable_every=10)
    for key in (
        "recovery_ratio",
        "psguard_recovery_s",
        "baseline_recovery_s",
        "chief_peak_rss_growth_ratio",
        "ps_agent_peak_rss_ratio",
        "restore_vs_raw_ratio",
        "psguard_restore_s",
        "baseline_restore_s",
        "restore_gib_per_s",
    ):
        assert isinstance(results[key], float) and math.isfinite(results[key]) and results[key] > 0, (key, results)
    assert 0 <= results["lost_steps_ratio"] < 1, results  # psguard may lose none: a capture at the kill step
    assert results["agents"] is True
    assert results["ps_side_shards"] is True, "the chief's agent did not log event=ps_side_shards"
    assert results["state_bytes"] > 2 * 2_000 * 4 * 4  # the table, its slot and the dense layers
    assert results["ps_shard_bytes"] == {"ps:0": 32_000, "ps:1": 32_000}  # half the table and half its slot each
    assert results["kill_step"] == 19
    assert results["baseline_lost_steps"] == 9  # restored the save at step 10
    assert results["psguard_restored_from"] == ["memory"]
    assert results["psguard_lost_steps"] <= p.memory_every
    assert results["normal_speed_reached"] == {"psguard": [True], "baseline": [True]}


@pytest.mark.slow
def test_bench_recovery_node_loss_smoke(bench_node_loss_smoke: tuple[Params, dict[str, Any]]) -> None:
    """``--fault node`` on a tiny job: PS 0 lost with its agent, a new agent with an empty tier restores from the
    peer's copy, and the same fault with copies off restores from the log; the copy's memory is measured at a
    quiet moment (just before the kill) as well as at its peak, and against the copies-off run."""
    p, results = bench_node_loss_smoke
    assert results["psguard_restored_from"] == ["peer"], results
    assert [r.split(" ")[0] for r in results["psguard_no_copies_restored_from"]] == ["durable"], results
    assert results["psguard_lost_steps"] <= p.memory_every < results["psguard_no_copies_lost_steps"]
    for key in ("recovery_ratio", "recovery_vs_no_copies_ratio", "peer_rss_ratio", "peer_rss_peak_ratio"):
        assert isinstance(results[key], float) and math.isfinite(results[key]), (key, results)
    assert math.isfinite(results["peer_rss_vs_no_copies_ratio"]), results
    assert results["peer_rss_peak_ratio"] >= results["peer_rss_ratio"]  # the peak holds what the quiet moment does


@pytest.mark.slow
def test_bench_recovery_chief_kill_smoke(bench_chief_kill_smoke: tuple[Params, dict[str, Any]]) -> None:
    """``--fault chief`` on a tiny job: psguard's agent starts a new trainer process (its warm standby), which
    restores the memory tier; plain TF's new chief connects to the servers still running and restores its last
    save; and a PS kill of the same job beside it gives ``recovery_vs_ps_kill_ratio``."""
    p, results = bench_chief_kill_smoke
    assert results["fault"] == "chief"
    assert results["psguard_restored_from"] == ["memory"], results
    assert results["psguard_lost_steps"] <= p.memory_every and results["baseline_lost_steps"] == 9
    assert results["normal_speed_reached"] == {"psguard": [True], "baseline": [True]}
    for key in ("recovery_ratio", "recovery_vs_ps_kill_ratio", "psguard_ps_kill_recovery_s"):
        assert isinstance(results[key], float) and math.isfinite(results[key]) and results[key] > 0, (key, results)
    # A new process on each side, TensorFlow imported long since in psguard's (a warm standby): the phases of a
    # process start, not of an in-process rejoin (detect_s, restart_ps_s, close_s are the PS kill's).
    assert set(results["psguard_phases_s"]) == {"start_s", "import_s", "connect_s", "rebuild_s", "restore_s",
                                                "first_step_s"}  # fmt: skip
    assert results["psguard_phases_s"]["import_s"] < 0.5, results["psguard_phases_s"]
    assert {"spawn_s", "import_s", "connect_s"} <= set(results["baseline_phases_s"])
    assert "restart_ps_s" in results["psguard_ps_kill_phases_s"]
