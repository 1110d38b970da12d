"""``psguard policy check`` / ``simulate`` and the simulation behind it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from psguard import cli
from psguard.policy.engine import EveryInterval, Schedule, YoungDaly
from psguard.policy.files import PRESETS_DIR, preset_names
from psguard.policy.sim import Job, _expected_loss, format_report, simulate
from tests.support.paths import ROOT

HOUR, DAY = 3600.0, 86400.0


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------------------------------ check
def test_check_passes_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    files = [str(p) for p in sorted(PRESETS_DIR.glob("*.yaml"))]
    assert len(files) == 5
    code, out, err = run(["policy", "check", *files], capsys)
    assert code == 0, err
    for f in files:
        assert f"{f}: ok - " in out
    assert "memory     every 30s" in out and "retention  keep the last 5, one every 24h" in out


def test_check_by_preset_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["policy", "check", *preset_names()], capsys)
    assert code == 0 and out.count(": ok") == 5


def test_check_rejects_a_bad_file_naming_file_key_and_expectation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("memory:\n  every: 30s\nretention:\n  keep_last: 0\n")
    code, _, err = run(["policy", "check", str(PRESETS_DIR / "default.yaml"), str(bad)], capsys)
    assert code == cli.EXIT_USAGE
    assert f"{bad}: retention.keep_last: expected a retention that keeps something" in err


def test_check_of_a_symlink_to_a_file_that_is_not_a_policy_quotes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:hunter2-s3cr3t:/root:/bin/bash\n")
    link = tmp_path / "policy.yaml"
    link.symlink_to(secret)
    code, out, err = run(["policy", "check", str(link)], capsys)
    assert code == cli.EXIT_USAGE
    assert f"{link}: (top level): expected a mapping of PolicySpec settings, got a string of 41 characters" in err
    assert "s3cr3t" not in out + err


@pytest.mark.parametrize("cron", ["0 0 31 2 *", "30 12 30 2 *", "0 0 31 4,6,9,11 *"])
def test_check_refuses_a_cron_that_never_fires(tmp_path: Path, capsys: pytest.CaptureFixture[str], cron: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"memory: {{every: 30s}}\ndurable: {{cron: '{cron}'}}\n")
    code, out, err = run(["policy", "check", str(policy)], capsys)
    assert code == cli.EXIT_USAGE and ": ok" not in out
    assert f"{policy}: durable.cron: expected a cron expression that matches a time" in err


def test_show_prints_a_preset_with_its_comments_that_checks_as_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["policy", "show", "default"], capsys)
    assert code == 0 and out.startswith("# psguard default checkpoint policy.")
    copy = tmp_path / "mine.yaml"
    copy.write_text(out)
    code, out, err = run(["policy", "check", str(copy)], capsys)
    assert code == 0, err
    code, _, err = run(["policy", "show", "nonesuch"], capsys)
    assert code == cli.EXIT_USAGE and "no preset named 'nonesuch'; presets: aggressive-memory, default" in err


def test_presets_have_one_home_in_the_package() -> None:
    """The top-level policies/ folder only points at the package data; it holds no second copy."""
    top = ROOT / "policies"
    assert not list(top.glob("*.yaml"))
    assert "psguard/policy/presets" in (top / "README.md").read_text()
    assert PRESETS_DIR.name == "presets" and PRESETS_DIR.parent.name == "policy"


# --------------------------------------------------------------------------------------------- simulate
def test_simulate_json_reports_every_tier_and_the_optimum(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["policy", "simulate", "default", "--mtbf", "6h", "--stall", "0.5s", "--persist", "20s"]
    code, out, err = run([*argv, "--duration", "7d", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    week = 7 * DAY
    tiers = data["tiers"]
    assert tiers["memory"]["saves"] == pytest.approx(week / 30, rel=0.01)
    assert tiers["durable"]["saves"] == pytest.approx(week / 600, rel=0.01)
    assert tiers["base"]["saves"] == pytest.approx(week / HOUR, rel=0.01)
    assert tiers["memory"]["lost_per_failure"] == pytest.approx(15.0, rel=0.05)  # half the interval
    assert tiers["durable"]["lost_per_failure"] == pytest.approx(300 + 20.5, rel=0.02)  # + stall + persist
    assert data["job"]["expected_failures"] == pytest.approx(28.0)
    assert tiers["memory"]["lost_total"] == pytest.approx(28 * tiers["memory"]["lost_per_failure"])
    assert data["total_stall"] == pytest.approx(tiers["memory"]["saves"] * 0.5)
    optimum = data["young_daly_optimum"]["memory"]
    assert optimum["interval"] == pytest.approx(math.sqrt(2 * 0.5 * 6 * HOUR))
    assert optimum["overhead_percent"] < tiers["memory"]["overhead_percent"]  # 30 s is too often for 6 h


def test_simulate_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "out.png"
    argv = ["policy", "simulate", str(PRESETS_DIR / "young-daly.yaml"), "--mtbf", "2h", "--stall", "200ms"]
    code, out, err = run([*argv, "--persist", "10s", "--duration", "1d", "--plot", str(png)], capsys)
    assert code == 0, err
    assert "Young/Daly optimum: tau = sqrt(2 x 200ms x 2h) = 53.7s" in out
    for row in ("memory", "durable", "base"):
        assert any(line.startswith(row) for line in out.splitlines())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_simulate_rejects_bad_durations(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["policy", "simulate", "default", "--mtbf", "six hours", "--stall", "1s", "--persist", "1s"])
    assert exit_.value.code == 2
    assert "--mtbf" in capsys.readouterr().err


def test_simulation_counts_and_losses_by_hand() -> None:
    job = Job(mtbf=HOUR, stall=1.0, persist=0.0, duration=DAY, step_time=0.5)
    result = simulate(Schedule(memory=EveryInterval(60.0)), job)
    memory = result.tier("memory")
    assert memory.saves == int(DAY / 60) - 1  # at 60 s, 120 s, ... up to but not at the end
    assert memory.mean_interval == pytest.approx(60.0)
    assert memory.lost_per_failure == pytest.approx(30.0 + 1.0, rel=0.02)  # state is 1 s older than restorable
    assert result.tier("durable").saves == 0 and result.captures == memory.saves
    assert "memory" in format_report(result)
    # Exact expectation on a tiny timeline: restorable at 10 (state of 9) and 30 (state of 28), over 40 s.
    expected = (10**2 / 2 + ((30 - 9) ** 2 - (10 - 9) ** 2) / 2 + ((40 - 28) ** 2 - (30 - 28) ** 2) / 2) / 40
    assert _expected_loss([(10.0, 9.0), (30.0, 28.0)], 40.0) == pytest.approx(expected)


def test_young_daly_policy_lands_near_the_optimum_in_simulation() -> None:
    job = Job(mtbf=4 * HOUR, stall=0.5, persist=0.0, duration=30 * DAY, step_time=0.1)
    result = simulate(Schedule(memory=YoungDaly(mtbf_prior=20 * 60.0, stall_prior=2.0)), job)
    memory = result.tier("memory")
    best = result.optimum["memory"]
    assert memory.mean_interval is not None
    assert abs(memory.mean_interval - best["interval"]) / best["interval"] < 0.10
    assert memory.overhead_percent is not None and memory.overhead_percent < best["overhead_percent"] * 1.10


def test_job_rejects_impossible_values() -> None:
    with pytest.raises(ValueError, match="mtbf"):
        Job(mtbf=0, stall=1, persist=1, duration=1)
    with pytest.raises(ValueError, match="stall"):
        Job(mtbf=1, stall=-1, persist=1, duration=1)


@pytest.mark.slow
def test_psguard_policy_check_as_a_command() -> None:
    psguard = Path(sys.executable).with_name("psguard")
    done = subprocess.run(
        [str(psguard), "policy", "check", *sorted(str(p) for p in PRESETS_DIR.glob("*.yaml"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": ok") == 5
