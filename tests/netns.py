"""Two "hosts" on one machine for tests: two Linux network namespaces joined by a veth pair,
each with an address of its own and a loopback of its own, and the mesh's services started
inside them as real processes.

Why: a service that binds or announces 127.0.0.1 works on one machine and fails across
machines. In its own namespace each service can reach the other host only at that host's
address, so a service that listens on loopback, or tells others a loopback address, breaks
the mesh here as it would on two machines. Needs root (namespaces, veth) and `ip`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from radixmesh.core.flags import Settings, secrets_env, shared_values, to_flags
from radixmesh.core.service_settings import (
    DetokenizerConfig,
    SchedulerServiceConfig,
    TokenizerServiceConfig,
    WorkerConfig,
)
from radixmesh.launcher import MeshArgs
from radixmesh.mesh.nats_server import free_port, nats_server_binary, wait_for_port

IP = shutil.which("ip") or "/usr/sbin/ip"
NETNS_DIR = Path("/run/netns")  # where `ip netns add` mounts each namespace
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def have_netns() -> str | None:
    """Why namespaces cannot be made here, or None when they can (root and `ip`)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.access(IP, os.X_OK):
        return "the ip command (iproute2) is missing"
    if shutil.which("ss") is None:
        return "the ss command (iproute2) is missing"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([IP, *args], check=check, capture_output=True, text=True, timeout=30)


def _enter_netns(netns: str) -> None:
    """Move the calling thread (only it: a network namespace is per thread) into `netns`;
    every socket it opens from then on, and every process it starts, lives there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Host:
    """One network namespace as a host: its name and its address on the link.

    `call` runs a function on a thread that lives in the namespace, so the test (in the
    root namespace, which has no route to either host) can reach the services as a client
    on that host would, without a process per request."""

    def __init__(self, netns: str, addr: str) -> None:
        self.netns = netns
        self.addr = addr
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix=f"netns-{netns}", initializer=_enter_netns,
            initargs=(netns,),
        )

    def __repr__(self) -> str:
        return f"Host({self.netns!r}, {self.addr!r})"

    def exec_args(self, *argv: str) -> list[str]:
        """A command line that runs `argv` in this namespace."""
        return [IP, "netns", "exec", self.netns, *argv]

    def run(self, *argv: str, timeout: float = 30.0) -> str:
        """Run `argv` in this namespace; its output (CalledProcessError if it fails)."""
        done = subprocess.run(self.exec_args(*argv), check=True, capture_output=True,
                              text=True, timeout=timeout)
        return done.stdout

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 60.0) -> T:
        """`fn(*args)` on this host's thread (in the namespace)."""
        return self._thread.submit(fn, *args).result(timeout)

    def free_port(self) -> int:
        """A TCP port free on this host's address, never handed out before by this process."""
        return self.call(free_port, self.addr)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Hosts A and B: namespaces named uniquely for this run, joined by a veth pair, at .1
    and .2 of a random 10.x.y.0/24 (parallel runs pick their own), each with loopback up.
    Everything made is removed after the block, also when making it failed half-way;
    processes started in the namespaces must have ended by then."""
    tag = secrets.token_hex(3)
    names = (f"rm-{tag}-a", f"rm-{tag}-b")
    veths = (f"rm{tag}a", f"rm{tag}b")  # interface names: 15 characters at most
    rng = random.Random()
    subnet = f"10.{rng.randrange(1, 255)}.{rng.randrange(1, 255)}"
    made: list[str] = []
    hosts: list[Host] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for i, (name, veth) in enumerate(zip(names, veths, strict=True), start=1):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", f"{subnet}.{i}/24", "dev", veth)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", veth, "up")
            hosts.append(Host(name, f"{subnet}.{i}"))
        a, b = hosts
        _check_link(a, b)
        yield a, b
    finally:
        for host in hosts:
            host.close()
        for name in made:  # a veth goes with the namespace it is in, its peer with it
            _ip("netns", "del", name, check=False)
        _ip("link", "del", veths[0], check=False)  # made but never moved: still here


def _check_link(a: Host, b: Host, timeout: float = 10.0) -> None:
    """A connects to a socket listening on B's address: the link carries TCP."""
    with contextlib.closing(b.call(socket.create_server, (b.addr, 0))) as server:
        port = server.getsockname()[1]
        a.call(wait_for_port, b.addr, port, timeout, timeout=timeout + 5)


# ---- what the namespaces' sockets are ----------------------------------------------------


@dataclass(frozen=True)
class Socket:
    """One socket as `ss` lists it."""

    proto: str  # tcp or udp
    state: str  # LISTEN, ESTAB, TIME-WAIT, UNCONN...
    local: tuple[str, str]  # address, port
    peer: tuple[str, str]
    pids: frozenset[int]  # the processes holding it (none for TIME-WAIT)


def _endpoint(text: str) -> tuple[str, str]:
    """"10.1.2.3:80", "[::]:80", "*:80" or "127.0.0.53%lo:53" as (address, port); an IPv4
    address mapped into IPv6 (gRPC's dual-stack sockets, "[::ffff:10.1.2.3]:80") as IPv4."""
    addr, _, port = text.rpartition(":")
    addr = addr.strip("[]").split("%")[0]
    return addr.removeprefix("::ffff:") if "." in addr else addr, port


def sockets(host: Host, listening: bool = False) -> list[Socket]:
    """The TCP and UDP sockets in `host`'s namespace: the listening ones (and UDP sockets
    not connected), or all of them."""
    out = host.run("ss", "-H", "-n", "-p", "-t", "-u", "-l" if listening else "-a")
    found = []
    for line in out.splitlines():
        parts = line.split(None, 6)
        if len(parts) < 6:
            continue
        proto, state, _recv, _send, local, peer = parts[:6]
        users = parts[6] if len(parts) > 6 else ""
        pids = frozenset(int(p) for p in re.findall(r"pid=(\d+)", users))
        found.append(Socket(proto, state, _endpoint(local), _endpoint(peer), pids))
    return found


# ---- the mesh on the hosts -----------------------------------------------------------------


class EngineSpec(NamedTuple):
    """One engine (a scheduler and its worker) on `host`, with settings of its own: any
    setting the worker or the scheduler takes, by name ({"disaggregation_mode": "prefill"});
    each goes to whichever of the two declares it."""

    host: Host
    flags: dict[str, Any] = {}


@dataclass
class Service:
    """One process of the mesh: where it runs, what it listens on, where it logs."""

    name: str
    host: Host
    proc: subprocess.Popen[bytes]
    log: Path
    ports: dict[str, int]  # what each port is for -> the port
    health_url: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class HostMesh:
    """The running mesh: NATS, the tokenizer and the detokenizer on `front`, and engines."""

    front: Host
    services: dict[str, Service] = field(default_factory=dict)
    engine_ids: list[str] = field(default_factory=list)
    nats_url: str = ""
    url: str = ""  # the tokenizer's HTTP base URL, reached from `front`

    def get(self, path: str, timeout: float = 30.0) -> Any:
        """GET the tokenizer's `path` as a client on the front host would; the JSON back."""
        return self.front.call(http_json, self.url + path, None, timeout, timeout=timeout + 5)

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
        """POST `body` to the tokenizer's `path` from the front host; the JSON back."""
        return self.front.call(http_json, self.url + path, body, timeout, timeout=timeout + 5)

    def on(self, host: Host) -> list[Service]:
        """The services running on `host`."""
        return [s for s in self.services.values() if s.host is host]

    def check_alive(self) -> None:
        """Raise, with its log, if any service has exited."""
        for s in self.services.values():
            code = s.proc.poll()
            if code is not None:
                raise RuntimeError(f"{s.name} exited with code {code}:\n{s.log_tail()}")


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(url: str, body: dict[str, Any] | None, timeout: float) -> Any:
    """GET (body None) or POST JSON; the JSON answer. An HTTP error raises with its body."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with _NO_PROXY.open(request, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}: HTTP {exc.code}: {exc.read()[:2000]!r}") from None


def _healthy(url: str) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _names(config: type[Settings]) -> set[str]:
    return {f.name for f in dataclasses.fields(config)}


def _engine_ids(engines: Sequence[EngineSpec]) -> list[str]:
    """As `radixmesh up` names them: e0, e1... without a role, p0, d0... in one."""
    ids = []
    for e, spec in enumerate(engines):
        role = spec.flags.get("disaggregation_mode", "null")
        ids.append(f"e{e}" if role == "null" else
                   f"{role[0]}{sum(i.startswith(role[0]) for i in ids)}")
    return ids


class _Starter:
    """Starts the services of one mesh, each inside its host's namespace with the settings
    it shares with `args` (as `radixmesh up` hands them down) and its own."""

    def __init__(self, mesh: HostMesh, args: MeshArgs, log_dir: Path) -> None:
        self.mesh, self.args, self.log_dir = mesh, args, log_dir

    def spawn(self, name: str, host: Host, module: str, config: type[Settings],
              own: dict[str, Any], ports: dict[str, int], health_port: int | None) -> Service:
        values = {**shared_values(replace(self.args, host=host.addr), config), **own}
        if "nats_url" in _names(config):
            values["nats_url"] = self.mesh.nats_url
        values, env = secrets_env(config, values)  # off the command line, as the launcher
        argv = [sys.executable, "-m", module, *to_flags(config, values)]
        return self._start(name, host, argv, env, ports, health_port)

    def _start(self, name: str, host: Host, argv: list[str], env: dict[str, str],
               ports: dict[str, int], health_port: int | None) -> Service:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(  # `ip netns exec` execs: proc.pid is the service's
                host.exec_args(*argv), stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **env}, start_new_session=True,
            )
        url = None if health_port is None else f"http://{host.addr}:{health_port}/health"
        service = Service(name, host, proc, log, ports, url)
        self.mesh.services[name] = service
        return service

    def nats(self, host: Host, store: str) -> None:
        """nats-server with JetStream (as `radixmesh up` runs it) on the front host only."""
        port = host.free_port()
        argv = [nats_server_binary(), "-a", host.addr, "-p", str(port), "-js", "-sd", store]
        service = self._start("nats", host, argv, {}, {"client": port}, None)
        self.mesh.nats_url = f"nats://{host.addr}:{port}"
        try:
            host.call(wait_for_port, host.addr, port, 15.0, timeout=20)
        except TimeoutError:
            raise RuntimeError(f"nats-server did not listen:\n{service.log_tail()}") from None

    def engine(self, engine_id: str, spec: EngineSpec) -> None:
        """The engine's worker (one rank, one torch thread) and its scheduler, which drives
        the worker at the host's address."""
        host, extra = spec
        for name in extra:
            if not any(name in _names(c) for c in (WorkerConfig, SchedulerServiceConfig)):
                raise ValueError(f"neither the worker nor the scheduler takes {name!r}")
        port, metrics = host.free_port(), host.free_port()
        worker = {"port": port, "metrics_port": metrics, "tp_size": 1, "tp_rank": 0,
                  "num_threads": 1}
        worker.update({k: v for k, v in extra.items() if k in _names(WorkerConfig)})
        self.spawn(f"worker-{engine_id}", host, "radixmesh.services.worker", WorkerConfig,
                   worker, {"grpc": port, "metrics": metrics}, metrics)
        metrics = host.free_port()
        scheduler = {"engine_id": engine_id, "worker_addrs": f"{host.addr}:{port}",
                     "metrics_port": metrics}
        scheduler.update({k: v for k, v in extra.items() if k in _names(SchedulerServiceConfig)})
        self.spawn(f"scheduler-{engine_id}", host, "radixmesh.services.scheduler",
                   SchedulerServiceConfig, scheduler, {"metrics": metrics}, metrics)

    def front(self, host: Host) -> None:
        metrics = host.free_port()
        self.spawn("detokenizer", host, "radixmesh.services.detokenizer", DetokenizerConfig,
                   {"replica_id": "d0", "metrics_port": metrics}, {"metrics": metrics}, metrics)
        http, grpc = host.free_port(), host.free_port()
        self.spawn("tokenizer", host, "radixmesh.services.tokenizer", TokenizerServiceConfig,
                   {"replica_id": "t0", "port": http, "grpc_port": grpc},
                   {"http": http, "grpc": grpc}, http)
        self.mesh.url = f"http://{host.addr}:{http}"

    def wait_healthy(self, timeout: float) -> None:
        """Until every service's /health answers 200 (the tokenizer's: it has heard an
        engine), then until the tokenizer has heard every engine, so that routing sees the
        whole layout; raises with the log of a service that exited or never got healthy."""
        deadline = time.monotonic() + timeout
        pending = [s for s in self.mesh.services.values() if s.health_url]
        while pending:
            self.mesh.check_alive()
            pending = [s for s in pending if not s.host.call(_healthy, s.health_url)]
            if pending and time.monotonic() > deadline:
                logs = "\n".join(f"--- {s.name}:\n{s.log_tail()}" for s in pending)
                raise TimeoutError(f"not healthy after {timeout:.0f} s:\n{logs}")
            if pending:
                time.sleep(0.2)
        want = set(self.mesh.engine_ids)
        while not want <= set(self.mesh.get("/server_info")["engines"]):
            self.mesh.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the tokenizer never heard all of {sorted(want)}")
            time.sleep(0.2)


def _stop(services: Sequence[Service], grace: float = 15.0) -> None:
    """SIGTERM each (in the order given), wait, then kill the process group (the service
    and anything it started) of each one still running."""
    for s in services:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for s in services:
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # still alive, so the group is still its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()


@contextmanager
def mesh_on_hosts(
    front: Host, engines: Sequence[EngineSpec], log_dir: str | Path,
    settings: dict[str, Any], timeout: float = 300.0,
) -> Iterator[HostMesh]:
    """The mesh spread over hosts: NATS (JetStream on), the detokenizer and the tokenizer on
    `front`, each of `engines` on the host it names, every service bound to and announcing its
    host's address. `settings` are the mesh's (`MeshArgs` fields: dtype, max_total_tokens...),
    handed to every service that takes them. Healthy inside the block; every process is
    stopped after it, also when starting failed."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    args = MeshArgs(port=0, grpc_port=0, **settings)
    mesh = HostMesh(front, engine_ids=_engine_ids(engines))
    starter = _Starter(mesh, args, log_dir)
    with tempfile.TemporaryDirectory(prefix="radixmesh-nats-") as store:
        try:
            starter.nats(front, store)
            for engine_id, spec in zip(mesh.engine_ids, engines, strict=True):
                starter.engine(engine_id, spec)
            starter.front(front)
            starter.wait_healthy(timeout)
            yield mesh
        finally:
            # Front doors first, and NATS only once the others are gone (as `radixmesh up`
            # stops them): a service draining its NATS connection as it stops needs it.
            services = list(reversed(mesh.services.values()))
            _stop([s for s in services if s.name != "nats"])
            _stop([s for s in services if s.name == "nats"])
