"""Port checks: a listener is seen, a bound or self-connected socket is not, and nothing connects to a loopback port."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from psguard.agent.process.prober import TcpProbe
from psguard.ports import LOWEST_CHOSEN, ephemeral_range, free_port, free_ports, listening, port_open, self_connected


@pytest.fixture
def self_connection() -> Iterator[tuple[socket.socket, int]]:
    """A socket bound to a port and connected to that same port: what an unlucky connect to a closed
    ephemeral port becomes (Linux picks the destination as the source port; simultaneous open succeeds)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.connect(("127.0.0.1", port))
    try:
        yield s, port
    finally:
        s.close()


def test_a_listener_is_open_and_a_closed_port_is_not() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert listening("127.0.0.1", port) is False, "bound is not listening"
        assert not port_open("127.0.0.1", port)
        s.listen()
        assert listening("127.0.0.1", port) is True
        assert port_open("127.0.0.1", port)
    assert not port_open("127.0.0.1", port)


def test_a_wildcard_listener_serves_loopback_and_another_loopback_address_does_not() -> None:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        assert port_open("127.0.0.1", s.getsockname()[1])
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_open("127.0.0.2", port)
        assert not port_open("127.0.0.1", port)


def test_an_ipv6_listener_is_found_in_the_v6_table() -> None:
    if not socket.has_ipv6:
        pytest.fail("this machine's Python has no IPv6; the v6 table cannot be checked here")
    with socket.socket(socket.AF_INET6) as s:
        try:
            s.bind(("::1", 0))
        except OSError as e:
            pytest.fail(f"no ::1 on this machine: {e}")
        s.listen()
        assert port_open("::1", s.getsockname()[1])


def test_a_self_connection_is_not_a_server(self_connection: tuple[socket.socket, int]) -> None:
    sock, port = self_connection
    assert self_connected(sock)
    assert not port_open("127.0.0.1", port), "nothing listens: the table says so without connecting"


def test_a_real_connection_is_not_a_self_connection() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            assert not self_connected(client)


def test_the_tcp_probe_fails_on_a_closed_port() -> None:
    probe = TcpProbe("127.0.0.1", free_port())
    result = probe.check(1.0)
    assert not result.ok and result.code == "refused"


def test_free_ports_are_below_the_ephemeral_range_where_no_outgoing_connection_can_take_them() -> None:
    """A cluster's ports are chosen before its tasks bind them: in the ephemeral range any process's outgoing
    connection could get one as its source port meanwhile and keep the task from binding it."""
    low, high = ephemeral_range()
    assert 0 < low <= high <= 65535
    ports = free_ports(20)
    assert len(set(ports)) == 20
    if low - LOWEST_CHOSEN > 2000:
        assert all(LOWEST_CHOSEN <= p < low for p in ports), (ports, low)
    for p in ports:  # free: a server can bind each
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    assert LOWEST_CHOSEN <= free_port() < low if low - LOWEST_CHOSEN > 2000 else free_port() > 0


def test_a_process_never_gets_a_port_it_was_handed_lately_again() -> None:
    """A caller binds its ports seconds after choosing them: a second choice in between must not return them
    (a benchmark's agents once got one of its cluster's ports)."""
    chosen = [p for _ in range(300) for p in free_ports(5)]
    assert len(set(chosen)) == len(chosen)
