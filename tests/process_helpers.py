"""Real radixmesh processes for tests: the whole mesh, or one service module."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from radixmesh.launcher import Mesh, MeshArgs


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
