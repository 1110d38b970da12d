"""``psguard bench follow --evaluators``: the figures it derives from what its evaluator processes report, and how it
reads their reports (the benchmark itself is run by hand: BENCHMARKS.md)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from psguard.benchmarks.follow_evaluators import Side, _Process, ratios, summarize


def test_the_first_evaluation_is_left_out_and_lags_run_from_the_commit_of_the_step_evaluated() -> None:
    commits = {0: 100.0, 1: 110.0, 2: 120.0, 3: 130.0}
    side = Side([(0, 150.0, 10_000), (1, 110.5, 10), (3, 131.5, 30), (3, 140.0, 20)])  # step 2 skipped, 3 twice
    got = summarize(side, commits)
    assert got == {"evaluated": 3.0, "lag_seconds_median": 1.5, "bytes_per_evaluation": 20.0}


def test_an_evaluator_that_evaluated_only_its_first_checkpoint_has_no_figures() -> None:
    got = summarize(Side([(0, 1.0, 5)]), {0: 0.0})
    assert got["evaluated"] == 0 and math.isnan(got["lag_seconds_median"]) and math.isnan(got["bytes_per_evaluation"])


def test_ratios_are_over_tfs_own_checkpoints() -> None:
    figures = {
        "psguard_bytes_per_evaluation": 1.0,
        "publish_bytes_per_evaluation": 90.0,
        "tf_bytes_per_evaluation": 100.0,
        "psguard_lag_seconds_median": 0.5,
        "publish_lag_seconds_median": 2.0,
        "tf_lag_seconds_median": 0.0,
    }
    got = ratios(figures)
    assert got["psguard_vs_tf_bytes_ratio"] == 0.01 and got["publish_vs_tf_bytes_ratio"] == 0.9
    assert math.isnan(got["psguard_vs_tf_lag_ratio"]) and math.isnan(got["publish_vs_tf_lag_ratio"])


def test_a_report_among_the_lines_evaluate_prints_is_read(tmp_path: Path) -> None:
    """``evaluate(verbose=2)`` prints its progress on the same stdout: the reader skipped nothing and died on it."""
    script = "print('4/4 - 0s - loss: 0.69'); print('{\"step\": 1}'); print('1/1 - 0s'); print('{\"step\": 2}')"
    proc = _Process("evaluator", [sys.executable, "-c", script], tmp_path / "evaluator.log")
    proc.ready(timeout=30)
    proc.finish(timeout=30)
    assert proc.lines == [{"step": 1}, {"step": 2}]
