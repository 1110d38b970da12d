"""Load on an HTTP server from one thread: many connections at once over non-blocking sockets, each with its own
deadline, every loop bounded in count and time.

One thread drives them all (a ``selectors`` loop), so the load does not become a test of the client's own thread
scheduling: what is measured is how the server accepts and answers. Loopback only.
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Outcome", "Visit", "burst", "flood", "get"]


@dataclass(frozen=True)
class Outcome:
    """One request: the answer's status (``None``: no answer), how long from connect to the end of the answer,
    and what went wrong (``"timeout"``, ``"reset"``, ``"closed"``)."""

    status: int | None
    seconds: float
    error: str = ""


@dataclass
class Visit:
    """One connection of a load: the bytes it sends (part of a request, or none: a client that connects and then
    says nothing); ``read``: whether it then waits for the answer, or hangs up at once."""

    data: bytes
    read: bool = True
    deadline: float = 5.0
    # the loop's state
    slot: int = 0
    sock: socket.socket | None = None
    started: float = 0.0
    sent: int = 0
    received: bytearray = field(default_factory=bytearray)


def get(path: str, token: str | None = None) -> bytes:
    """An HTTP/1.1 GET that asks the server to close the connection after answering."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n".encode()


def _status(data: bytes) -> int | None:
    line = bytes(data).split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 and line[0].startswith(b"HTTP/") and line[1].isdigit() else None


def _run(
    address: tuple[str, int],
    next_visit: Callable[[int], Visit | None],
    slots: int,
    until: float,
    on_done: Callable[[Visit, Outcome], None],
) -> None:
    """Keep ``slots`` connections open, each slot running the visits ``next_visit(slot)`` gives one after
    another (``None``: no more for that slot), until every visit ended or ``until`` (monotonic) passed;
    connections still open then are closed."""
    selector = selectors.DefaultSelector()
    visits: dict[int, Visit] = {}
    idle = list(range(slots))  # slots whose next visit is due

    def finish(v: Visit, status: int | None, error: str) -> None:
        assert v.sock is not None
        visits.pop(v.sock.fileno(), None)
        selector.unregister(v.sock)
        v.sock.close()
        idle.append(v.slot)
        on_done(v, Outcome(status, time.monotonic() - v.started, error))

    def open_one(slot: int) -> None:
        v = next_visit(slot)
        if v is None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        v.sock, v.started, v.slot = sock, time.monotonic(), slot
        code = sock.connect_ex(address)
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            idle.append(slot)
            on_done(v, Outcome(None, 0.0, errno.errorcode.get(code, str(code))))
            return
        selector.register(sock, selectors.EVENT_WRITE)
        visits[sock.fileno()] = v

    try:
        while time.monotonic() < until:
            due, idle[:] = list(idle), []
            for slot in due:
                open_one(slot)
            if not visits:
                return
            now = time.monotonic()
            for v in [v for v in visits.values() if now - v.started > v.deadline]:
                finish(v, _status(v.received), "timeout")
            for key, events in selector.select(timeout=0.05):
                v = visits.get(key.fd)
                if v is None or v.sock is None:
                    continue
                try:
                    if events & selectors.EVENT_WRITE:
                        if v.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                            finish(v, None, "refused")
                            continue
                        v.sent += v.sock.send(v.data[v.sent :])
                        if v.sent == len(v.data):
                            if not v.read:
                                finish(v, None, "hung up")
                                continue
                            selector.modify(v.sock, selectors.EVENT_READ)
                    if events & selectors.EVENT_READ:
                        chunk = v.sock.recv(65536)
                        if chunk:
                            v.received += chunk
                        else:
                            status = _status(v.received)
                            finish(v, status, "" if status is not None else "closed")
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    finish(v, _status(v.received), "reset" if isinstance(e, ConnectionResetError) else str(e))
    finally:
        for v in list(visits.values()):
            finish(v, _status(v.received), "timeout")
        selector.close()


def burst(address: tuple[str, int], data: bytes, count: int, deadline: float) -> list[Outcome]:
    """``count`` connections opened at once, each sending ``data`` and reading the answer within ``deadline``."""
    started: set[int] = set()

    def once(slot: int) -> Visit | None:
        if slot in started:
            return None
        started.add(slot)
        return Visit(data, deadline=deadline)

    outcomes: list[Outcome] = []
    _run(address, once, count, time.monotonic() + deadline + 1, lambda v, o: outcomes.append(o))
    return outcomes


def flood(
    address: tuple[str, int], kinds: list[Callable[[], Visit]], clients: int, seconds: float, limit: int
) -> list[Outcome]:
    """``clients`` clients for ``seconds`` (at most ``limit`` connections in all), client ``i`` making visits of
    kind ``kinds[i % len(kinds)]`` one after another."""
    count = [0]

    def next_visit(slot: int) -> Visit | None:
        if count[0] >= limit:
            return None
        count[0] += 1
        return kinds[slot % len(kinds)]()

    outcomes: list[Outcome] = []
    _run(address, next_visit, clients, time.monotonic() + seconds, lambda v, o: outcomes.append(o))
    return outcomes
