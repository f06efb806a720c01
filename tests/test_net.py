"""free_port: ports outside the ranges that others take without asking, never handed out twice."""

from __future__ import annotations

import socket

from tokenflow import net


def _ephemeral_range() -> range:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    return range(low, high + 1)


def test_free_ports_are_outside_the_kernels_ephemeral_range_and_distinct() -> None:
    ports = [net.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    ephemeral = _ephemeral_range()
    assert not [p for p in ports if p in ephemeral or 10002 <= p <= 19999 or 30000 <= p <= 31000]


def test_a_held_port_is_skipped() -> None:
    port = net._PORT_RANGE.start + 5
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        net._port_cursor = port - net._PORT_RANGE.start - 1  # the held port is next in the walk
        assert net.free_port() == port + 1
