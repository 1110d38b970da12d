"""``psguard wrap``: a training command run as the chief of a local cluster, every task under an agent.

The slow tests run ``psguard wrap`` as a subprocess, as a user would, with real PS and worker servers. Their
trainers are tiny Python scripts without TensorFlow (the examples' tests run real TF trainers), so that what
is checked here is wrap itself: TF_CONFIG wiring, supervision and restart, exit codes, and that SIGTERM
leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from psguard.agent.wrap import NO_STORE_WARNING
from psguard.cli import main as cli_main
from tests.support.paths import ROOT
from tests.support.processes import alive, children, wait_until

ENV = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")

# Records what the trainer saw, connects to every PS and worker (their servers must be up before the trainer
# starts), and crashes on its first run: the agent must start it again.
TRAINER = textwrap.dedent(
    """
    import json, os, socket, sys
    out = sys.argv[1]
    config = json.loads(os.environ["TF_CONFIG"])
    reached = []
    for role in ("ps", "worker"):
        for address in config["cluster"][role]:
            host, port = address.rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=5).close()
            reached.append(address)
    with open(out, "a") as f:
        f.write(json.dumps({"tf_config": config, "reached": reached, "spool": os.environ.get("PSGUARD_SPOOL"),
                            "store": os.environ.get("PSGUARD_STORE"),
                            "agent": os.environ.get("PSGUARD_AGENT_URL"), "pid": os.getpid()}) + "\\n")
    runs = sum(1 for _ in open(out))
    print(f"trainer run {runs}", flush=True)
    sys.exit(3 if runs == 1 else 0)
    """
)


def _wrap(*args: str) -> list[str]:
    return [sys.executable, "-m", "psguard.cli", "wrap", *args]


# ------------------------------------------------------------------------------------------ fast: bad input
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["wrap"], "give the training command after '--'"),
        (["wrap", "--"], "give the training command after '--'"),
        (["wrap", "--ps", "0", "--", "true"], "--ps: a parameter-server job needs at least one PS"),
        (["wrap", "--workers", "0", "--", "true"], "--workers: a parameter-server job needs at least one worker"),
        (["wrap", "--config", "/nonexistent/agent.yaml", "--", "true"], "--config /nonexistent/agent.yaml"),
        (["wrap", "--store", "s3:/bucket/x", "--", "true"], "'s3:/bucket/x' is missing a slash: write s3://bucket/x"),
    ],
)
def test_bad_input_is_a_usage_error_before_any_process_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_token_file_others_can_read_or_that_is_missing_is_refused_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = tmp_path / "token"
    shared.write_text("secret-token\n")
    shared.chmod(0o644)
    for path in (shared, tmp_path / "missing"):
        assert cli_main(["wrap", "--token-file", str(path), "--", "true"]) == 2
        err = capsys.readouterr().err
        assert f"--token-file {path}" in err and "secret-token" not in err


def test_a_config_with_a_bad_key_is_refused_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "chief.yaml"
    config.write_text("supervisor: {backoff_initial: 0.1, standby_dealy: 3}\n")
    assert cli_main(["wrap", "--config", str(config), "--dir", str(tmp_path / "wrap"), "--", "true"]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "standby_dealy" in err and "standby_delay" in err  # names it, suggests the key
    assert not (tmp_path / "wrap").exists()


# ------------------------------------------------------------------------------------------ slow: processes
@pytest.mark.slow
def test_unmodified_command_gets_tf_config_and_is_restarted_after_a_crash(tmp_path: Path) -> None:
    script, record, work = tmp_path / "trainer.py", tmp_path / "runs.jsonl", tmp_path / "wrap"
    script.write_text(TRAINER)
    out = subprocess.run(
        _wrap("--ps", "2", "--workers", "1", "--dir", str(work), "--", sys.executable, str(script), str(record)),
        capture_output=True,
        text=True,
        timeout=400,
        env=ENV,
        cwd=tmp_path,
    )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    # The trainer's output reaches wrap's stdout (the chief's agent passes its task's output through).
    assert "trainer run 1" in out.stdout and "trainer run 2" in out.stdout
    assert NO_STORE_WARNING in out.stderr  # no --store: said at the start, with the fix

    cluster = json.loads((work / "cluster.json").read_text())
    assert len(cluster["ps"]) == 2 and len(cluster["worker"]) == 1 and len(cluster["chief"]) == 1
    assert all(a.startswith("127.0.0.1:") for addresses in cluster.values() for a in addresses)
    runs = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(runs) == 2 and runs[0]["pid"] != runs[1]["pid"]
    for run in runs:
        assert run["tf_config"]["cluster"] == cluster
        assert run["tf_config"]["task"] == {"type": "chief", "index": 0}
        assert sorted(run["reached"]) == sorted(cluster["ps"] + cluster["worker"])
        assert run["spool"] and run["spool"] != "/dev/shm/psguard-default"  # one spool per wrapped job
        assert run["agent"].startswith("http://127.0.0.1:")
        assert run["store"] == ""  # the trainer's manager learns that its agent has no durable log
    assert not Path(runs[0]["spool"]).exists()  # removed at the end
    # A new trainer process starts a generation: the PS servers and the workers are restarted (the agent's rule;
    # a worker keeps the old chief's device resources otherwise: PeersConfig.restart_workers).
    for name in ("ps0", "ps1", "worker0"):
        assert "event=restart_requested" in (work / "agents" / name / "agent.log").read_text(), name


@pytest.mark.slow
def test_a_command_that_keeps_failing_ends_in_exit_1_after_the_crash_loop_limit(tmp_path: Path) -> None:
    config = tmp_path / "chief.yaml"
    config.write_text(
        "supervisor: {backoff_initial: 0.1, backoff_max: 0.2, crash_loop_limit: 2}\npeers: {restart_ps: false}\n"
    )
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('trainer failing', flush=True)\nsys.exit(7)\n")
    out = subprocess.run(
        _wrap("--config", str(config), "--dir", str(tmp_path / "wrap"), "--", sys.executable, str(script)),
        capture_output=True,
        text=True,
        timeout=400,
        env=ENV,
    )
    assert out.returncode == 1, f"{out.stdout}\n{out.stderr}"
    assert out.stdout.count("trainer failing") == 2  # crash_loop_limit runs, then the agent gave up
    assert "crashed 2 times" in out.stderr and "exit codes: 7, 7" in out.stderr
    assert "psguard wrap: the chief's agent exited 1" in out.stderr
    assert (tmp_path / "wrap" / "agents" / "ps0" / "agent.log").exists()  # logs kept for the post-mortem
    # The user's settings, with the run's own task records: not the host-wide default another job would share.
    copy = tmp_path / "wrap" / "agents" / "chief" / "agent.yaml"
    assert copy.stat().st_mode & 0o077 == 0  # it may hold the user's storage_options
    used = json.loads(copy.read_text())
    assert used["supervisor"]["crash_loop_limit"] == 2 and used["peers"] == {"restart_ps": False}
    assert used["state_dir"] == str(tmp_path / "wrap" / "agents" / ".state")
    assert (tmp_path / "wrap" / "agents" / ".state").is_dir()


# The trainer writes its pid once it runs (the whole cluster is up by then). "stubborn": it ignores SIGTERM (the
# chief's agent would wait supervisor.stop_timeout, 30 s, before SIGKILL) and says when it got one.
FOREVER = """
import os, signal, sys
marker, stubborn = sys.argv[1], sys.argv[2] == "stubborn"
if stubborn:
    signal.signal(signal.SIGTERM, lambda *_: open(marker + ".term", "w").close())
with open(marker + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(marker + ".tmp", marker)
while True:
    signal.pause()
"""


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float) -> None:
    def written() -> bool:  # another process writes it: polling the file is waiting for that event
        if path.exists():
            return True
        assert proc.poll() is None, proc.communicate()
        return False

    wait_until(written, timeout, f"{path.name} written", every=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2], ids=["sigterm", "sigterm-twice-kills-at-once"])
def test_sigterm_stops_the_trainer_and_every_agent_and_server(tmp_path: Path, signals: int) -> None:
    marker, script = tmp_path / "trainer.pid", tmp_path / "forever.py"
    script.write_text(FOREVER)
    mode = "stubborn" if signals == 2 else "plain"
    proc = subprocess.Popen(
        _wrap("--dir", str(tmp_path / "wrap"), "--", sys.executable, str(script), str(marker), mode),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        _wait_for(marker, proc, 300)
        trainer = int(marker.read_text())
        tree = children(proc.pid)
        assert trainer in tree
        assert len(tree) >= 6  # 3 agents (ps0, worker0, chief), 2 servers, the trainer (plus their shells)
        proc.send_signal(signal.SIGTERM)
        if signals == 2:
            _wait_for(Path(f"{marker}.term"), proc, 120)  # wrap is stopping: its agent asked the trainer to go
            assert alive(trainer)  # ...which ignores it: without a second signal wrap would wait 30 s here
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        if signals == 2:
            assert time.monotonic() - t0 < 20, "the second SIGTERM did not cut the stop short"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert "every process it started was stopped" in err
    deadline = time.monotonic() + 10
    while (left := [p for p in tree if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)  # children reparented to init are reaped by it, not by us: give it a moment
    assert not left, f"still running after wrap exited: {left}"
