"""`radixmesh up`: every service of the mesh as processes on loopback, plus an embedded
NATS server unless one is given; stops them all on Ctrl-C or when one dies."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from radixmesh.core.bus import bus_redacted
from radixmesh.core.flags import Settings, secrets_env, shared_values, to_flags
from radixmesh.core.hicache import HiCacheSettings, HiCacheStorageSettings, shm_root
from radixmesh.core.model_files import resolve_model_path
from radixmesh.core.service_settings import (
    CachectlConfig,
    ChatSettings,
    DetokenizerConfig,
    DisaggregationSettings,
    FrontDoorSettings,
    MeshSettings,
    NatsSettings,
    SchedulerServiceConfig,
    ServiceSettings,
    StatusSettings,
    TokenizerServiceConfig,
    WorkerConfig,
)
from radixmesh.core.settings import (
    DecodingSettings,
    DeviceSettings,
    KVSettings,
    LoraSettings,
    ModelSettings,
    ScheduleSettings,
    SpeculativeSettings,
)
from radixmesh.mesh.nats_server import EmbeddedNats, free_port, reserve_ports
from radixmesh.supervisor import Process, Supervisor
from radixmesh.tracing.config import exporter_env, instance_env
from radixmesh.tracing.receiver import JsonlSink, SpanReceiver

# Each service's config: the settings it takes as flags.
SERVICE_CONFIGS: dict[str, type[Settings]] = {
    "worker": WorkerConfig,
    "scheduler": SchedulerServiceConfig,
    "detokenizer": DetokenizerConfig,
    "tokenizer": TokenizerServiceConfig,
    "cachectl": CachectlConfig,
}


@dataclass(frozen=True, kw_only=True)
class MeshArgs(
    DisaggregationSettings,
    ChatSettings,
    FrontDoorSettings,
    ServiceSettings,
    SpeculativeSettings,
    HiCacheSettings,
    HiCacheStorageSettings,
    LoraSettings,
    DecodingSettings,
    ScheduleSettings,
    KVSettings,
    DeviceSettings,
    ModelSettings,
    MeshSettings,
):
    """What `radixmesh up` starts and how; every service gets the settings it shares."""

    extra_env: dict[str, str] = field(default_factory=dict)  # more variables for every service


def pin_model(args: MeshArgs) -> MeshArgs:
    """`args` with the model as a local path: a hub repo is fetched once, here, and every
    service loads that one snapshot, even if its branch moves meanwhile."""
    if args.model_path is None:
        return args
    path = resolve_model_path(args.model_path, args.revision)
    return replace(args, model_path=str(path), revision=None)


class Mesh:
    """Start with `start()`, stop with `stop()`; or `with Mesh(args) as mesh:`."""

    def __init__(self, args: MeshArgs) -> None:
        self.args = args
        self.children: list[Process] = []
        self.supervisor: Supervisor | None = None
        self._metrics_server: WSGIServer | None = None
        self.metrics_url = ""  # the supervisor's metrics, once started
        self.nats: EmbeddedNats | None = None
        self.nats_url = args.nats_url or ""
        self.http_urls: list[str] = []
        self.grpc_addrs: list[str] = []
        self._front_ports: list[tuple[int, int]] = []  # each tokenizer's HTTP and gRPC port
        self.spans: SpanReceiver | None = None  # with trace_file: what every service sent

    @property
    def url(self) -> str:
        """The first tokenizer's HTTP base URL."""
        return self.http_urls[0]

    def start(self, timeout: float = 600.0) -> Mesh:
        """Start everything and wait until every service reports healthy."""
        try:
            self.args = pin_model(self.args)
            self._pick_front_ports()
            if not self.nats_url:
                # JetStream: the storage tier's objects and the workers found by schedulers
                # started beside the mesh.
                self.nats = EmbeddedNats(self.args.host, jetstream=True).start()
                self.nats_url = self.nats.url
            if self.args.trace_file:
                self.spans = SpanReceiver(JsonlSink(self.args.trace_file)).start()
            roles = self.args.engine_roles
            ranks = sum(self.args.engine_tp_size(role) for role in roles)
            for e, role in enumerate(roles):
                self._start_engine(e, role, ranks)
            for d in range(self.args.detokenizers):
                self._spawn(f"detokenizer-{d}", "detokenizer", {"replica_id": f"d{d}"})
            for t in range(self.args.tokenizers):
                self._start_tokenizer(t)
            self._wait_healthy(timeout)
            self.supervisor = Supervisor(self.children)
            self.supervisor.start()
            # The supervisor's restart counters, on a port of the launcher's own.
            port = free_port(self.args.host)
            self._metrics_server = start_http_server(port, self.args.host)[0]
            self.metrics_url = f"http://{self.args.host}:{port}/metrics"
        except BaseException:
            self.stop()
            raise
        return self

    def _pick_front_ports(self) -> None:
        """The tokenizers' ports: those configured (checked free now, and never handed to
        another service) or free ones."""
        a = self.args
        configured: dict[int, str] = {}
        for t in range(a.tokenizers):
            if a.port:
                configured[a.port + t] = "--port" if t == 0 else f"--port + {t}"
            if a.grpc_port:
                configured[a.grpc_port + t] = "--grpc-port" if t == 0 else f"--grpc-port + {t}"
        reserve_ports(a.host, configured)
        self._front_ports = [
            (a.port + t if a.port else free_port(a.host),
             a.grpc_port + t if a.grpc_port else free_port(a.host))
            for t in range(a.tokenizers)
        ]

    def _shm_dir(self) -> Path:
        """The host tiers' segments of this mesh: a directory of its own (named by its
        first HTTP port, which no other running mesh on this host has), so another mesh's
        engine e0 never touches this one's."""
        return Path(shm_root()) / f"radixmesh-{self._front_ports[0][0]}"

    def _start_engine(self, e: int, role: str, processes: int) -> None:
        """Engine `e`, in a disaggregation role (named p0, d0... in the prefill and decode
        roles, e0, e1... otherwise), its worker ranks sharing the CPUs with the mesh's other
        `processes` ranks."""
        a = self.args
        tp_size = a.engine_tp_size(role)
        ports = [free_port(a.host) for _ in range(tp_size)]
        dist = f"tcp://{a.host}:{free_port(a.host)}"
        threads = max(1, (os.cpu_count() or 1) // processes)
        engine_id = f"e{e}" if role == "null" else f"{role[0]}{a.engine_roles[:e].count(role)}"
        scheduler: dict[str, Any] = {
            "engine_id": engine_id, "worker_addrs": ",".join(f"{a.host}:{p}" for p in ports),
            "disaggregation_mode": role,
        }
        if a.enable_hierarchical_cache:
            # Before the engine's other processes: up when the scheduler asks for a segment,
            # and (stopped in reverse order) unlinking it only after they have gone.
            cachectl_port = free_port(a.host)
            # A directory of this mesh's own (named by its HTTP port, which no other running
            # mesh on this host has): another mesh's engine e0 never touches this one's.
            self._spawn(f"cachectl-{e}", "cachectl",
                        {"port": cachectl_port, "shm_dir": str(self._shm_dir())})
            scheduler["cachectl_addr"] = f"{a.host}:{cachectl_port}"
        for rank, port in enumerate(ports):
            self._spawn(f"worker-{e}.{rank}", "worker", {
                "port": port, "tp_size": tp_size, "tp_rank": rank, "dist_init_addr": dist,
                "num_threads": threads if processes > 1 else 0, "disaggregation_mode": role,
                "cuda_graph_max_bs": a.graph_batch_limit(a.max_running_requests),
            }, group=f"workers-{e}")
        self._spawn(f"scheduler-{e}", "scheduler", scheduler)

    def _start_tokenizer(self, t: int) -> None:
        a = self.args
        port, grpc_port = self._front_ports[t]
        self.http_urls.append(f"http://{a.host}:{port}")
        self.grpc_addrs.append(f"{a.host}:{grpc_port}")
        self._spawn(f"tokenizer-{t}", "tokenizer",
                    {"port": port, "grpc_port": grpc_port, "replica_id": f"t{t}"},
                    health_port=port)

    def _spawn(
        self, name: str, service: str, own: dict[str, Any], health_port: int | None = None,
        group: str = "",
    ) -> None:
        """Start `service` with every setting it shares with the mesh as the mesh has it,
        then its settings of its own (`own`), NATS and its /health port."""
        a = self.args
        config = SERVICE_CONFIGS[service]
        values = {**shared_values(a, config), **own}
        if issubclass(config, NatsSettings):
            values["nats_url"] = self.nats_url
        metrics_port = health_port or free_port(a.host)
        if issubclass(config, StatusSettings):
            values["metrics_port"] = metrics_port
        values, secrets = secrets_env(config, values)  # never on a command line
        args = [sys.executable, "-m", f"radixmesh.services.{service}",
                *to_flags(config, values)]
        nice = shutil.which("nice")
        if service != "worker" and a.service_nice and nice:
            args = [nice, "-n", str(a.service_nice), *args]
        log = None
        if a.log_dir:
            Path(a.log_dir).mkdir(parents=True, exist_ok=True)
            log = open(Path(a.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, **self._trace_env(name), **a.extra_env, **secrets}

        def start() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT if log else None, env=env,
                start_new_session=True,
            )

        self.children.append(Process(
            name, service, group, start, start(), f"http://{a.host}:{metrics_port}/health",
            log, required=service != "cachectl",
        ))

    def _trace_env(self, name: str) -> dict[str, str]:
        """A child's tracing variables: its instance name, and the receiver when there is one."""
        env = instance_env(name, os.environ)
        if self.spans is not None:
            env.update(exporter_env(self.spans.endpoint, os.environ))
        return env

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.children)
        while pending:
            self.check_alive()
            pending = [c for c in pending if not healthy(c.health_url)]
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise TimeoutError(f"not healthy after {timeout:.0f} s: {names}")
            if pending:
                time.sleep(0.2)

    def check_alive(self) -> None:
        """Raise if any service has exited."""
        for c in self.children:
            code = c.proc.poll()
            if code is not None:
                raise RuntimeError(f"{c.name} exited with code {code}")

    def stop(self, grace: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every service (front doors first), wait, then kill stragglers; exit codes."""
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        codes: dict[str, int | None] = {}
        for c in reversed(self.children):
            try:
                codes[c.name] = c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
                codes[c.name] = None
            if c.log is not None:
                c.log.close()
        self.children.clear()
        if self.args.enable_hierarchical_cache and self._front_ports:
            with contextlib.suppress(OSError):  # the cachectls unlinked their segments
                self._shm_dir().rmdir()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.spans is not None:  # last: services export their final spans as they exit
            self.spans.stop()
            self.spans = None
        return codes

    def __enter__(self) -> Mesh:
        return self if self.children else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def healthy(url: str) -> bool:
    """Whether `url` answers 200 now (a service's /health, say)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def serve(args: MeshArgs) -> int:
    """Run the mesh in the foreground until Ctrl-C / SIGTERM, or until a service it needs
    cannot be kept running (the supervisor gave up on every replica of it)."""
    stopping = False

    def on_signal(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    mesh = Mesh(args)
    engines = (f"{args.prefill_dp_size} prefill + {args.decode_dp_size} decode engine(s)"
               if args.prefill_dp_size else f"{args.dp_size} engine(s)")
    print(f"radixmesh: starting {engines} x tp {args.tp_size}, "
          f"{args.tokenizers} tokenizer(s), {args.detokenizers} detokenizer(s)", flush=True)
    started = time.monotonic()
    try:
        mesh.start()
    except (RuntimeError, OSError) as exc:
        print(f"radixmesh: failed to start: {exc}", file=sys.stderr)
        return 1
    print(f"radixmesh: ready in {time.monotonic() - started:.1f} s", flush=True)
    for url, addr in zip(mesh.http_urls, mesh.grpc_addrs, strict=True):
        print(f"radixmesh: serving at {url} (OpenAI: {url}/v1, gRPC Generate: {addr})",
              flush=True)
    print(f"radixmesh: restarts and replicas given up at {mesh.metrics_url}", flush=True)
    # its credentials, if any, stay out of the terminal
    print(f"radixmesh: NATS at {bus_redacted(mesh.nats_url)} (services started by hand join "
          "with NATS_URL)", flush=True)
    if args.trace_file:
        print(f"radixmesh: spans go to {args.trace_file}; see one request with "
              f"`radixmesh trace <request id> --file {args.trace_file}`", flush=True)
    code = 0
    while not stopping:
        failed = mesh.supervisor.failed if mesh.supervisor is not None else None
        if failed is not None:
            print(f"radixmesh: {failed}; stopping", file=sys.stderr)
            code = 1
            break
        time.sleep(0.5)
    print("radixmesh: stopping", flush=True)
    mesh.stop()
    return code
