"""``free_port``: the port a test server, a rendezvous store or the demo listens on."""

from __future__ import annotations

import socket

from auditor.server.run import _ephemeral_low, free_port


def test_ports_come_from_below_the_ephemeral_range_and_can_be_bound():
    """Ports of the ephemeral range are what outgoing connections take as their local port
    (a parallel test worker's HTTP client took a rendezvous port, EADDRINUSE in CI): every
    port handed out lies in [10000, low of ip_local_port_range), is free, and 50 draws are
    not one port over and over (bind(0) handed two workers the same one)."""
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert all(10_000 <= p < low for p in ports), ports
    assert len(set(ports)) > 40, ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
