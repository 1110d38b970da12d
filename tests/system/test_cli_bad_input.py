"""The CLI given bad arguments, as a user runs it (real processes): usage errors exit 2, missing things exit 4,
nothing hangs, loops for hours or prints a traceback (issue 13, item 7).

Each case starts ``psguard`` (10 s or more on a loaded machine), so the processes are ``slow``; the fast suite
covers the same inputs in-process through ``tests/system/test_fuzz_hostile_input.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from psguard import cli
from psguard.store import Store
from tests.support.paths import ROOT


def psguard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "psguard.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,  # a hang fails the test here
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    with Store.open(url) as s:
        for step in range(0, 400, 10):
            s.save(step, {"w": np.full(3, step, np.float32)})
    return url


def assert_usage(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == cli.EXIT_USAGE, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    for w in words:
        assert w in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("hours", ["0", "-1", "nan", "inf"])
def test_gc_keep_every_hours_must_be_a_positive_number(store: str, hours: str) -> None:
    assert_usage(psguard("gc", store, "--keep-every-hours", hours), "keep_every_hours must be a number of hours > 0")
    assert len(Store.open(store).checkpoint_ids()) == 40  # nothing deleted


@pytest.mark.slow
def test_a_400_digit_number_in_a_policy_file_is_a_usage_error(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"memory:\n  every_steps: {'9' * 400}\n")
    assert_usage(psguard("policy", "check", str(policy)), "policy.yaml", "memory.every_steps")
    policy.write_text(f"base:\n  every: {'9' * 400}\n")
    assert_usage(psguard("policy", "check", str(policy)), "base.every", "(400 characters)")


@pytest.mark.slow
def test_policy_check_on_a_fifo_or_a_folder_answers_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_usage(psguard("policy", "check", str(fifo), timeout=30), "not a regular file")
    assert_usage(psguard("policy", "check", str(tmp_path)), "it is a folder")


@pytest.mark.slow
def test_policy_simulate_of_an_absurd_duration_is_refused_at_once() -> None:
    t0 = time.monotonic()
    done = psguard("policy", "simulate", "default", "--mtbf", "6h", "--stall", "0.5s", "--persist", "20s",
                   "--duration", "99999999999d")  # fmt: skip
    assert_usage(done, "duration must be at most 3650 days")
    assert time.monotonic() - t0 < 30


def test_policy_simulate_stops_a_policy_that_would_decide_for_hours(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten years of a policy that saves every 30 s: refused once its decision budget (here cut to 2000, to stay
    fast) is spent, with a message, instead of computing for hours."""
    from psguard.policy import sim
    from psguard.policy.files import load_policy

    monkeypatch.setattr(sim, "MAX_DECISIONS", 2000)
    spec = load_policy("default")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"decides more than 2000 times in the first [0-9.]+ of 3650\.0 days"):
        sim.simulate(spec.schedule, sim.Job(mtbf=3600, stall=0.0, persist=0.0, duration=3650 * 86400))
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_an_invalid_bucket_name_is_a_usage_error() -> None:
    assert_usage(psguard("ls", "s3://Bad_Bucket!/x"), "is not a bucket name")


@pytest.mark.slow
def test_export_and_copy_into_a_path_under_a_file_are_usage_errors(store: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert_usage(psguard("export", store, str(tmp_path / "file" / "out")), "is a file, not a folder")
    assert_usage(psguard("copy", store, "--step", "10", str(tmp_path / "file" / "dest")), "is a file, not a folder")


@pytest.mark.slow
def test_ls_json_into_a_closed_pipe_ends_quietly(store: str) -> None:
    """``psguard ls --json | head -1``: the reader goes away after a line; no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "psguard.cli", "ls", store, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()  # what head does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(60) in (0, cli.EXIT_BROKEN_PIPE), err  # 0 if the whole document fit in the pipe first
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "{store}", "--step", "999"),
        ("verify", "{store}", "--id", "000000000999-00000000"),
        ("copy", "{store}", "--step", "999", "{tmp}/dest"),
        ("ls", "{tmp}/no-such-store"),
        ("verify", "{tmp}/no-such-store"),
        ("gc", "{tmp}/no-such-store", "--keep-last", "1"),
    ],
    ids=lambda a: " ".join(a[:1] + a[2:3]),
)
def test_missing_things_exit_4(store: str, tmp_path: Path, args: tuple[str, ...]) -> None:
    done = psguard(*(a.format(store=store, tmp=tmp_path) for a in args))
    assert done.returncode == cli.EXIT_NOT_FOUND, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr


def test_the_cli_docstring_and_the_readme_agree_on_exit_codes() -> None:
    readme = (ROOT / "README.md").read_text()
    doc = cli.__doc__ or ""
    assert "2 bad input (usage" in doc and "1 error (storage failure" in doc
    assert "`2` bad input" in readme and "`141`" in readme
    assert (cli.EXIT_USAGE, cli.EXIT_CORRUPT, cli.EXIT_NOT_FOUND) == (2, 3, 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--script", "/nonexistent/train.py"], "--script /nonexistent/train.py: no such file"),
        (["--runs", "0"], "--runs 0"),
    ],
)
def test_bench_wrap_refuses_bad_input_before_starting_anything(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from psguard.cli import main

    assert main(["bench", "wrap", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args", [["--ps", "2"], ["--ps", "3", "--parity-group", "3"], ["--ps", "3", "--parity-group", "1"]]
)
def test_bench_recovery_refuses_parity_with_no_agent_outside_its_group(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from psguard.cli import main

    assert main(["bench", "recovery", "--copies", "parity", *args]) == 2
    assert "--copies parity needs 2 <= --parity-group < --ps" in capsys.readouterr().err
