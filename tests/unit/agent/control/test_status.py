"""``psguard status``: a job's agents read through their ``/status``, with the token they require."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from psguard import cli
from psguard.agent.control.httpd import AgentHTTPServer
from psguard.agent.control.metrics import AgentMetrics

TOKEN = secrets.token_urlsafe(32)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A PS agent and a chief agent (token-protected) serving what real agents' /status hold."""
    ps_doc = {"task": "ps:0", "role": "ps", "state": "running", "pid": 11, "restarts": 2, "health": "healthy"}
    ps_doc |= {"ready": True, "peers": []}
    with ExitStack() as stack:
        ps = stack.enter_context(
            AgentHTTPServer(
                token=TOKEN,
                registry=AgentMetrics().registry,
                status=lambda: ps_doc,
                readiness=lambda: {"task": True},
            )
        )
        chief_doc = {
            "task": "chief:0", "role": "chief", "state": "running", "pid": 10, "restarts": 1, "health": "healthy",
            "ready": True, "peers": [{"url": ps.url, "health": "healthy"}], "store": "s3://bucket/job-42",
            "spool": "/dev/shm/psguard-x", "memory_step": 120, "memory_bytes": 3 << 20, "durable_step": 100,
            "durable_checkpoint": "000000000100-abc", "persist_lag_steps": 20, "generation": 2,
            "last_generation": {"peers": {ps.url: "restarted"}}, "last_lost_steps": 7,
            "persister": {"pending_requests": 0, "checkpoints_written": 4, "failures": 1,
                          "last_error": "StorageUnavailableError: ..."},
            "copies": {"mode": "full", "parts": {
                "ps:0": {"holder": "ps:1", "step": 120, "token": "t", "current": True, "copies": 2},
                "ps:1": {"holder": "ps:0", "step": 115, "token": "u", "current": False, "copies": 1}}},
        }  # fmt: skip
        chief = stack.enter_context(
            AgentHTTPServer(
                token=TOKEN,
                registry=AgentMetrics().registry,
                status=lambda: chief_doc,
                readiness=lambda: {"task": True},
            )
        )
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)  # a token file others can read is refused
        yield {"chief": chief.url, "ps": ps.url, "token_file": str(token_file), "chief_doc": chief_doc}


def test_the_chiefs_url_is_enough_and_the_token_is_never_printed(
    job: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status", job["chief"], "--token-file", job["token_file"]]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["TASK", "STATE", "PID", "RESTARTS", "HEALTH", "READY", "AGENT"]
    assert lines[1].split() == ["chief:0", "running", "10", "1", "healthy", "yes", job["chief"]]
    assert lines[2].split() == ["ps:0", "running", "11", "2", "healthy", "yes", job["ps"]]  # found via the chief
    assert "chief:0: store s3://bucket/job-42" in out
    assert "memory tier   step 120 (3.0 MiB)" in out
    assert "durable log   step 100 (000000000100-abc), lag 20 steps" in out
    assert "1 failures, last error: StorageUnavailableError" in out and "lost steps at the last recovery: 7" in out
    assert "copies        ps:0 2 (+ps:1), ps:1 1 (copy at 115)" in out  # how many copies each part has
    assert TOKEN not in out


def test_without_the_token_each_agent_says_what_is_missing(
    job: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PSGUARD_AGENT_TOKEN_FILE", raising=False)
    assert cli.main(["status", job["chief"], job["ps"]]) == 1
    out = capsys.readouterr().out
    assert out.count("HTTP 401 (a token is needed: --token-file FILE)") == 2


def test_json_and_an_unreachable_agent(job: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    dead = "http://127.0.0.1:9"
    code = cli.main(["status", job["ps"], dead, "--token-file", job["token_file"], "--json", "--timeout", "2"])
    assert code == 1
    agents = json.loads(capsys.readouterr().out)["agents"]
    assert [a.get("task") for a in agents] == ["ps:0", None]
    assert agents[1]["url"] == dead and agents[1]["error"].startswith("unreachable: ")


def test_a_wrap_folder_names_its_agents(
    job: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("chief", "ps0"):
        (tmp_path / "wrap" / "agents" / name).mkdir(parents=True)
        (tmp_path / "wrap" / "agents" / name / "url").write_text(job["chief" if name == "chief" else "ps"] + "\n")
    assert cli.main(["status", "--dir", str(tmp_path / "wrap"), "--token-file", job["token_file"]]) == 0
    assert capsys.readouterr().out.count("running") == 2
    assert cli.main(["status", "--dir", str(tmp_path)]) == cli.EXIT_USAGE
