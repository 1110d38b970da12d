"""The chief's agent talking to its peers: names to URLs, and the answers of a peer that refuses."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from psguard.agent.control.peers import PeersConfig, PeerSync
from psguard.config import ConfigError, from_data


class _Refusing(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"error": "busy"}).encode()
        self.send_response(409)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def refusing_peer() -> Iterator[str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, name="refusing-peer")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def sync(*peers: str) -> PeerSync:
    return PeerSync("chief:0", peers, PeersConfig(request_timeout=5.0), "token", threading.Event())


def test_tasks_are_the_peers_whose_names_are_known() -> None:
    peers = sync("http://a:1", "http://b:2")
    assert peers.tasks() == {}
    peers.names["http://b:2"] = "ps:0"
    assert peers.tasks() == {"ps:0": "http://b:2"}


def test_an_http_error_is_an_error_with_the_peers_message(refusing_peer: str) -> None:
    peers = sync(refusing_peer)
    with pytest.raises(RuntimeError, match="HTTP 409: busy"):
        peers.post(f"{refusing_peer}/new-generation", {"generation": 1}, timeout=5.0)
    outcome = peers.finish("done")
    assert outcome == {refusing_peer: "error: POST /finish answered HTTP 409: busy"}


def test_a_replacement_agent_whose_ps_has_not_started_is_waited_for_not_restarted() -> None:
    """A PS agent on a replacement node answers /status before its supervisor starts the PS (``state: idle``), and
    ``POST /restart`` with 409 then. That PS holds nothing of any generation: the chief waits for it (it was
    reported as an error, and the trainer's in-process rejoin failed, when a node was replaced)."""
    from psguard.agent.control.httpd import AgentHTTPServer, Response

    polls = {"n": 0}
    restarts: list[object] = []

    def status() -> dict[str, object]:
        polls["n"] += 1
        started = polls["n"] > 2
        return {
            "task": "ps:0",
            "role": "ps",
            "state": "running" if started else "idle",
            "restarts": 0,
            "ready": started,
            "supervisor": {"uptime_seconds": 0.1 if started else None},
        }

    token = "a-token-of-sixteen-chars"
    server = AgentHTTPServer(token=token, status=status)
    server.add_post("/restart", lambda r: restarts.append(r) or Response(409, {"error": "not running (idle)"}))
    with server:
        sync = PeerSync("chief:0", [server.url], PeersConfig(ready_timeout=30), token, threading.Event())
        fresh: list[tuple[str, int]] = []
        sync.on_fresh = lambda task, doc: fresh.append((task, polls["n"]))
        outcome = sync.sync(restart_ps=True, failed_at=None)
    assert outcome == {server.url: "fresh (started after the failure)"} and not restarts
    # Told once, at its first answer (its PS not started yet): the chief's agent has it fetch its copy then.
    assert fresh == [("ps:0", 1)]


class _FakeTask:
    """A peer agent's /status and POST /restart, as far as a generation reads them."""

    def __init__(self, task: str, role: str) -> None:
        from psguard.agent.control.httpd import AgentHTTPServer, Response

        self.task, self.role, self.restarts = task, role, 0
        self.restarted_at: list[float] = []
        self.server = AgentHTTPServer(token=TOKEN, status=self.status)

        def restart(_: object) -> Response:
            self.restarts += 1
            self.restarted_at.append(time.monotonic())
            return Response(202, {"ok": True})

        self.server.add_post("/restart", restart)

    def status(self) -> dict[str, object]:
        return {
            "task": self.task,
            "role": self.role,
            "state": "running",
            "restarts": self.restarts,
            "ready": True,
            "supervisor": {"uptime_seconds": 1000.0},
        }


TOKEN = "a-token-of-sixteen-chars"


@pytest.mark.parametrize(
    ("new_process", "restart_workers", "worker_restarted"),
    [(True, True, True), (False, True, False), (True, False, False)],
)
def test_a_new_trainer_process_restarts_the_workers_too(
    new_process: bool, restart_workers: bool, worker_restarted: bool
) -> None:
    """A worker keeps the device resources of every chief that used it; a new chief process numbers its lookup
    tables from the same counter and meets an old one's under its name ("Table was already initialized with
    different data", the TFRS job's failure in CI). An in-process rejoin keeps its workers."""
    ps, worker = _FakeTask("ps:0", "ps"), _FakeTask("worker:0", "worker")
    with ps.server, worker.server:
        config = PeersConfig(ready_timeout=30, restart_workers=restart_workers)
        peers = PeerSync("chief:0", [ps.server.url, worker.server.url], config, TOKEN, threading.Event())
        result = peers.new_generation("the trainer exited 1", None, new_process=new_process)
    assert ps.restarts == 1 and result["peers"][ps.server.url] == "restarted"
    assert worker.restarts == int(worker_restarted)
    assert result["peers"][worker.server.url] == ("restarted" if worker_restarted else "skipped (worker)")


def test_a_stopping_agent_says_so_instead_of_a_timeout() -> None:
    ps = _FakeTask("ps:0", "ps")
    stop = threading.Event()
    stop.set()
    with ps.server:
        peers = PeerSync("chief:0", [ps.server.url], PeersConfig(ready_timeout=30), TOKEN, stop)
        outcome = peers.sync(restart_ps=True)
    assert outcome == {ps.server.url: "error: this agent stopped before the peer was restarted and ready"}


def test_parity_copies_take_groups_of_two_or_more() -> None:
    config = from_data(PeersConfig, {"copies": "parity", "parity_group": 3, "parity_placement": {"ps:0,ps:1": "ps:2"}})
    assert config.copies == "parity" and config.parity_group == 3 and config.parity_placement == {"ps:0,ps:1": "ps:2"}
    assert from_data(PeersConfig, {"copies": "parity"}).parity_group == 2
    with pytest.raises(ConfigError, match="parity_group"):
        from_data(PeersConfig, {"copies": "parity", "parity_group": 1})
    with pytest.raises(ConfigError, match="copies"):
        from_data(PeersConfig, {"copies": "xor"})


def test_a_ps_restarted_by_its_agent_after_its_status_was_read_is_not_killed_again() -> None:
    """The race of a 1 GB bench run (0.5 s of a 2 s recovery): the generation read the crashed PS's /status in its
    restart backoff (no run), its agent restarted it from the standby, then the generation's POST /restart killed
    that new run and the PS started cold. The POST now says how long ago the failure was; a run younger than that
    is left alone by its agent (``unless_started_within``), and the generation waits for it like any restart."""
    from psguard.agent.control.httpd import AgentHTTPServer, Response

    state = {"restarts": 0, "uptime": None}
    bodies: list[dict[str, object]] = []

    def status() -> dict[str, object]:
        return {
            "task": "ps:0",
            "role": "ps",
            "state": "backoff" if state["uptime"] is None else "running",
            "restarts": state["restarts"],
            "ready": state["uptime"] is not None,
            "supervisor": {"uptime_seconds": state["uptime"]},
        }

    def restart(request: object) -> Response:
        body = request.json()  # type: ignore[attr-defined]
        bodies.append(body)
        state["restarts"], state["uptime"] = 1, 0.05  # its own restart came first: it is 0.05 s old
        within = body.get("unless_started_within")
        if isinstance(within, float) and state["uptime"] < within:  # as the agent judges (AgentRecovery)
            return Response(200, {"ok": True, "fresh": True, "restarts_before": 0})
        raise AssertionError("the generation asked to kill a run that started after the failure")

    server = AgentHTTPServer(token=TOKEN, status=status)
    server.add_post("/restart", restart)
    with server:
        peers = PeerSync("chief:0", [server.url], PeersConfig(ready_timeout=30), TOKEN, threading.Event())
        failed_at = time.time() - 0.5
        outcome = peers.sync(restart_ps=True, failed_at=failed_at)
    assert outcome == {server.url: "restarted"}
    assert len(bodies) == 1 and 0.5 <= float(bodies[0]["unless_started_within"]) < 30  # type: ignore[arg-type]


def test_a_replacement_agent_that_leaves_its_first_run_alone_is_waited_for_as_fresh() -> None:
    """A replacement node's agent answered /status before its PS's run showed an uptime, then left that run alone
    when asked to restart it (``fresh``: it started after the failure). Its restart count stays 0 (it is the
    agent's first run), so waiting for it to go up held the generation for ``ready_timeout`` (a clean-clone CI
    run: 180 s, then the trainer's restore failed); it is waited for until ready, as a fresh PS."""
    from psguard.agent.control.httpd import AgentHTTPServer, Response

    state = {"asked": False}

    def status() -> dict[str, object]:
        asked = state["asked"]
        return {
            "task": "ps:0",
            "role": "ps",
            "state": "running",
            "restarts": 0,
            "ready": asked,
            "supervisor": {"uptime_seconds": 0.4 if asked else None},
        }

    def restart(request: object) -> Response:
        state["asked"] = True
        return Response(200, {"ok": True, "fresh": True, "restarts_before": 0})

    server = AgentHTTPServer(token=TOKEN, status=status)
    server.add_post("/restart", restart)
    fresh: list[str] = []
    with server:
        peers = PeerSync("chief:0", [server.url], PeersConfig(ready_timeout=30), TOKEN, threading.Event())
        peers.on_fresh = lambda task, doc: fresh.append(task)
        t0 = time.monotonic()
        outcome = peers.sync(restart_ps=True, failed_at=time.time() - 1.0)
    assert outcome == {server.url: "fresh (started after the failure)"}
    assert time.monotonic() - t0 < 10 and fresh == ["ps:0"]


def test_the_peers_are_asked_to_restart_side_by_side() -> None:
    """One peer at a time, the N-th PS got its restart request N round trips after the first (2.4 s at 100 PS on
    every recovery's path). Each peer here answers /status after 0.2 s: one after the other, the fourth request
    would come 0.6 s after the first."""

    class _Slow(_FakeTask):
        def status(self) -> dict[str, object]:
            time.sleep(0.2)  # a slow answer, not an ordering between threads
            return super().status()

    tasks = [_Slow(f"ps:{i}", "ps") for i in range(4)]
    with contextlib.ExitStack() as stack:
        for t in tasks:
            stack.enter_context(t.server)
        urls = [t.server.url for t in tasks]
        outcome = PeerSync("chief:0", urls, PeersConfig(ready_timeout=30), TOKEN, threading.Event()).sync(
            restart_ps=True, failed_at=None
        )
    assert set(outcome.values()) == {"restarted"}
    first = [t.restarted_at[0] for t in tasks]
    assert max(first) - min(first) < 0.15, first


class _Fresh(_FakeTask):
    """The dead PS, already restarted by its own agent: its run began after the failure."""

    def status(self) -> dict[str, object]:
        return {**super().status(), "supervisor": {"uptime_seconds": 0.05}}


@pytest.mark.parametrize(
    ("keep_survivors", "new_process", "survivor_kept"),
    [(True, False, True), (False, False, False), (True, True, False)],
)
def test_a_serving_survivor_is_kept_by_an_in_process_rejoin_when_asked(
    keep_survivors: bool, new_process: bool, survivor_kept: bool
) -> None:
    """``peers.keep_survivors``: an in-process rejoin leaves the PS that survived the failure running (its old
    variables go with the failed generation, collected in the same process); a new trainer process, whose old
    context nobody closes, restarts it whatever the setting says. The PS that died is only waited for either way."""
    survivor, dead = _FakeTask("ps:1", "ps"), _Fresh("ps:0", "ps")
    with survivor.server, dead.server:
        config = PeersConfig(ready_timeout=30, keep_survivors=keep_survivors)
        peers = PeerSync("chief:0", [dead.server.url, survivor.server.url], config, TOKEN, threading.Event())
        result = peers.new_generation("in-process rejoin", time.time() - 1.0, new_process=new_process)
    assert dead.restarts == 0 and result["peers"][dead.server.url] == "fresh (started after the failure)"
    assert survivor.restarts == int(not survivor_kept)
    assert result["peers"][survivor.server.url] == ("kept (survived the failure)" if survivor_kept else "restarted")
