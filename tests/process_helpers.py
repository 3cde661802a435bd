"""Real processes for tests: the whole mesh, one service module, a NATS cluster or a Redis of
their own."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from radixmesh.launcher import Mesh, MeshArgs
from radixmesh.mesh.nats_server import EmbeddedNats, free_port, wait_for_port


@contextmanager
def running_mesh(log_dir: str | Path, **args: Any) -> Iterator[Mesh]:
    """The mesh (`MeshArgs(**args)`) on free ports, its logs under `log_dir`, healthy inside
    the block and stopped after it."""
    mesh_args = MeshArgs(port=0, grpc_port=0, log_dir=str(log_dir), **args)
    with Mesh(mesh_args).start(timeout=300) as mesh:
        yield mesh


def mesh_generates(
    model_path: str | Path, log_dir: str | Path, prompts: list[list[int]],
    sampling_params: dict[str, Any],
) -> tuple[dict[str, Any], list[list[int]]]:
    """A float32 mesh on `model_path`: its /get_model_info, and each prompt's output ids
    through /generate (each asserted to succeed)."""
    info, answers = mesh_answers(model_path, log_dir, prompts, sampling_params)
    return info, [answer["output_ids"] for answer in answers]


def mesh_answers(
    model_path: str | Path, log_dir: str | Path, prompts: list[list[int]],
    sampling_params: dict[str, Any],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A float32 mesh on `model_path`: its /get_model_info, and each prompt's /generate
    answer (each asserted to succeed), one after the other."""
    import httpx

    with running_mesh(log_dir, model_path=str(model_path), dtype="float32",
                      max_total_tokens=512) as mesh, httpx.Client(base_url=mesh.url,
                                                                   timeout=120) as client:
        info = client.get("/get_model_info").json()
        answers = []
        for ids in prompts:
            out = client.post("/generate", json={"input_ids": ids,
                                                 "sampling_params": sampling_params})
            assert out.status_code == 200, out.text
            answers.append(out.json())
    return info, answers


@contextmanager
def nats_cluster(size: int = 3) -> Iterator[list[EmbeddedNats]]:
    """`size` NATS servers with JetStream on loopback ports, routed into one cluster (its
    URL list: ",".join(node.url for node in nodes)); yielded once JetStream answers, stopped
    after the block."""
    routes = [free_port() for _ in range(size)]
    nodes = [
        EmbeddedNats(jetstream=True, args=[
            "--server_name", f"node{i}", "--cluster_name", "radixmesh",
            "--cluster", f"nats://127.0.0.1:{port}",
            "--routes", ",".join(f"nats://127.0.0.1:{p}" for p in routes if p != port),
        ])
        for i, port in enumerate(routes)
    ]
    try:
        for node in nodes:
            node.start()
        asyncio.run(_jetstream_ready(",".join(node.url for node in nodes)))
        yield nodes
    finally:
        for node in nodes:
            node.stop()


async def _jetstream_ready(url: str, timeout: float = 60.0) -> None:
    """Until the cluster's JetStream has a leader and answers."""
    import nats

    deadline = time.monotonic() + timeout
    nc = await nats.connect(url.split(","))
    try:
        while True:
            try:
                await nc.jetstream(timeout=2).account_info()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


@contextmanager
def service_process(
    module: str, *flags: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """`python -m <module> <flags>` with its stderr piped as text; killed after the block
    unless it has exited by then."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *flags], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextmanager
def redis_server(folder: str | Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A redis-server of the test's own (no persistence) on a free loopback port: its
    process and URL. The test is skipped, saying why, where the binary is missing."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not on PATH: the Redis storage backend goes untested")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(folder)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 10)
        yield proc, f"redis://127.0.0.1:{port}/0"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)
