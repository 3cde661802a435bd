"""Ports handed to child services: free, below the ephemeral range, never handed out twice
(a child may not have bound its port yet when the next one is picked)."""

from __future__ import annotations

import socket

from radixmesh.mesh.nats_server import free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(400)]  # ~10x what one large mesh takes
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < 32000 for p in ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
