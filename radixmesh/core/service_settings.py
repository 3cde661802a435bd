"""The settings of the service processes and of `radixmesh up`, each declared once (see
`radixmesh.core.flags`), and each service's config: the groups it uses, its own and the
engine's (`radixmesh.core.settings`)."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import ClassVar

from radixmesh.core.flags import Settings, setting
from radixmesh.core.hicache import HiCacheStorageSettings
from radixmesh.core.reasoning import REASONING_PARSERS
from radixmesh.core.settings import (
    GrammarSettings,
    LoraSettings,
    ModelSettings,
    PageSettings,
    ReplicaSettings,
    RunnerSettings,
)
from radixmesh.core.tool_formats import TOOL_PARSERS

DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("auto", "grpc", "shm")


def _check_log_level(value: str) -> None:
    if not isinstance(value, str) or value.upper() not in logging.getLevelNamesMapping():
        raise ValueError(
            f"log_level must be a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL), "
            f"got {value!r}"
        )


def _random_replica_id() -> str:
    return uuid.uuid4().hex[:12]


def _host_pid_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"





@dataclass(frozen=True, kw_only=True)
class ServiceSettings(Settings):
    """What every service process has: where it listens and how much it logs."""

    TITLE: ClassVar[str] = "service"

    host: str = setting(
        "127.0.0.1",
        help="address the services listen on and are reached at (HTTP, gRPC, /health, "
        "/metrics); 0.0.0.0: every interface",
    )
    log_level: str = setting(
        "INFO",
        check=_check_log_level,
        help="least severe log records written: DEBUG, INFO, WARNING, ERROR or CRITICAL",
    )

@dataclass(frozen=True, kw_only=True)
class StatusSettings(Settings):
    """A service without an HTTP API of its own: where its /health and /metrics are."""

    TITLE: ClassVar[str] = "service"

    metrics_port: int = setting(
        0, minimum=0, help="HTTP port of /health and /metrics; 0: any free port"
    )

@dataclass(frozen=True, kw_only=True)
class NatsSettings(Settings):
    """A service on the NATS bus."""

    TITLE: ClassVar[str] = "service"

    nats_url: str = setting(
        "nats://127.0.0.1:4222",
        env=("NATS_URL",),
        secret=True,
        help="NATS server to connect to (nats://[user:password@]host:port or "
        "nats://token@host:port), or a comma-separated list of a NATS cluster's servers "
        "(the mesh's JetStream buckets then keep a replica on up to 3 of them)",
    )

@dataclass(frozen=True, kw_only=True)
class MeshSettings(Settings):
    """What `radixmesh up` starts and how."""

    TITLE: ClassVar[str] = "mesh"

    tp_size: int = setting(
        1,
        minimum=1,
        aliases=("tp", "tensor-parallel-size"),
        help="tensor-parallel ranks per engine, one worker process each",
    )
    dp_size: int = setting(
        1,
        minimum=1,
        aliases=("engines", "data-parallel-size"),
        help="engine replicas (data parallel), each a scheduler and its workers, each "
        "doing prefill and decode",
    )
    prefill_dp_size: int = setting(
        0,
        minimum=0,
        help="engines in the prefill role (prefill/decode disaggregation); with "
        "decode_dp_size, these two counts replace dp_size",
    )
    decode_dp_size: int = setting(
        0, minimum=0, help="engines in the decode role (see prefill_dp_size)"
    )
    prefill_tp_size: int = setting(
        0, minimum=0, help="tensor-parallel ranks of each prefill engine; 0: tp_size"
    )
    decode_tp_size: int = setting(
        0, minimum=0, help="tensor-parallel ranks of each decode engine; 0: tp_size"
    )
    tokenizers: int = setting(
        1, minimum=1, help="tokenizer replicas, each an HTTP and a gRPC front door"
    )
    detokenizers: int = setting(1, minimum=1, help="detokenizer replicas")
    port: int = setting(
        30000,
        minimum=0,
        help="HTTP port of the first tokenizer, the next ones count up; 0: free ports",
    )
    grpc_port: int = setting(
        30001,
        minimum=0,
        help="gRPC Generate port of the first tokenizer, the next ones count up; "
        "0: free ports",
    )
    nats_url: str | None = setting(
        None,
        env=("NATS_URL",),
        help="NATS server every service connects to, or a comma-separated list of a NATS "
        "cluster's servers; empty: start an embedded one on host",
    )
    log_dir: str | None = setting(
        None,
        help="directory of one log file per service (<name>.log); empty: the services "
        "write to this process's output",
    )
    trace_file: str | None = setting(
        None,
        help="turn tracing on and write every service's spans to this file as JSON lines "
        "(via an OTLP receiver on loopback); empty: no tracing",
    )
    service_nice: int = setting(
        10,
        help="niceness added to every service but the workers, so that on a small CPU "
        "their bursts do not preempt the model's threads and stall a step; 0: none",
    )

    def cross_check(self) -> None:
        super().cross_check()
        if bool(self.prefill_dp_size) != bool(self.decode_dp_size):
            raise ValueError(
                "prefill_dp_size and decode_dp_size go together (both 0: no disaggregation), "
                f"got {self.prefill_dp_size} and {self.decode_dp_size}"
            )

    def engine_tp_size(self, role: str) -> int:
        """Tensor-parallel ranks of an engine in `role`."""
        own = {"prefill": self.prefill_tp_size, "decode": self.decode_tp_size}.get(role, 0)
        return own or self.tp_size

    @property
    def engine_roles(self) -> list[str]:
        """Each engine's disaggregation_mode, in the order they are started."""
        if self.prefill_dp_size:
            return ["prefill"] * self.prefill_dp_size + ["decode"] * self.decode_dp_size
        return ["null"] * self.dp_size

@dataclass(frozen=True, kw_only=True)
class WorkerSettings(Settings):
    """One worker rank's place in its engine."""

    TITLE: ClassVar[str] = "worker"

    port: int = setting(
        0, minimum=0, help="gRPC port the scheduler reaches this rank at; 0: any free port"
    )
    tp_size: int = setting(1, minimum=1, help="tensor-parallel ranks in this worker's group")
    tp_rank: int = setting(0, minimum=0, help="this process's rank, 0 to tp_size - 1")
    dist_init_addr: str | None = setting(
        None, help="tcp://host:port where the ranks of the group meet (needed when tp_size > 1)"
    )
    num_threads: int = setting(0, minimum=0, help="torch CPU threads; 0: torch's default")
    announce: bool = setting(
        False,
        help="announce this rank on NATS once loaded, so that a scheduler without "
        "worker_addrs claims it (at host:port, or this machine's address where host is "
        "0.0.0.0); off: only a scheduler given its address drives it",
    )

    def cross_check(self) -> None:
        super().cross_check()
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got {self.tp_rank}/{self.tp_size}")
        if self.tp_size > 1 and not self.dist_init_addr:
            raise ValueError("tp_size > 1 needs dist_init_addr (e.g. tcp://127.0.0.1:29500)")

@dataclass(frozen=True, kw_only=True)
class SchedulerSettings(Settings):
    """One engine replica's scheduler service."""

    TITLE: ClassVar[str] = "scheduler"

    engine_id: str = setting(
        default_factory=_host_pid_replica_id,
        help="this engine replica's name, in its NATS subjects, metrics and traces; "
        "default: host name and process id (a container's own)",
    )
    worker_addrs: str = setting(
        "",
        help="comma-separated host:port of the engine's worker ranks; empty: claim a free "
        "worker group announced on NATS",
    )
    worker_timeout: float = setting(
        600.0,
        minimum=0,
        help="seconds to wait at start for every worker in worker_addrs to answer",
    )
    cachectl_addr: str | None = setting(
        None,
        help="host:port of this engine's cachectl (the host KV tier's owner), with "
        "enable_hierarchical_cache; empty: the host tier is off",
    )

    @property
    def worker_list(self) -> list[str]:
        """The worker ranks' host:port, rank 0 first."""
        return [a.strip() for a in self.worker_addrs.split(",") if a.strip()]

@dataclass(frozen=True, kw_only=True)
class RoleSettings(Settings):
    """Which half of serving an engine does (prefill/decode disaggregation, SGLang's name)."""

    TITLE: ClassVar[str] = "disaggregation"

    disaggregation_mode: str = setting(
        "null",
        choices=DISAGGREGATION_MODES,
        help="prefill: compute prompts' KV and first token and hand them to a decode engine; "
        "decode: take requests, receive their prompt's KV from a prefill engine and stream "
        "the output; null: both in one engine. A worker announced with a mode is claimed "
        "only by a scheduler of that mode",
    )


@dataclass(frozen=True, kw_only=True)
class DisaggregationSettings(Settings):
    """How KV moves from prefill to decode engines."""

    TITLE: ClassVar[str] = "disaggregation"

    disaggregation_transfer_backend: str = setting(
        "auto",
        choices=TRANSFER_BACKENDS,
        help="how a prefill worker sends a prompt's KV to the decode workers: grpc (a "
        "stream between the workers, across hosts), shm (a shared-memory file, both on one "
        "host); auto: shm where both workers are on one host, else grpc",
    )
    disaggregation_timeout: float = setting(
        60.0,
        minimum=0.1,
        help="seconds a decode engine waits for a prompt's KV from its prefill engine "
        "before it prefills the prompt itself",
    )


@dataclass(frozen=True, kw_only=True)
class TokenizerSettings(Settings):
    """One tokenizer replica's front doors."""

    TITLE: ClassVar[str] = "tokenizer"

    served_model_name: str | None = setting(
        None, help="the model's name to clients (/v1/models); empty: the model file's stem"
    )
    port: int = setting(
        30000,
        minimum=0,
        help="HTTP port of the OpenAI and native APIs, /health and /metrics; 0: any free port",
    )
    grpc_port: int = setting(
        0, minimum=-1, help="port of the gRPC Generate API; 0: any free port, -1: off"
    )
    replica_id: str = setting(
        default_factory=_random_replica_id,
        help="this replica's name, which names its NATS output subject; default: random",
    )
    engine_timeout: float = setting(
        3.0, minimum=0, help="seconds without a heartbeat before an engine counts as gone"
    )
    shutdown_grace: float = setting(
        10.0, minimum=0, help="seconds in-flight requests get to finish on SIGTERM"
    )
    stall_timeout: float = setting(
        120.0,
        minimum=0,
        help="seconds a request may go without any output (waiting in a queue included) "
        "before it ends with an error; 0: never",
    )

@dataclass(frozen=True, kw_only=True)
class ChatSettings(Settings):
    """How the model writes tool calls and reasoning, for the chat route to read them."""

    TITLE: ClassVar[str] = "chat answers"

    tool_call_parser: str | None = setting(
        None,
        choices=tuple(TOOL_PARSERS),
        help="the format the model writes tool calls in: with tools and tool_choice auto, "
        "its calls come back as tool_calls, each constrained to its tool's schema once the "
        "model opens it; empty: answers stay text",
    )
    reasoning_parser: str | None = setting(
        None,
        choices=REASONING_PARSERS,
        help="how the model marks its thinking: it comes back as reasoning_content, and a "
        "constraint applies to the answer after it; empty: the thinking stays in content",
    )


@dataclass(frozen=True, kw_only=True)
class FrontDoorSettings(Settings):
    """Who may use the front doors, how many requests may wait, and what a stream sends."""

    TITLE: ClassVar[str] = "front doors"

    api_key: str = setting(
        "",
        secret=True,
        help="the key every HTTP request (Authorization: Bearer <key>, as OpenAI clients "
        "send it) and gRPC call (authorization metadata) must carry, else 401; /health, "
        "/metrics and the gRPC health service stay open; empty: no key",
    )
    max_queued_requests: int = setting(
        0,
        minimum=0,
        help="requests a tokenizer replica lets wait for their first token; past it a new "
        "one gets 503 with Retry-After (gRPC: UNAVAILABLE); 0: no limit",
    )
    incremental_streaming_output: bool = setting(
        False,
        aliases=("stream-output",),
        help="a streamed native /generate sends in each event only the text, output ids "
        "and output logprobs new since the one before; by default each event holds the "
        "whole output so far",
    )

@dataclass(frozen=True, kw_only=True)
class RouterSettings(Settings):
    """A tokenizer's cache-aware routing: when a cached prefix outweighs load."""

    TITLE: ClassVar[str] = "routing"

    cache_threshold: float = setting(
        0.5,
        minimum=0,
        help="share of a prompt (0 to 1) an engine's cache must hold for the request to "
        "go there rather than to the least loaded engine",
    )
    balance_abs_threshold: int = setting(
        32,
        minimum=0,
        help="engines whose loads (running + waiting requests) differ by at most this "
        "many count as balanced",
    )
    balance_rel_threshold: float = setting(
        1.5,
        minimum=0,
        help="engines whose busiest load is at most this factor of the idlest's count as "
        "balanced",
    )
    max_tree_tokens: int = setting(
        1 << 20,
        minimum=1,
        help="tokens of the prefix tree the router keeps per engine to guess its cache",
    )

@dataclass(frozen=True, kw_only=True)
class CachectlSettings(Settings):
    """One engine's cachectl: the owner of its host KV tier."""

    TITLE: ClassVar[str] = "cachectl"

    port: int = setting(
        0, minimum=0, help="gRPC port the scheduler reaches cachectl at; 0: any free port"
    )
    shm_dir: str = setting(
        "/dev/shm",
        help="directory of the host tiers' shared-memory segments (a tmpfs the workers of "
        "the engine can map)",
    )

@dataclass(frozen=True, kw_only=True)
class DetokenizerSettings(Settings):
    """One detokenizer replica."""

    TITLE: ClassVar[str] = "detokenizer"

    replica_id: str = setting(
        default_factory=_host_pid_replica_id,
        help="this replica's name in logs, metrics and traces; default: <hostname>-<pid>",
    )




# ---- the configs: each composed of the groups it uses ----------------------------------
# Bases are listed last group first: a dataclass's fields, and so its flags in --help,
# follow the reversed MRO.


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(StatusSettings, NatsSettings, ServiceSettings, RoleSettings, WorkerSettings,
                   LoraSettings, RunnerSettings):
    """One worker rank: loads the model, holds the KV pool, runs its scheduler's steps over gRPC."""

@dataclass(frozen=True, kw_only=True)
class SchedulerServiceConfig(
    StatusSettings,
    NatsSettings,
    ServiceSettings,
    DisaggregationSettings,
    RoleSettings,
    SchedulerSettings,
    ReplicaSettings,
    PageSettings,
    ModelSettings,
):
    """One engine replica's scheduler: takes requests from NATS, drives its workers."""

@dataclass(frozen=True, kw_only=True)
class TokenizerServiceConfig(
    NatsSettings, ServiceSettings, RouterSettings, FrontDoorSettings, ChatSettings,
    TokenizerSettings, GrammarSettings, ModelSettings,
):
    """A tokenizer replica: the HTTP and gRPC front doors, routing requests to engines."""

@dataclass(frozen=True, kw_only=True)
class CachectlConfig(
    StatusSettings, NatsSettings, ServiceSettings, CachectlSettings, HiCacheStorageSettings
):
    """One engine's cachectl: creates its host tier's shared memory, answers its scheduler."""

@dataclass(frozen=True, kw_only=True)
class DetokenizerConfig(
    StatusSettings, NatsSettings, ServiceSettings, DetokenizerSettings, ModelSettings
):
    """A detokenizer replica: token ids in from the schedulers, text out to the tokenizers."""
