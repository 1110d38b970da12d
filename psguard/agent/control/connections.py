"""The agent's HTTP port from the kernel's queue to the thread that answers, bounded everywhere a client could fill it.

Python's ``ThreadingHTTPServer`` (a backlog of 5, a thread per connection) left a third of 200 concurrent requests
unanswered after 10 s on a 2-core machine: a SYN dropped from a full queue is sent again seconds later, and a
one-second health probe that loses one has failed. The rules here:

- **The kernel's queue is deep** (:data:`LISTEN_BACKLOG`): a burst waits there.
- **No thread waits for a client.** One thread, the intake, accepts every queued connection and reads each head
  (the TLS handshake first) without blocking; a silent or slow client holds a socket and a buffer, never a worker.
- **One deadline per connection** (``timeout``) for handshake, head and body.
- **Waiting connections are bounded** (``max_waiting``): at the bound, or out of file descriptors, the one
  waiting longest is closed.
- **Refusals cost no worker.** ``screen`` answers a request refused on its head alone, and a liveness probe, on
  the intake's thread (~75 us against a worker's ~225 us): a flood without the token costs the agent less than it
  costs the flood.
- **Probes first, in lanes of their own.** The intake reads every head it can before answering any and hands the
  health paths' first to their own two workers; every lane's queue is bounded (a full one answers 503 at once).
- :meth:`Intake.stop` closes waiting and queued connections unanswered, shuts down the ones being answered, and
  joins every thread it started.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

log = logging.getLogger(__name__)

#: Connections the kernel queues before the intake accepts them (capped by net.core.somaxconn). Under a load
#: test's flood 1024 overflowed now and then and 4096 let probes wait up to 1.3 s; at 2048 neither.
LISTEN_BACKLOG = 2048
#: The longest request head (request line and headers) read; longer ones are answered 431. With ``max_waiting``
#: it bounds what silent clients can make the agent hold: 1024 heads of 32 KiB, 32 MiB.
HEAD_LIMIT = 32 << 10
_ACCEPT_PAUSE = 0.1  # out of descriptors with nothing to close: accept again after this long
_WARN_EVERY = 60.0
_COUNT_EVERY = 1.0  # what the intake did on its own is logged as counts, at most once a second


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` with the deep backlog (``OSError`` when the address is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)


@dataclass(frozen=True)
class Head:
    """A request line and its header fields as the intake read them (names lower-cased, the first of repeated
    ones), for the intake's own decisions: the worker parses the head again, and its checks stand."""

    method: str
    target: str
    path: str | None  # None: the target is not a URL ("http://[x/")
    fields: Mapping[str, str]


def parse_head(data: bytes | bytearray) -> Head | None:
    """The head at the start of ``data``; ``None`` for one that is not a plain HTTP/1.x head (not complete, a
    request line not of three words, a folded or nameless field): the worker decides about those."""
    end = _head_end(data, 0)
    if end == -1:
        return None
    lines = bytes(data[:end]).decode("latin-1").split("\n")
    words = lines[0].rstrip("\r").split(" ")
    if len(words) != 3 or not words[2].startswith("HTTP/1."):
        return None
    fields: dict[str, str] = {}
    for line in lines[1:]:
        line = line.rstrip("\r")
        if not line:
            break
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            return None
        fields.setdefault(name.lower(), value.strip())
    return Head(words[0], words[1], target_path(words[1]), fields)


def target_path(target: str) -> str | None:
    """The path of a request target as ``http.server`` reads it (``/a`` of ``/a?b``, of ``http://h/a`` and of
    ``//a``); ``None`` for one that is not a URL (``http://[x/``)."""
    if target.startswith("//"):
        target = "/" + target.lstrip("/")  # as http.server does (against open redirects)
    if target.startswith("/") and "?" not in target and "#" not in target:
        return target  # the usual one, without urlsplit's 10 us
    try:
        return urllib.parse.urlsplit(target).path
    except ValueError:
        return None


def _first_path(data: bytes | bytearray) -> str | None:
    """The target's path in the request line alone: a cheaper look than :func:`parse_head`, for ordering."""
    words = bytes(data[: data.find(b"\n")]).split()
    return target_path(words[1].decode("latin-1")) if len(words) >= 2 else None


def answer_head(status: int, content_type: str, length: int, headers: Mapping[str, str] | None = None) -> bytes:
    """The status line and header fields of an answer (HTTP/1.0: the connection closes after it)."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    lines = [
        f"HTTP/1.0 {status} {reason}",
        "Server: psguard-agent",
        f"Date: {_http_date()}",
        f"Content-Type: {content_type}",
        f"Content-Length: {length}",
        "Cache-Control: no-store",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
        "Connection: close",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


_date = (0, "")


def _http_date() -> str:
    """The Date field, formatted once a second (formatdate costs ~20 us, a tenth of a refusal's whole cost)."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True))
    return _date[1]


def _head_end(data: bytes | bytearray, start: int) -> int:
    """Where the head ends (after its blank line, CRLF or bare LF) at or after ``start``; -1 when not yet."""
    i = data.find(b"\n", start)
    while i != -1:
        if data[i + 1 : i + 2] == b"\n":
            return i + 2
        if data[i + 1 : i + 3] == b"\r\n":
            return i + 3
        i = data.find(b"\n", i + 1)
    return -1


@dataclass(eq=False)
class Connection:
    """An accepted connection: its socket, the bytes read so far (the head, perhaps the start of the body) and its
    deadline (``time.monotonic``)."""

    sock: socket.socket
    address: Any
    deadline: float
    data: bytearray = field(default_factory=bytearray)
    handshaking: bool = False
    events: int = 0  # what the intake's selector waits for on it (0: not in the selector)
    head: Head | None = None  # once the head is complete (None also for one parse_head leaves to the worker)

    @property
    def host(self) -> str:
        return str(self.address[0]) if self.address else "-"


def _answer_now(conn: Connection, data: bytes) -> None:
    """A short answer from the intake, sent if it fits in the socket's buffer (it never waits), then the close:
    as :func:`_close_after_answer`, in as few system calls (each one waits for the GIL again under load)."""
    sock = conn.sock
    with contextlib.suppress(OSError):
        sock.send(data, 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_DONTWAIT)  # TLS: non-blocking already
        _drain(sock)
    sock.close()


def _drain(sock: socket.socket) -> None:
    """Throw away what already arrived and nobody read (raw bytes, never waiting); a client still sending gets its
    reset."""
    for _ in range(16):
        if not socket.socket.recv(sock, 65536, socket.MSG_DONTWAIT):
            break


def _error(status: int, message: str) -> bytes:
    body = json.dumps({"error": message}).encode() + b"\n"
    return answer_head(status, "application/json", len(body)) + body


@dataclass(eq=False)
class _Lane:
    """Workers answering the connections of one lane, fed by a queue the intake fills."""

    name: str
    workers: int
    limit: int
    queue: queue.SimpleQueue[Connection | None] = field(default_factory=queue.SimpleQueue)
    threads: list[threading.Thread] = field(default_factory=list)


class Intake:
    """Accept connections on ``listener``, read their heads, and have ``serve`` answer each on a worker thread.

    ``screen(connection)`` (on the intake's thread: fast, never blocking) may answer a complete head at once: it
    returns the whole answer's bytes (its status line first), or ``None`` to leave the request to a worker.
    ``serve(connection)`` gets a blocking socket with the head already read (``connection.data``); it must not
    read past ``connection.deadline``. It is called for paths in ``health_paths`` on the health lane, else on the
    main lane. An ``OSError`` it raises is the client's socket failing (the client hung up, or did not keep up):
    logged at DEBUG on one line. Anything else is a bug in ``serve``: logged with its traceback.
    """

    def __init__(
        self,
        listener: socket.socket,
        serve: Callable[[Connection], object],
        *,
        screen: Callable[[Connection], bytes | None] | None = None,
        health_paths: Collection[str],
        timeout: float,
        tls: ssl.SSLContext | None = None,
        workers: int = 16,
        queue_limit: int = 1024,
        max_waiting: int = 1024,
        name: str = "psguard-http",
    ) -> None:
        self._listener = listener
        self._serve = serve
        self._screen = screen
        self._health_paths = frozenset(health_paths)
        self._timeout = timeout
        self._tls = tls
        self._max_waiting = max_waiting
        self._name = name
        self._main = _Lane("main", workers, queue_limit)
        self._health = _Lane("health", 2, queue_limit)  # the probes' own two workers
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._waiting: dict[Connection, None] = {}  # insertion order: the oldest, and the nearest deadline, first
        self._active: set[socket.socket] = set()  # handed to a lane, not yet closed
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._accept_paused_until: float | None = None
        self._warned_at = -_WARN_EVERY
        self._complete: list[Connection] = []  # heads completed this round, not yet handed off
        self._counts: collections.Counter[str] = collections.Counter()
        self._counted_since = time.monotonic()
        self.error: BaseException | None = None

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        for lane in (self._main, self._health):
            for i in range(lane.workers):
                thread = threading.Thread(
                    target=self._work, args=(lane,), name=f"{self._name}-{lane.name}-{i}", daemon=True
                )
                lane.threads.append(thread)
                thread.start()
        self._thread = threading.Thread(target=self._run, name=f"{self._name}-intake", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close waiting and queued connections unanswered, cut the ones being answered, join every thread."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")
        if self._thread is not None:
            self._thread.join()
        for lane in (self._main, self._health):
            with contextlib.suppress(queue.Empty):
                while True:
                    if (conn := lane.queue.get_nowait()) is not None:
                        self._release(conn)
            for _ in lane.threads:
                lane.queue.put(None)  # each worker's last
        with self._lock:
            active = list(self._active)
        for sock in active:
            # socket.socket's, not SSLSocket's: that one drops its TLS object under the reading thread.
            with contextlib.suppress(OSError):  # already closed by its worker
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        for lane in (self._main, self._health):
            for thread in lane.threads:
                thread.join()
            lane.threads.clear()
        self._selector.close()
        self._wake_read.close()
        self._wake_write.close()

    # ------------------------------------------------------------------------------------------ the intake

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                for key, _ in self._selector.select(self._next_wake()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_read:
                        with contextlib.suppress(OSError):
                            self._wake_read.recv(64)
                    else:
                        self._step(key.data)
                self._dispatch()
                self._expire()
                self._log_counts()
        except BaseException as e:
            log.exception("event=http_intake_failed")
            self.error = e
        finally:
            for conn in self._complete:
                conn.sock.close()
            for conn in list(self._waiting):
                self._drop(conn)
            self._log_counts(force=True)

    def _dispatch(self) -> None:
        """Hand off this round's complete heads, the health paths' first (a stable sort keeps the rest in order)."""
        complete, self._complete = self._complete, []
        if len(complete) > 1:
            complete.sort(key=lambda conn: _first_path(conn.data) not in self._health_paths)
        for conn in complete:
            try:
                self._hand_off(conn)
            except Exception:
                log.exception("event=http_intake_failed client=%s", conn.host)
                conn.sock.close()

    def _log_counts(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._counts or (now - self._counted_since < _COUNT_EVERY and not force):
            return
        counts = " ".join(f"{name}={n}" for name, n in sorted(self._counts.items()))
        log.debug("event=http_intake seconds=%.1f %s", now - self._counted_since, counts)
        self._counts.clear()
        self._counted_since = now

    def _next_wake(self) -> float:
        now = time.monotonic()
        wake = now + 1.0
        if self._waiting:
            wake = min(wake, next(iter(self._waiting)).deadline)
        if self._accept_paused_until is not None:
            wake = min(wake, self._accept_paused_until)
        return max(0.0, wake - now)

    def _accept(self) -> None:
        for _ in range(LISTEN_BACKLOG):  # what the queue holds; then the waiting ones get their turn
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and self._waiting:
                    self._drop(next(iter(self._waiting)))  # the one waiting longest gives its descriptor up
                    continue
                if e.errno == errno.ECONNABORTED:
                    continue
                self._pause_accepting(e)
                return
            self._admit(sock, address)

    def _pause_accepting(self, error: OSError) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY:
            self._warned_at = now
            log.warning("event=http_accept_failed error=%r: new connections wait in the kernel's queue", error.strerror)
        self._selector.unregister(self._listener)
        self._accept_paused_until = now + _ACCEPT_PAUSE

    def _expire(self) -> None:
        now = time.monotonic()
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._selector.register(self._listener, selectors.EVENT_READ)
        while self._waiting:
            conn = next(iter(self._waiting))
            if conn.deadline > now:
                return
            self._counts["head_timeout"] += 1
            self._drop(conn)

    def _admit(self, sock: socket.socket, address: Any) -> None:
        # A plain socket stays blocking and is read with MSG_DONTWAIT: under a flood every system call waits for
        # the GIL again, so the intake makes as few as it can.
        if self._tls is not None:
            sock.setblocking(False)
            try:
                sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ValueError):
                sock.close()
                return
        conn = Connection(sock, address, time.monotonic() + self._timeout, handshaking=self._tls is not None)
        if len(self._waiting) >= self._max_waiting:
            self._counts["dropped_oldest"] += 1
            self._drop(next(iter(self._waiting)))
        self._waiting[conn] = None
        self._step(conn)

    def _step(self, conn: Connection) -> None:
        """:meth:`_progress`, with a bug in it costing one connection, not the port."""
        try:
            self._progress(conn)
        except Exception:
            log.exception("event=http_intake_failed client=%s", conn.host)
            if conn in self._waiting:
                self._drop(conn)

    def _progress(self, conn: Connection) -> None:
        """Advance ``conn``'s handshake and head as far as its bytes allow, without blocking."""
        try:
            if isinstance(conn.sock, ssl.SSLSocket) and conn.handshaking:
                conn.sock.do_handshake()
                conn.handshaking = False
            while True:
                room = HEAD_LIMIT + 1 - len(conn.data)  # > 0: a head past the limit was answered 431 below
                if isinstance(conn.sock, ssl.SSLSocket):
                    chunk = conn.sock.recv(room)
                else:
                    chunk = conn.sock.recv(room, socket.MSG_DONTWAIT)
                if not chunk:
                    self._counts["gone"] += 1  # hung up before asking anything
                    self._drop(conn)
                    return
                seen = len(conn.data)
                conn.data += chunk
                if _head_end(conn.data, max(0, seen - 3)) != -1:
                    self._forget(conn)
                    self._complete.append(conn)
                    return
                if len(conn.data) > HEAD_LIMIT:
                    self._forget(conn)
                    self._counts["answered_431"] += 1
                    _answer_now(conn, _error(431, f"request head over {HEAD_LIMIT} bytes"))
                    return
        except ssl.SSLWantWriteError:
            self._watch(conn, selectors.EVENT_WRITE)
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            self._watch(conn, selectors.EVENT_READ)
        except OSError:  # reset, TLS alert: the client's doing, not an error of ours
            self._counts["gone"] += 1
            self._drop(conn)

    def _watch(self, conn: Connection, events: int) -> None:
        if conn.events == events:
            return
        if conn.events:
            self._selector.modify(conn.sock, events, conn)
        else:
            self._selector.register(conn.sock, events, conn)
        conn.events = events

    def _forget(self, conn: Connection) -> None:
        del self._waiting[conn]
        if conn.events:
            self._selector.unregister(conn.sock)
            conn.events = 0

    def _hand_off(self, conn: Connection) -> None:
        conn.head = parse_head(conn.data)
        answer = None
        if self._screen is not None:
            try:
                answer = self._screen(conn)
            except Exception:  # a bug there costs a worker's time, not the request: the worker checks again
                log.exception("event=http_screen_failed client=%s", conn.host)
        if answer is not None:
            self._counts[f"answered_{answer[9:12].decode('latin-1')}"] += 1
            _answer_now(conn, answer)
            return
        health = conn.head is not None and conn.head.path in self._health_paths
        lane = self._health if health else self._main
        if lane.queue.qsize() >= lane.limit:
            self._counts[f"busy_{lane.name}"] += 1
            _answer_now(conn, _error(503, "the agent is answering too many requests; retry"))
            return
        if isinstance(conn.sock, ssl.SSLSocket):
            conn.sock.setblocking(True)
        with self._lock:
            self._active.add(conn.sock)
        lane.queue.put(conn)

    def _drop(self, conn: Connection) -> None:
        """Close a connection still waiting for its head."""
        if conn in self._waiting:
            self._forget(conn)
        conn.sock.close()

    # ------------------------------------------------------------------------------------------ the lanes

    def _work(self, lane: _Lane) -> None:
        while True:
            conn = lane.queue.get()
            if conn is None:
                return
            try:
                self._serve(conn)
            except OSError as e:
                log.debug("event=http_client_gone client=%s error=%s", conn.host, type(e).__name__)
            except Exception:
                log.exception("event=http_serve_failed client=%s", conn.host)
            finally:
                self._release(conn)

    def _release(self, conn: Connection) -> None:
        with self._lock:
            self._active.discard(conn.sock)
        _close_after_answer(conn.sock)


def _close_after_answer(sock: socket.socket) -> None:
    """A FIN after the answer, and first the bytes the client sent that nobody read thrown away: a socket closed
    with unread bytes sends a reset, which can destroy the answer before the client reads it (a 401 or 413 to a
    request whose body was never read)."""
    with contextlib.suppress(OSError):
        # socket.socket's, not SSLSocket's: no TLS close_notify exchange to wait for; the raw bytes are dropped.
        socket.socket.shutdown(sock, socket.SHUT_WR)
        sock.settimeout(None)  # so that MSG_DONTWAIT reads at once (with a timeout Python would poll first)
        _drain(sock)
    sock.close()
