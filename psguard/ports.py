"""Free loopback ports and waiting for them to accept connections."""

from __future__ import annotations

import socket
import time


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


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
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
