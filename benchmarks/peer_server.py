"""The peer and the processes measured: llama.cpp's server started as its users run it (for
side_by_side.py and bench_moe.py), and any server's processes' CPU time and memory, read
from /proc."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from radixmesh.launcher import healthy


def proc_stat(pid: int) -> tuple[float, float]:
    """(CPU seconds, RSS MiB) of one process, from /proc; zeros once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    # After the command: state is field 3, utime 14, stime 15 and rss (pages) 24.
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    return cpu, int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Processes:
    """Named processes' CPU seconds and memory, read from /proc."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids

    def _total(self, field: int) -> dict[str, float]:
        return {name: sum(proc_stat(p)[field] for p in pids) for name, pids in self.pids.items()}

    def cpu(self) -> dict[str, float]:
        return self._total(0)

    def rss_mib(self) -> dict[str, float]:
        return self._total(1)

    @classmethod
    def of_mesh(cls, mesh: Any) -> Processes:
        """A running launcher.Mesh's processes by service, its embedded NATS included."""
        pids: dict[str, list[int]] = {}
        for child in mesh.children:
            pids.setdefault(child.service, []).append(child.proc.pid)
        if mesh.nats is not None and mesh.nats.pid is not None:
            pids["nats"] = [mesh.nats.pid]
        return cls(pids)


def llama_flags(args: argparse.Namespace) -> list[str]:
    """llama-server as its users run it: default flags, 16 slots, a context that holds the
    workloads' prompts in every slot, the benchmark's threads."""
    return ["-np", "16", "-c", "32768", "-t", str(args.threads), "-tb", str(args.threads),
            *args.llama_args.split()]


def llama_command(args: argparse.Namespace, port: int, model: Path | None = None) -> list[str]:
    """The peer's command line, on `model` (default: the bundled GGUF)."""
    from radixmesh.core.model_files import resolve_model_path

    model = model or resolve_model_path(None)
    return [args.llama_server, "-m", str(model), "--host", "127.0.0.1",
            "--port", str(port), *llama_flags(args)]


@contextmanager
def llama_server(
    args: argparse.Namespace, model: Path | None = None
) -> Iterator[tuple[str, int]]:
    """Start the peer on a free port (on `model`, default the bundled GGUF); its base URL
    and pid until the block ends."""
    from radixmesh.mesh.nats_server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as logfile:
        proc = subprocess.Popen(llama_command(args, port, model), stdout=logfile,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while not healthy(url + "/health"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    logfile.seek(0)
                    tail = logfile.read()[-3000:].decode(errors="replace")
                    raise RuntimeError(f"llama-server did not start:\n{tail}")
                time.sleep(0.25)
            yield url, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def llama_version(path: str) -> str:
    done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return next((ln for ln in lines if ln.startswith("version")), lines[-1] if lines else "?")
