"""``psguard bench capture``: the pure helpers, the command line, and one tiny run on the shared cluster."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from psguard.benchmarks import capture as bench
from psguard.benchmarks import capture_keras
from psguard.benchmarks.cli import BENCH_MODULES
from tests.support.clusters import Chief


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


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    return parser.parse_args(["capture", *argv])


def test_keras_option_and_its_knobs() -> None:
    args = parse("--keras", "--rows", "1000", "--dim", "16", "--optimizer", "adam", "--steps-per-execution", "5")
    assert args.keras and (args.rows, args.dim, args.optimizer, args.steps_per_execution) == (1000, 16, "adam", 5)
    plain = parse()
    assert not plain.keras and plain.steps_per_execution == bench.Config.steps_per_execution == 10
    with pytest.raises(SystemExit):
        parse("--keras", "--steps-per-execution", "x")


def test_keras_option_runs_the_fit_benchmark(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")  # cmd sets them when unset: restored after the test
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    seen: list[bench.Config] = []

    def fake(cfg: bench.Config, *, workdir: Path | None = None) -> dict[str, Any]:
        seen.append(cfg)
        return {"stall_ratio": 0.1, "first_save_seconds": 2.0}

    def custom_loop(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise AssertionError("the custom-loop benchmark ran")

    monkeypatch.setattr(capture_keras, "run", fake)
    monkeypatch.setattr(bench, "run", custom_loop)
    assert bench.cmd(parse("--keras", "--json", "--rows", "1000", "--optimizer", "adam", "--runs", "3")) == 0
    assert [(c.rows, c.dim, c.optimizer, c.runs, c.steps_per_execution) for c in seen] == [(1000, 32, "adam", 3, 10)]
    assert json.loads(capsys.readouterr().out)["stall_ratio"] == 0.1


def test_keras_rounds_are_whole_executions_and_bad_settings_fail_first() -> None:
    adam = bench.Config(optimizer="adam")
    assert capture_keras.round_steps(adam) == bench.ADAM_STEPS_PER_ROUND == 10
    assert capture_keras.round_steps(bench.Config(optimizer="adam", steps_per_execution=4)) == 12
    adagrad = bench.Config(rows=2_000_000)
    steps = capture_keras.round_steps(adagrad)
    assert steps % 10 == 0 and bench.steps_per_round(adagrad) <= steps < bench.steps_per_round(adagrad) + 10
    for bad in (bench.Config(steps_per_execution=0), bench.Config(optimizer="ftrl"), bench.Config(ids="zipf")):
        with pytest.raises(ValueError):
            capture_keras.run(bad)  # before any cluster starts


@pytest.mark.slow
def test_keras_tiny_run_on_the_cluster(chief: Chief, tmp_path: Path) -> None:
    cfg = bench.Config(rows=20_000, dim=8, runs=2, batch_size=32, steps_per_execution=2)
    r = capture_keras.run(cfg, strategy=chief.strategies["fixed2"], workdir=tmp_path)
    assert r["stall_ratio"] > 0 and r["psguard_stall_seconds"] > 0 and r["tf_stall_seconds"] > 0
    # tf_keras Adagrad in model.fit: the train function marks the rows it writes, no save hashed every row
    assert r["psguard_saves_hashing_all_rows"] == 0
    assert len(r["rounds"]) == capture_keras.WARM_UP_SAVES + cfg.runs
    assert r["steps_per_round"] % cfg.steps_per_execution == 0
    assert 0 < r["psguard_changed_rows_per_save"] <= 2 * bench.hot_rows(cfg)
    assert r["drain_steps"] > 0 and r["batch_end_with_drain_seconds"] >= r["psguard_stall_seconds"]
    # the first save drained the first executions itself; its stall is the rest (a full base)
    assert 0 < r["first_save_seconds"] < r["first_batch_end_seconds"] and r["tf_first_save_seconds"] > 0
    assert r["first_save_drain_steps"] > 0
    assert r["tf_bytes_per_save"] >= 2 * r["table_bytes"]
    assert list(tmp_path.iterdir()) == []  # checkpoint folders removed


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
