"""Ports handed to child services: free, below the ephemeral range, never handed out twice
(a child may not have bound its port yet when the next one is picked), never one the user
configured; a configured port that is taken stops `radixmesh up` at once, named."""

from __future__ import annotations

import socket

import pytest

from radixmesh.launcher import Mesh, MeshArgs
from radixmesh.mesh import nats_server
from radixmesh.mesh.nats_server import free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(400)]  # ~10x what one large mesh takes
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < 32000 for p in ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_configured_ports_are_never_handed_to_another_service(monkeypatch):
    configured = []
    for _ in range(2):  # two ports free now, from outside free_port's own range
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            configured.append(s.getsockname()[1])
    real = nats_server._port_rng.randrange
    picks = iter(configured)
    monkeypatch.setattr(nats_server._port_rng, "randrange",
                        lambda *a: next(picks, None) or real(*a))
    mesh = Mesh(MeshArgs(port=configured[0], grpc_port=configured[1]))
    mesh._pick_front_ports()
    assert mesh._front_ports == [tuple(configured)]
    # free_port's random picks hit the configured ports first, and skip them.
    assert not {free_port(), free_port()} & set(configured)


def test_a_taken_configured_port_is_an_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mesh = Mesh(MeshArgs(port=free_port(), grpc_port=port, tokenizers=1))
        with pytest.raises(OSError, match=f"--grpc-port {port} on 127.0.0.1 is taken"):
            mesh.start(timeout=5)
        assert not mesh.children
