"""Real processes for tests: the whole mesh, one service module, or a Redis of their own."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from radixmesh.launcher import Mesh, MeshArgs
from radixmesh.mesh.nats_server import free_port, wait_for_port


@contextmanager
def running_mesh(log_dir: str | Path, **args: Any) -> Iterator[Mesh]:
    """The mesh (`MeshArgs(**args)`) on free ports, its logs under `log_dir`, healthy inside
    the block and stopped after it."""
    mesh_args = MeshArgs(port=0, grpc_port=0, log_dir=str(log_dir), **args)
    with Mesh(mesh_args).start(timeout=300) as mesh:
        yield mesh


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
