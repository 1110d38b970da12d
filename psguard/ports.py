"""Free loopback ports and waiting for them to accept connections.

A connect to a closed port in the ephemeral range can *connect to itself*: Linux may pick the destination port
as the source port, and the TCP simultaneous open then succeeds with no listener at all. The check says
"open", and for as long as that socket lives the real server cannot bind its port (it dies with "address in
use"). Both checks here rule that out: a loopback port is looked up in the kernel's listening table without
connecting, and a connection whose two ends are the same address is refused and closed at once.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago (the OS picks it, so parallel runs rarely collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``n`` distinct free ports, holding all of them open until all are chosen."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _proc_address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address column of /proc/net/tcp{,6}: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


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
            addr = _proc_address(addr_hex)
            mapped = getattr(addr, "ipv4_mapped", None)
            if addr.is_unspecified or addr == want or (mapped is not None and mapped == want):
                return True
    return found


def self_connected(sock: socket.socket) -> bool:
    """A connected socket whose two ends are one address: no server answered (see the module docstring)."""
    return bool(sock.getsockname()[:2] == sock.getpeername()[:2])


def _connects(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            return not self_connected(s)
    except OSError:
        return False


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
    return _connects(host, port, timeout)


def wait_port(host: str, port: int, timeout: float, *, what: str = "server") -> None:
    """Block until ``host:port`` accepts connections; raise ``TimeoutError`` naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not accept connections on {host}:{port} within {timeout:.0f}s")
