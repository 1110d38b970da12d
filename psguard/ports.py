"""Free loopback ports and waiting for them to accept connections.

A connect to a closed port in the ephemeral range can connect to itself (TCP simultaneous open), and that socket
then keeps the real server from binding its port. So a loopback port is looked up in the kernel's listening table
without connecting, and a connection whose two ends are one address is refused. Free ports are chosen *below* the
ephemeral range where there is room: the kernel never gives such a port to an outgoing connection in the seconds
before its server binds it.
"""

from __future__ import annotations

import collections
import ipaddress
import random
import socket
import threading
import time
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


#: The lowest port :func:`free_ports` chooses below the ephemeral range (above the usual services' ports).
LOWEST_CHOSEN = 15000
#: The fewest ports below the ephemeral range worth choosing from; with fewer the OS picks (in the range).
_MIN_ROOM = 2000


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (``/proc/sys/net/ipv4/ip_local_port_range``)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago, below the ephemeral range where there is room."""
    return free_ports(1, host)[0]


#: Ports this process handed out lately, never handed out again soon: a caller binds them seconds later (a
#: benchmark chose a cluster's ports, then its agents' HTTP ports, and got one of the cluster's again).
_RECENT: collections.deque[int] = collections.deque(maxlen=4096)
_RECENT_LOCK = threading.Lock()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``n`` distinct free ports, holding all of them open until all are chosen. Random ones below the
    ephemeral range when it leaves room (see the module docstring), else ones the OS picks; none this process
    handed out among its last 4,096."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, high = LOWEST_CHOSEN, ephemeral_range()[0] - 1
    socks: list[socket.socket] = []
    rng = random.SystemRandom()
    with _RECENT_LOCK:
        try:
            tries = 0
            while len(socks) < n:
                tries += 1
                s = socket.socket(family, socket.SOCK_STREAM)
                try:
                    if high - low >= _MIN_ROOM and tries <= 50 * n:
                        s.bind((host, rng.randint(low, high)))
                    else:
                        s.bind((host, 0))
                except OSError:
                    s.close()
                    continue
                if int(s.getsockname()[1]) in _RECENT and tries <= 100 * n:
                    s.close()
                    continue
                socks.append(s)
            ports = [int(s.getsockname()[1]) for s in socks]
            _RECENT.extend(ports)
            return ports
        finally:
            for s in socks:
                s.close()


def listening(host: str, port: int) -> bool | None:
    """Whether a local socket listens on ``host:port`` (or on the wildcard), read from the kernel's table.

    ``None`` when the table cannot be read (no /proc): the caller falls back to connecting.
    """
    try:
        want = ipaddress.ip_address(host)
    except ValueError:
        return None
    found = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        found = False
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != _LISTEN:
                continue
            addr_hex, port_hex = fields[1].split(":")
            if int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(addr_hex)  # 32-bit words in host (little-endian) byte order
            addr = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
            mapped = getattr(addr, "ipv4_mapped", None)
            if addr.is_unspecified or addr == want or (mapped is not None and mapped == want):
                return True
    return found


def self_connected(sock: socket.socket) -> bool:
    """A connected socket whose two ends are one address: no server answered (see the module docstring)."""
    return bool(sock.getsockname()[:2] == sock.getpeername()[:2])


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on ``host:port``.

    A loopback address is checked in the kernel's listening table (no connection, so no self-connection
    that would keep the port from its server); other hosts by connecting.
    """
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # a name ("localhost") may resolve to ::1, 127.0.0.1 or both: connect
    if loopback:
        known = listening(host, port)
        if known is not None:
            return known
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            return not self_connected(s)
    except OSError:
        return False


def wait_port(host: str, port: int, timeout: float, *, what: str = "server") -> None:
    """Block until ``host:port`` accepts connections; raise ``TimeoutError`` naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not accept connections on {host}:{port} within {timeout:.0f}s")
