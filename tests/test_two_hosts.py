"""The mesh on two hosts (two network namespaces joined by a veth pair, see netns.py): every
service binds to and announces its own host's address, and requests through the tokenizer
on host A give exactly the in-process Engine's tokens.

Why: on one machine every address is loopback, so a service that listens on 127.0.0.1 or
hands out a loopback address to the other services passes every other test and fails the
first time the mesh spans machines. Here each host has its own loopback, and the only way
between the hosts is the link.

Layouts (one mesh each, started once for the tests that use it):
- null: NATS, tokenizer and detokenizer on A; one ordinary engine (worker + scheduler) on B.
- pd: the same front on A; a prefill engine on B and a decode engine on A, the prompt's KV
  sent from B's worker to A's over gRPC (prefill/decode disaggregation).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from netns import EngineSpec, Host, HostMesh, have_netns, mesh_on_hosts, sockets, two_hosts

from radixmesh.api import Engine

pytestmark = pytest.mark.skipif(have_netns() is not None, reason=str(have_netns()))

# What both the mesh and the in-process engine run with: float32, whose greedy tokens do
# not depend on batching or scheduling, and a small KV pool.
SETTINGS: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 1024}
GREEDY = {"temperature": 0, "max_new_tokens": 16}
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
]
# KV crosses hosts only over gRPC: both namespaces share one /dev/shm, which would let a
# shared-memory transfer pass where two machines could not. A transfer of these prompts
# takes milliseconds; a short timeout makes a lost one fail the test in seconds, not 60.
GRPC = {"disaggregation_transfer_backend": "grpc", "disaggregation_timeout": 20.0}


def null_layout(a: Host, b: Host) -> list[EngineSpec]:
    """One engine doing prefill and decode, on B."""
    return [EngineSpec(b, {})]


def pd_layout(a: Host, b: Host) -> list[EngineSpec]:
    """A prefill engine on B, a decode engine on A: the KV goes from B to A."""
    return [
        EngineSpec(b, {"disaggregation_mode": "prefill", **GRPC}),
        EngineSpec(a, {"disaggregation_mode": "decode", **GRPC}),
    ]


LAYOUTS = {"null": null_layout, "pd": pd_layout}


@pytest.fixture(scope="module")
def expected() -> list[dict[str, Any]]:
    """Each prompt's answer from the in-process Engine, computed before any mesh starts
    (so the two do not share the CPU) and freed after."""
    answers = []
    with Engine(**SETTINGS, show_progress=False, random_seed=0) as engine:
        for prompt in PROMPTS:
            out = engine.generate(prompt, GREEDY)
            assert isinstance(out, dict) and out["output_ids"], out
            answers.append(out)
    return answers


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    with two_hosts() as pair:
        yield pair


@pytest.fixture(scope="module")
def mesh(request: pytest.FixtureRequest, expected: list[dict[str, Any]],
         hosts: tuple[Host, Host], tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostMesh]:
    """The mesh in the layout the test names (indirect parameter): started once per layout,
    stopped before the next one starts. Depends on `expected` so that the reference runs
    first, alone."""
    a, b = hosts
    log_dir = tmp_path_factory.mktemp(f"two-hosts-{request.param}")
    with mesh_on_hosts(a, LAYOUTS[request.param](a, b), log_dir, SETTINGS) as m:
        yield m


def generate_all(mesh: HostMesh) -> list[dict[str, Any]]:
    """Each prompt through the tokenizer on A, one after another; a service that died on
    the way fails the test with its log rather than with the next request's timeout."""
    answers = []
    for prompt in PROMPTS:
        answers.append(mesh.post("/generate", {"text": prompt, "sampling_params": GREEDY}))
        mesh.check_alive()
    return answers


def assert_same_tokens(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    for prompt, g, w in zip(PROMPTS, got, want, strict=True):
        assert g["output_ids"] == w["output_ids"], (prompt, g, w)
        assert g["text"] == w["text"], prompt


def assert_listening_on_own_address(mesh: HostMesh, hosts: tuple[Host, Host]) -> None:
    """Every listening socket on each host is on that host's address (nothing on loopback
    or a wildcard; the namespaces are fresh, so each socket there is the mesh's), and each
    service listens on each of its ports there."""
    for host in hosts:
        listening = sockets(host, listening=True)
        stray = [s for s in listening if s.local[0] != host.addr]
        assert not stray, (host, stray)
        for service in mesh.on(host):
            for purpose, port in service.ports.items():
                assert any(s.local == (host.addr, str(port)) and service.pid in s.pids
                           for s in listening), (service.name, purpose, port, listening)


def connected(host: Host, pid: int, peer: tuple[str, int]) -> bool:
    """Whether process `pid` on `host` has a TCP connection open to `peer`."""
    want = (peer[0], str(peer[1]))
    return any(s.proto == "tcp" and s.state == "ESTAB" and pid in s.pids and s.peer == want
               for s in sockets(host))


@pytest.mark.parametrize("mesh", ["null"], indirect=True)
def test_engine_on_b_gives_the_in_process_engines_tokens(mesh, expected):
    got = generate_all(mesh)
    assert_same_tokens(got, expected)
    (state,) = mesh.get("/server_info")["internal_states"]
    assert state["engine_id"] == "e0"


@pytest.mark.parametrize("mesh", ["null"], indirect=True)
def test_every_service_listens_and_connects_on_its_hosts_address(mesh, hosts):
    a, b = hosts
    mesh.check_alive()
    assert_listening_on_own_address(mesh, hosts)
    worker, scheduler = mesh.services["worker-e0"], mesh.services["scheduler-e0"]
    nats_port = mesh.services["nats"].ports["client"]
    assert worker.host is b and scheduler.host is b
    # The scheduler drives its worker at B's address (its worker_addrs), and reaches NATS
    # on A across the link; the front services reach NATS at A's address too.
    assert connected(b, scheduler.pid, (b.addr, worker.ports["grpc"]))
    assert connected(b, scheduler.pid, (a.addr, nats_port))
    for name in ("tokenizer", "detokenizer"):
        assert connected(a, mesh.services[name].pid, (a.addr, nats_port)), name


@pytest.mark.parametrize("mesh", ["pd"], indirect=True)
def test_prefill_on_b_decode_on_a_gives_the_in_process_engines_tokens(mesh, expected, hosts):
    got = generate_all(mesh)
    assert_same_tokens(got, expected)
    # Tokens alone cannot tell disaggregation happened: a decode engine that gets no KV
    # prefills the prompt itself (a fallback) and gives the same tokens. Each answer must
    # say its prompt was prefilled on B's engine and its KV arrived on A's.
    for prompt, out in zip(PROMPTS, got, strict=True):
        moved = out["meta_info"].get("disaggregation")
        assert moved is not None, (prompt, out["meta_info"])
        assert (moved["prefill_engine"], moved["decode_engine"]) == ("p0", "d0"), moved
        assert "fallback" not in moved and moved["transfer_tokens"] > 0, (prompt, moved)
    assert_listening_on_own_address(mesh, hosts)
