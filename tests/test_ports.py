"""Ports handed to child services: free, below the ephemeral range, never handed out twice
(a child may not have bound its port yet when the next one is picked), never one the user
configured; a configured port that is taken stops `radixmesh up` at once, named; a port
whose server stopped a moment ago is not taken, so the mesh starts again on it at once."""

from __future__ import annotations

import json
import socket
import urllib.request

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


def _time_wait_on(port: int) -> None:
    """Leave a connection of a server on `port` in TIME_WAIT, as a stopped server does: the
    server side closes first, then the listener goes."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with socket.create_connection(("127.0.0.1", port)) as client:
            served, _ = listener.accept()
            served.close()
            client.recv(1)  # the server's FIN arrived: the client side closes second


def test_a_port_whose_server_just_stopped_is_free_to_reserve():
    port = free_port()
    _time_wait_on(port)
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what made the port look taken
    nats_server.reserve_ports("127.0.0.1", {port: "--port"})


def test_the_mesh_starts_again_on_its_ports_right_after_serving(tmp_path):
    port, grpc_port = free_port(), free_port()
    args = MeshArgs(port=port, grpc_port=grpc_port, log_dir=str(tmp_path), max_total_tokens=2048)
    body = json.dumps({"text": "Hello", "sampling_params": {"max_new_tokens": 2,
                                                           "temperature": 0}}).encode()

    def generate(mesh: Mesh) -> dict:
        request = urllib.request.Request(f"{mesh.url}/generate", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:  # Connection: close
            return json.load(resp)

    with Mesh(args).start(timeout=300) as mesh:
        assert mesh.url == f"http://127.0.0.1:{port}"
        first = [generate(mesh) for _ in range(3)]
    with Mesh(args).start(timeout=300) as mesh:
        assert mesh.url == f"http://127.0.0.1:{port}"
        assert generate(mesh)["text"] == first[0]["text"]
