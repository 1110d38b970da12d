"""The HTTP port's intake over real sockets: heads read without a thread, the bounds that keep clients from filling
the port, the lanes that keep probes apart from slow work, and a stop that leaves nothing running."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from psguard.agent.control.connections import HEAD_LIMIT, Connection, Intake, listen, parse_head, target_path


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def ask(port: int, path: str, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        return read_all(s)


class Served:
    """A ``serve`` for the intake: answers ``path`` in the body, after ``release`` for paths under ``/slow``; for
    paths under ``/hold``, reads from the client first (a worker blocked on its socket)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.paths: list[str] = []

    def __call__(self, conn: Connection) -> None:
        assert conn.head is not None and conn.head.path is not None
        self.paths.append(conn.head.path)
        if conn.head.path.startswith("/slow"):
            self.started.release()
            self.release.wait(10)
        if conn.head.path.startswith("/hold"):
            self.started.release()
            conn.sock.recv(1)
        body = conn.head.path.encode()
        conn.sock.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


@pytest.fixture
def intake() -> Iterator[Callable[..., tuple[Intake, int, Served]]]:
    started: list[tuple[Intake, socket.socket, Served]] = []

    def start(**options: object) -> tuple[Intake, int, Served]:
        listener = listen("127.0.0.1", 0)
        served = Served()
        settings: dict[str, object] = {"health_paths": {"/healthz"}, "timeout": 5.0, **options}
        it = Intake(listener, served, name="test-http", **settings)  # type: ignore[arg-type]
        it.start()
        started.append((it, listener, served))
        return it, listener.getsockname()[1], served

    yield start
    for it, listener, served in started:
        served.release.set()
        it.stop()
        listener.close()


def test_parse_head_reads_plain_heads_and_leaves_odd_ones_to_the_worker() -> None:
    head = parse_head(b"GET /status?x=1 HTTP/1.1\r\nHost: a\r\nauthorization: Bearer t\r\nHOST: b\r\n\r\nbody")
    assert head is not None and (head.method, head.target, head.path) == ("GET", "/status?x=1", "/status")
    assert head.fields == {"host": "a", "authorization": "Bearer t"}  # the first of repeated fields
    assert parse_head(b"GET /a HTTP/1.0\n\n") is not None  # bare line feeds
    assert parse_head(b"GET /a HTTP/1.1\r\nHost: a\r\n") is None  # not complete
    for odd in (
        b"GET  /a HTTP/1.1\r\n\r\n",  # not three words
        b"GET /a\r\n\r\n",  # HTTP/0.9
        b"GET /a HTTP/1.1\r\nX: 1\r\n folded\r\n\r\n",
        b"GET /a HTTP/1.1\r\nno colon\r\n\r\n",
        b"GET /a HTTP/1.1\r\nName : spaced\r\n\r\n",
    ):
        assert parse_head(odd) is None, odd
    assert parse_head(b"GET http://[x/ HTTP/1.1\r\n\r\n").path is None  # type: ignore[union-attr]
    assert target_path("http://h/healthz?x") == "/healthz" and target_path("//healthz") == "/healthz"
    assert target_path("/a#b") == "/a" and target_path("http://[x/") is None


def test_a_request_is_answered_with_the_bytes_that_came_after_its_head(intake: Callable[..., tuple]) -> None:
    bodies: list[bytes] = []

    def serve(conn: Connection) -> None:
        bodies.append(bytes(conn.data))
        conn.sock.sendall(b"HTTP/1.0 204 No Content\r\n\r\n")

    listener = listen("127.0.0.1", 0)
    it = Intake(listener, serve, health_paths=(), timeout=5.0, name="test-http")
    it.start()
    try:
        with socket.create_connection(listener.getsockname()[:2], timeout=5) as s:
            for piece in (b"POST /x HTTP/1.1\r\nContent-", b"Length: 2\r", b"\n\r", b"\n{}"):
                s.sendall(piece)  # the head's end split across reads
                time.sleep(0.05)
            assert read_all(s).startswith(b"HTTP/1.0 204")
    finally:
        it.stop()
        listener.close()
    assert bodies[0].startswith(b"POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\n")


def test_silent_clients_hold_no_worker_and_the_oldest_gives_way_at_the_bound(intake: Callable[..., tuple]) -> None:
    _, port, served = intake(workers=1, max_waiting=4)
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    try:
        assert ask(port, "/status").endswith(b"/status")  # four silent clients hold neither the worker nor the port
        # The fifth waiting connection (this probe is answered, so only the silent four wait) closes the oldest.
        newest = socket.create_connection(("127.0.0.1", port), timeout=5)
        silent.append(newest)
        assert silent[0].recv(1) == b""
        assert ask(port, "/healthz").endswith(b"/healthz")
        newest.settimeout(0.2)
        with pytest.raises(TimeoutError):
            newest.recv(1)  # the newest still waits
    finally:
        for s in silent:
            s.close()
    assert served.paths == ["/status", "/healthz"]


def test_a_head_that_never_ends_is_cut_at_the_deadline_or_the_size_limit(intake: Callable[..., tuple]) -> None:
    _, port, _ = intake(timeout=0.5)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /a HTTP/1.1\r\nX: ")
        started = time.monotonic()
        assert read_all(s) == b""  # asked nothing complete: closed without an answer
        assert 0.4 < time.monotonic() - started < 3
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /a HTTP/1.1\r\nX: " + b"a" * HEAD_LIMIT)
        assert read_all(s).startswith(b"HTTP/1.0 431 ")


def test_probes_are_answered_while_every_worker_is_busy_and_a_full_queue_answers_503(
    intake: Callable[..., tuple],
) -> None:
    _, port, served = intake(workers=1, queue_limit=1)
    slow: list[socket.socket] = []
    try:
        for i in range(2):  # one on the only worker, then one in its queue
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(f"GET /slow/{i} HTTP/1.1\r\n\r\n".encode())
            slow.append(s)
            if i == 0:
                assert served.started.acquire(timeout=5)
        assert ask(port, "/healthz", timeout=2).endswith(b"/healthz")  # the health lane: not behind the slow one
        answer = ask(port, "/status", timeout=2)
        assert answer.startswith(b"HTTP/1.0 503 ") and b"retry" in answer  # at once, not after the slow ones
        served.release.set()
        assert [read_all(s).rsplit(b"\n", 1)[-1] for s in slow] == [b"/slow/0", b"/slow/1"]
    finally:
        for s in slow:
            s.close()


def test_screened_requests_are_answered_by_the_intake_alone(intake: Callable[..., tuple]) -> None:
    def screen(conn: Connection) -> bytes | None:
        if conn.head is not None and conn.head.fields.get("authorization") is None:
            return b"HTTP/1.0 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"
        return None

    _, port, served = intake(screen=screen, workers=1)
    for _ in range(20):
        assert ask(port, "/status").startswith(b"HTTP/1.0 401 ")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /status HTTP/1.1\r\nAuthorization: Bearer t\r\n\r\n")
        assert read_all(s).endswith(b"/status")
    assert served.paths == ["/status"]  # the 20 refusals never reached the worker


def test_stop_closes_waiting_and_queued_connections_and_joins_every_thread(intake: Callable[..., tuple]) -> None:
    it, port, served = intake(workers=1)
    silent = socket.create_connection(("127.0.0.1", port), timeout=5)
    busy = socket.create_connection(("127.0.0.1", port), timeout=5)
    queued = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        busy.sendall(b"GET /hold/busy HTTP/1.1\r\n\r\n")
        assert served.started.acquire(timeout=5)
        queued.sendall(b"GET /hold/queued HTTP/1.1\r\n\r\n")
        before = {t.name for t in threading.enumerate()}
        assert {"test-http-intake", "test-http-main-0", "test-http-health-1"} <= before
        started = time.monotonic()
        it.stop()  # the busy worker's read returns at once, the worker ends
        assert time.monotonic() - started < 3
        assert not {t.name for t in threading.enumerate()} & {"test-http-intake", "test-http-main-0"}
        assert silent.recv(1) == b"" and queued.recv(1) == b""
        assert served.paths == ["/hold/busy"]  # the queued one was never served
        it.stop()  # twice is fine
    finally:
        served.release.set()
        for s in (silent, busy, queued):
            s.close()


def test_a_round_answers_the_probes_before_the_requests_read_before_them() -> None:
    """After a stall (here: the intake not yet started) the queue holds many requests: the probe is answered
    first, not after everything that came before it."""
    seen: list[str | None] = []

    def screen(conn: Connection) -> bytes | None:
        seen.append(conn.head.path if conn.head is not None else None)
        return b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"

    listener = listen("127.0.0.1", 0)
    it = Intake(listener, Served(), screen=screen, health_paths={"/healthz"}, timeout=5.0, name="test-http")
    clients = []
    try:
        for path in [f"/status/{i}" for i in range(20)] + ["/healthz"]:
            s = socket.create_connection(listener.getsockname()[:2], timeout=5)  # queued by the kernel
            s.sendall(f"GET {path} HTTP/1.1\r\n\r\n".encode())
            clients.append(s)
        it.start()
        for s in clients:
            assert read_all(s).startswith(b"HTTP/1.0 200")
    finally:
        it.stop()
        listener.close()
        for s in clients:
            s.close()
    assert seen[0] == "/healthz" and sorted(seen[1:]) == sorted(f"/status/{i}" for i in range(20))
