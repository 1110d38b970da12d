"""``psguard bench capture``: the pure helpers, the command line, and one tiny run on the shared cluster."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from psguard.benchmarks import capture as bench
from psguard.benchmarks.cli import BENCH_MODULES
from tests.conftest import Chief


def test_steps_for_fraction_draws_enough_distinct_ids() -> None:
    steps = bench.steps_for_fraction(2_000_000, 512, 0.01)
    draws = steps * 512
    assert 0.01 <= 1 - math.exp(-draws / 2_000_000) < 0.0103
    assert bench.steps_for_fraction(100, 10_000, 0.5) == 1
    with pytest.raises(ValueError):
        bench.steps_for_fraction(100, 1, 1.0)


def test_adam_rounds_are_short_and_the_others_cover_the_hot_set() -> None:
    """Adam changes every row of its moments at every step: its rounds need not train to cover the hot set."""
    adagrad = bench.Config(rows=2_000_000)
    assert bench.steps_per_round(adagrad) == bench.steps_for_fraction(20_000, 512, bench.HOT_COVERAGE) > 100
    adam = bench.Config(rows=2_000_000, optimizer="adam")
    assert bench.steps_per_round(adam) == bench.ADAM_STEPS_PER_ROUND < bench.steps_per_round(adagrad)


def test_tf_checkpoint_files_are_those_of_one_save(tmp_path: Path) -> None:
    for name, size in [("ckpt-2.index", 10), ("ckpt-2.data-00000-of-00001", 100), ("ckpt-1.index", 7)]:
        (tmp_path / name).write_bytes(b"x" * size)
    (tmp_path / "checkpoint").write_bytes(b"x" * 5)
    assert bench.files_bytes(bench.tf_checkpoint_files(str(tmp_path / "ckpt-2"))) == 115


def test_registered_with_its_options() -> None:
    assert "psguard.benchmarks.capture" in BENCH_MODULES
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args(["capture", "--json", "--rows", "1000", "--runs", "2", "--overhead-seconds", "3"])
    assert (args.rows, args.dim, args.runs, args.overhead_seconds, args.json) == (1000, 32, 2, 3.0, True)
    assert args.func is bench.cmd


@pytest.mark.slow
def test_tiny_run_on_the_cluster(chief: Chief, tmp_path: Path) -> None:
    cfg = bench.Config(
        rows=20_000,
        dim=8,
        runs=2,
        overhead_seconds=2.0,
        segment_seconds=2.0,
        save_interval=1.0,
        sweep=(0.01, 1.0),
        sweep_runs=1,
        hidden=8,
        batch_size=32,
    )
    r = bench.run(cfg, strategy=chief.strategies["fixed2"], coordinator=chief.coordinator, workdir=tmp_path)
    assert r["table_bytes"] == 20_000 * 8 * 4
    for key in ("stall_ratio", "bytes_ratio", "psguard_stall_seconds", "tf_stall_seconds", "steps_per_s_no_saves"):
        assert r[key] > 0, key
    assert math.isfinite(r["overhead_pct"])
    # tf_keras Adagrad writes only the rows of its sparse gradients: no steady-state save hashed every row,
    # and the one measured save that did cost more
    assert r["psguard_saves_hashing_all_rows"] == 0
    assert r["psguard_verify_stall_seconds"] > 0 and r["stall_ratio_amortized"] > 0
    # ~1% of the embedding changed per round; the delta is small, TF wrote everything (table + accumulator).
    assert 0.002 < r["changed_fraction_per_save"] < 0.05
    assert r["tf_bytes_per_save"] >= 2 * r["table_bytes"]
    assert r["bytes_ratio"] < 0.5
    assert r["ps_to_chief_bytes_per_capture"] < r["table_bytes"]
    # at 100% changed rows the table comes whole to the chief
    assert r["sweep"]["100pct"]["changed_rows"] == 20_000
    assert r["sweep"]["100pct"]["ps_to_chief_bytes"] >= r["table_bytes"]
    # the PS-side capture of the same states: the rows stay on the PS nodes, only counts reach the chief
    assert r["ps_side_stall_seconds_at_100pct"] > 0 and r["ps_side_stall_ratio_at_100pct"] > 0
    assert r["ps_side_to_chief_bytes_at_100pct"] < r["table_bytes"] / 100
    assert r["overhead_saves"] == 2 and r["overhead_idle_pct"] > 0
    assert set(r["spread"]) >= {"stall_ratio", "bytes_ratio", "overhead_pct_per_pair"}
    assert list(tmp_path.iterdir()) == []  # checkpoint folders removed
