"""The chief's agent talking to its peers: names to URLs, and the answers of a peer that refuses."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from psguard.agent.control.peers import PeersConfig, PeerSync


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
        outcome = sync.sync(restart_ps=True, failed_at=None)
    assert outcome == {server.url: "fresh (started after the failure)"} and not restarts
