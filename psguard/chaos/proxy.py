"""A TCP proxy in the path from the chief and the workers to one PS, for network faults.

The chief's and workers' ``cluster.json`` names the PS at the proxy's port; the PS (under its agent) listens on
its real port, which its own ``cluster.json`` names (a TF server binds the address its cluster spec gives for
itself; the others only need a route to it). The agent's probes talk to the real port, so they see the PS as
healthy while the trainer cannot reach it: a partition, not a crash.

Modes (switched by the nemesis, recorded in the history before they take effect):

- ``pass``: bytes are forwarded as they come;
- ``delay``: each chunk of bytes is held ``delay`` seconds before it is forwarded (both directions);
- ``partition``: nothing is forwarded in either direction and new connections wait unanswered: what a
  dropped network path looks like to both sides (no RST, no FIN); ``heal`` returns to ``pass`` and the held
  bytes flow again;
- ``drop``: every open connection is reset and new ones are closed at once (a path that refuses).

Both sockets of a connection send at once (``TCP_NODELAY``): the proxy forwards each read as it comes, and an RPC's
message often comes in two writes; with Nagle's algorithm the second waited for the peer's delayed ACK (40 ms on
Linux), so every gRPC round trip to a PS through the proxy took 43 ms instead of 0.1 ms and a drawn case's
psguard side trained at 13-20% of its rate before any fault (explore seed 5, case 6). Now a small request and
its answer take about 0.1-0.3 ms more than direct and bulk bytes pass at about 1 GB/s (104 MB/s before).

Every connection is two pump threads; when both are done its sockets are closed and it is forgotten, so an
hour-long soak through the proxy keeps a bounded number of file descriptors and threads (it kept every socket
before: after about 500 connections a descriptor passed 1024, ``select()`` refused it, the accept loop died and
the store stayed unreachable for the rest of the run). Readiness is asked with ``poll()``, which has no such
limit. :meth:`close` stops them all (a stop event, sockets shut down, threads joined), so a run leaves no thread
behind.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from typing import Literal

log = logging.getLogger(__name__)

__all__ = ["TcpProxy"]

Mode = Literal["pass", "delay", "partition", "drop"]
#: Bytes a pump moves per read: a PS's gRPC answers carry whole shards (256 KB: about 1.15x the bulk rate of 64 KB).
_CHUNK = 256 * 1024


class TcpProxy:
    """Listens on ``127.0.0.1:listen_port`` and forwards to ``127.0.0.1:target_port``."""

    def __init__(self, listen_port: int, target_port: int, *, name: str = "proxy") -> None:
        self.listen_port = listen_port
        self.target_port = target_port
        self.name = name
        self.mode: Mode = "pass"
        self.delay = 0.0
        self._stop = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        self._lock = threading.Lock()
        self._conns: dict[int, tuple[socket.socket, socket.socket]] = {}  # open connections by id
        self._pumps_left: dict[int, int] = {}  # connection id -> its pump threads still running
        self._threads: list[threading.Thread] = []
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", listen_port))
        self._server.listen(64)
        self._accept = threading.Thread(target=self._accept_loop, name=f"chaos-{name}-accept", daemon=True)
        self._accept.start()

    def set_mode(self, mode: Mode, *, delay: float = 0.0) -> None:
        with self._lock:
            self.mode, self.delay = mode, delay
            conns = list(self._conns.values())
        if mode == "partition":
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode == "drop":
            for a, b in conns:
                _reset(a)
                _reset(b)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._accept_one()
            except Exception:  # one connection's trouble must not take the path down for the rest of the run
                log.exception("%s: accepting a connection failed", self.name)
                time.sleep(0.2)

    def _accept_one(self) -> None:
        if not _readable(self._server, 0.2):
            return
        try:
            client, _ = self._server.accept()
        except OSError:
            return
        if self.mode == "drop":
            _reset(client)
            return
        # A partitioned path: the connection waits, unanswered, until the heal (or the proxy's end).
        while not self._flowing.wait(0.2):
            if self._stop.is_set():
                client.close()
                return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        for s in (client, upstream):  # bytes go on as they come: see the module's text (Nagle's algorithm)
            with contextlib.suppress(OSError):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = id(client)
        with self._lock:
            self._conns[key] = (client, upstream)
            self._pumps_left[key] = 2
            self._threads = [t for t in self._threads if t.is_alive()]
        for src, dst, tag in ((client, upstream, "up"), (upstream, client, "down")):
            t = threading.Thread(target=self._pump, args=(key, src, dst), name=f"chaos-{self.name}-{tag}", daemon=True)
            t.start()
            with self._lock:
                self._threads.append(t)

    def _pump(self, key: int, src: socket.socket, dst: socket.socket) -> None:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        poller = _poller(src)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                while not self._flowing.wait(0.2):  # partitioned: hold the bytes (and read no more)
                    if self._stop.is_set():
                        return
                n = src.recv_into(buffer)
                if not n:
                    break
                if self.mode == "delay" and self.delay > 0:
                    time.sleep(self.delay)
                dst.sendall(view[:n])
        except (OSError, ValueError):  # reset or closed under us (drop, close): this direction is done
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            self._pump_done(key)

    def _pump_done(self, key: int) -> None:
        """The second pump of a connection to finish closes its sockets (the first may still be writing)."""
        with self._lock:
            left = self._pumps_left.get(key, 0) - 1
            if left > 0:
                self._pumps_left[key] = left
                return
            self._pumps_left.pop(key, None)
            pair = self._conns.pop(key, None)
        for s in pair or ():
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        self._stop.set()
        self._flowing.set()
        self._accept.join(5)
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
            threads = list(self._threads)
        for a, b in conns:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(5)
        for a, b in conns:
            a.close()
            b.close()


def _poller(sock: socket.socket) -> select.poll:
    """A ``poll()`` object watching ``sock`` for bytes, a connection or its end: ``poll()`` takes any descriptor
    (``select()`` refuses those past 1024)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
    return poller


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has something to read within ``timeout`` seconds."""
    return bool(_poller(sock).poll(timeout * 1000.0))


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a refusing middlebox would."""
    import struct

    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
