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
    picks = iter([25000, 25001, 25002, 25003])
    monkeypatch.setattr(nats_server._port_rng, "randrange", lambda *_: next(picks))
    mesh = Mesh(MeshArgs(port=25001, grpc_port=25003))
    mesh._pick_front_ports()
    assert mesh._front_ports == [(25001, 25003)]
    # The random picks that hit the configured ports are skipped.
    assert [free_port(), free_port()] == [25000, 25002]


def test_a_taken_configured_port_is_an_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mesh = Mesh(MeshArgs(port=free_port(), grpc_port=port, tokenizers=1))
        with pytest.raises(OSError, match=f"--grpc-port {port} on 127.0.0.1 is taken"):
            mesh.start(timeout=5)
        assert not mesh.children
