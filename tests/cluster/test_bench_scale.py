"""``psguard bench scale``: one tiny point (the PS sweep's point is the state sweep's, reused), and its plot."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from psguard.benchmarks import scale
from psguard.benchmarks.common import parse_size
from psguard.benchmarks.recovery_job import Params
from psguard.benchmarks.scale import METRICS, plot, run_scale, vocab_for


def test_sizes_and_rows() -> None:
    assert [parse_size(t) for t in ("64M", "1G", "2GiB", "512mb", "4096")] == [2**26, 2**30, 2**31, 2**29, 4096]
    with pytest.raises(ValueError):
        parse_size("lots")
    assert vocab_for(2**30, 32) == 2**30 // 256  # table + Adagrad slot, float32


@pytest.mark.slow
def test_bench_scale_smoke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bench_recovery_smoke: tuple[Params, dict[str, Any]]
) -> None:
    """The one point is ``bench recovery``'s smoke job (the same parameters): that job's real run, shared with
    its own smoke test, is what the sweep gets when it asks for exactly that job, once."""
    base, measured = bench_recovery_smoke
    size = base.approx_state_bytes  # vocab_for(size) gives back the job's vocabulary
    asked: list[tuple[Params, int]] = []

    def run(p: Params, runs: int) -> dict[str, Any]:
        asked.append((p, runs))
        return measured

    monkeypatch.setattr(scale, "run", run)
    results = run_scale(base, [size], [2], size, runs=1)
    assert asked == [(base, 1)]  # the state sweep's point is the job; the PS sweep's is the same, reused
    points = results["points"]
    assert [(pt["sweep"], pt["num_ps"]) for pt in points] == [("state", 2), ("ps", 2)]
    assert points[0]["psguard"] == points[1]["psguard"]  # measured once
    for pt in points:
        assert pt["state_bytes"] >= size
        for side in ("psguard", "tf"):
            assert set(pt[side]) == set(METRICS)
            assert pt[side]["recovery_s"] > 0 and pt[side]["restore_s"] > 0, pt
    assert all("node" not in pt for pt in points)  # only asked for
    if importlib.util.find_spec("matplotlib") is not None:
        plot(results, tmp_path / "scale.png")
        assert (tmp_path / "scale.png").stat().st_size > 10_000


@pytest.mark.slow
def test_bench_scale_node_loss_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    bench_recovery_smoke: tuple[Params, dict[str, Any]],
    bench_node_loss_smoke: tuple[Params, dict[str, Any]],
) -> None:
    """``--node-loss``: each point of two PS or more also runs the job with a PS node lost (copies on and off, the
    log on S3) and carries its recovery beside the process fault's; a single PS has no peer to hold its copy."""
    base, measured = bench_recovery_smoke
    _, lost = bench_node_loss_smoke
    size = base.approx_state_bytes
    asked: list[Params] = []

    def run(p: Params, runs: int) -> dict[str, Any]:
        asked.append(p)
        return lost if p.fault == "node" else measured

    monkeypatch.setattr(scale, "run", run)
    results = run_scale(base, [size], [1, 2], size, runs=1, node_loss=True)
    node = replace(base, fault="node", copies="full", store="s3")
    assert asked == [base, node, replace(base, num_ps=1)]  # the 2-PS point's node run reused by the PS sweep
    by = {(pt["sweep"], pt["num_ps"]): pt for pt in results["points"]}
    assert "node" not in by[("ps", 1)]
    for key in (("state", 2), ("ps", 2)):
        n = by[key]["node"]
        assert n["restored_from"] == ["peer"] and n["recovery_s"]["psguard"] == lost["psguard_recovery_s"]
        assert n["recovery_s"]["no_copies"] > 0 and n["recovery_s"]["tf"] > 0
        assert n["recovery_ratio"] == lost["recovery_ratio"]
    if importlib.util.find_spec("matplotlib") is not None:
        plot(results, tmp_path / "scale.png")
        assert (tmp_path / "scale.png").stat().st_size > 10_000
