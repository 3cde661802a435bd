"""Every setting of radixmesh, declared once.

A setting is a field of a small frozen dataclass (a settings group) declared with
`setting(...)`: its type (the annotation), default, help text, environment variable
(RADIXMESH_<NAME>, plus any `env` aliases) and validation (`choices`, `minimum`, `check`).
Its flag is `--<name>` with dashes, unless the declaration names another (`flag`) or more
(`aliases`). Each config (EngineArgs here, MeshArgs in radixmesh.launcher, each service's
config in radixmesh.services.<name>.config) inherits the groups it uses; `Settings`
validates every declared field on construction, then runs the groups' cross-field checks.

From a config class come its argparse flags (`add_arguments`, `build_parser`), the config
from parsed flags (`from_args`, `parse_config`), and the flags that hand a parent's values
of the shared settings to a child process (`shared_values`, `to_flags`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from types import NoneType
from typing import Any, ClassVar, TypeVar, get_args, get_type_hints

from radixmesh.core.hicache import (
    LAYOUTS,
    PREFETCH_POLICIES,
    STORAGE_BACKENDS,
    WRITE_POLICIES,
    storage_config,
)

ENV_PREFIX = "RADIXMESH_"
DTYPES = ("bfloat16", "float32")
QUANTIZATIONS = ("auto", "gguf", "bf16", "q8_0")
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
EVICTION_POLICIES = ("lru", "lfu", "fifo", "priority")

METADATA_KEY = "radixmesh.setting"  # where a field keeps its Setting

S = TypeVar("S", bound="Settings")


@dataclass(frozen=True)
class Setting:
    """A field's declaration beyond its type and default (stored in the field's metadata)."""

    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None  # numbers only; the value must be >= it
    check: Callable[[Any], None] | None = None  # raises ValueError naming the setting
    flag: str | None = None  # the flag's name (no dashes in front) when not the field's
    aliases: tuple[str, ...] = ()  # more flag names
    env: tuple[str, ...] = ()  # more environment variables, read after RADIXMESH_<NAME>
    # Never on a command line (a launcher passes it in the environment) and never shown
    # whole: logs and /server_info show a URL without its credentials, else only "<set>".
    secret: bool = False


def setting(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Any = MISSING,
    choices: tuple[str, ...] = (),
    minimum: float | None = None,
    check: Callable[[Any], None] | None = None,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    env: tuple[str, ...] = (),
    secret: bool = False,
) -> Any:
    """A dataclass field declared as a setting (see the module's docstring)."""
    spec = Setting(help, choices, minimum, check, flag, aliases, env, secret)
    return field(default=default, default_factory=default_factory, metadata={METADATA_KEY: spec})


def env_name(name: str) -> str:
    """The environment variable of the setting `name`."""
    return ENV_PREFIX + name.upper()


# ---- checks of single settings ------------------------------------------------------------


def check_device(device: str) -> None:
    """Raise ValueError unless `device` is auto, cpu, cuda or cuda:N and present here."""
    if device in ("auto", "cpu"):
        return
    kind, colon, index = device.partition(":")
    if kind != "cuda" or (colon and not index.isdigit()):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    import torch  # only a CUDA device needs torch to be checked

    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} needs CUDA, but torch.cuda.is_available() is False "
            "(use device 'auto' or 'cpu')"
        )
    if colon and int(index) >= torch.cuda.device_count():
        raise ValueError(
            f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )


def _check_context_length(value: int) -> None:
    if not isinstance(value, int) or value == 1 or value < 0:
        raise ValueError(
            f"context_length must be at least 2 (0 or none: the model's), got {value!r}"
        )


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


# ---- the base of every group and config -----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Validates every declared field on construction, then the cross-field checks."""

    TITLE: ClassVar[str] = "options"  # the --help section of the group's flags

    def __post_init__(self) -> None:
        for declared in _declared(type(self)):
            declared.validate(getattr(self, declared.name))
        self.cross_check()

    def cross_check(self) -> None:
        """Checks that involve several fields: a group overrides it and calls super()."""


# ---- the groups -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GrammarSettings(Settings):
    """Constrained decoding: what the front doors accept and the workers compile."""

    TITLE: ClassVar[str] = "structured output"

    grammar_backend: str = setting(
        "xgrammar",
        choices=GRAMMAR_BACKENDS,
        help="what compiles json_schema, regex and ebnf constraints: xgrammar or "
        "llguidance; none: requests that bring one are refused",
    )


@dataclass(frozen=True, kw_only=True)
class DecodingSettings(GrammarSettings):
    """Constrained decoding as the model runner does it."""

    disable_jump_forward: bool = setting(
        False,
        help="sample every token of a constrained answer; by default the tokens its grammar "
        "forces (a schema's keys and punctuation) are appended at once, computed in one "
        "step instead of one step each",
    )


@dataclass(frozen=True, kw_only=True)
class ModelSettings(Settings):
    """Which model."""

    TITLE: ClassVar[str] = "model"

    model_path: str | None = setting(
        None,
        help="GGUF file or Hugging Face model directory (weights and tokenizer); "
        "empty: the bundled SmolLM2-135M-Instruct GGUF",
    )


@dataclass(frozen=True, kw_only=True)
class DeviceSettings(Settings):
    """Where and in what precision the model runs."""

    TITLE: ClassVar[str] = "device and precision"

    dtype: str = setting(
        "bfloat16", choices=DTYPES, help="precision of the activations, the KV cache and the "
        "weights that are not quantized"
    )
    quantization: str = setting(
        "auto",
        choices=QUANTIZATIONS,
        help="weights in memory: gguf keeps a GGUF file's quantized tensors in their type "
        "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; native CPU kernels); bf16 "
        "dequantizes them to --dtype at load; q8_0 also quantizes float weights (safetensors, "
        "F16/BF16 GGUF) to Q8_0 at load; auto: gguf for a GGUF file run in bfloat16 on the "
        "CPU, else bf16 (the quantized kernels round activations to int8, which float32 "
        "asks not to)",
    )
    device: str = setting(
        "auto",
        check=check_device,
        help="where the model runs: auto (cuda when torch sees a GPU, else cpu), cpu, cuda "
        "(tensor-parallel rank r on GPU r) or cuda:N",
    )
    attention_backend: str = setting(
        "auto",
        choices=ATTENTION_BACKENDS,
        help="attention kernels: auto (triton on CUDA, torch on the CPU), torch (CPU only) "
        "or triton",
    )
    cuda_graph_max_bs: int = setting(
        32,
        minimum=0,
        help="decode batches of up to this many requests replay captured CUDA graphs "
        "(CUDA only); 0: no CUDA graphs",
    )

    def cross_check(self) -> None:
        super().cross_check()
        if self.attention_backend == "torch" and self.device.startswith("cuda"):
            raise ValueError(
                f"attention_backend='torch' runs on the CPU only; use 'triton' or 'auto' with "
                f"device={self.device!r}"
            )
        if self.quantization in ("gguf", "q8_0") and self.device.startswith("cuda"):
            raise ValueError(
                f"quantization={self.quantization!r} runs on the CPU only; use 'bf16' or "
                f"'auto' with device={self.device!r}"
            )


@dataclass(frozen=True, kw_only=True)
class PageSettings(Settings):
    """The KV cache's page: what the scheduler and the workers must agree on."""

    TITLE: ClassVar[str] = "KV cache"

    page_size: int = setting(
        1,
        minimum=1,
        help="tokens per KV-cache page, the unit the radix cache matches, allocates and "
        "evicts in",
    )


@dataclass(frozen=True, kw_only=True)
class KVSettings(PageSettings):
    """The KV pool: its page and its size."""

    max_total_tokens: int = setting(
        65536,
        minimum=1,
        help="size of the KV-cache pool in tokens (rounded down to whole pages): what all "
        "running and cached requests hold together",
    )

    @property
    def num_slots(self) -> int:
        """KV slots: max_total_tokens rounded down to whole pages."""
        return self.max_total_tokens - self.max_total_tokens % self.page_size

    def cross_check(self) -> None:
        super().cross_check()
        if self.max_total_tokens < 2 * self.page_size:
            raise ValueError(
                f"max_total_tokens must hold at least two pages ({2 * self.page_size} tokens "
                f"at page_size {self.page_size}), got {self.max_total_tokens}"
            )


@dataclass(frozen=True, kw_only=True)
class ScheduleSettings(Settings):
    """How an engine's scheduler admits, batches and caches requests."""

    TITLE: ClassVar[str] = "scheduling"

    max_running_requests: int = setting(
        64, minimum=1, help="most requests running at once in an engine; the others wait"
    )
    chunked_prefill_size: int = setting(
        1024,
        minimum=1,
        help="most prompt tokens prefilled in one step; a longer prompt is prefilled in "
        "chunks over several steps",
    )
    schedule_policy: str = setting(
        "lpm",
        choices=SCHEDULE_POLICIES,
        help="order of the waiting queue: lpm (longest cached prefix first), dfs-weight "
        "(depth-first by the weight of cached subtrees) or fcfs (arrival order)",
    )
    radix_eviction_policy: str = setting(
        "lru",
        choices=EVICTION_POLICIES,
        aliases=("eviction-policy",),
        help="which cached prefix the radix cache drops first when the KV pool is full: "
        "least recently used, least frequently used, first inserted, or lowest priority",
    )
    disable_overlap_schedule: bool = setting(
        False,
        help="finish each step before scheduling the next; by default the next step is "
        "scheduled while the model runs the current one, hiding the scheduler's CPU time "
        "behind the forward pass (turn it off to debug)",
    )
    context_length: int | None = setting(
        None,
        check=_check_context_length,
        help="most tokens of a request, prompt and output together, never more than the "
        "model's; empty or 0: the model's (max_position_embeddings)",
    )


@dataclass(frozen=True, kw_only=True)
class HiCacheSettings(Settings):
    """The hierarchical KV cache: a host (L2) tier behind the device pool (SGLang's names)."""

    TITLE: ClassVar[str] = "hierarchical cache"

    enable_hierarchical_cache: bool = setting(
        False,
        help="keep KV evicted from the device pool in a host-memory tier (owned by cachectl) "
        "and load it back instead of recomputing the prefix",
    )
    hicache_ratio: float = setting(
        2.0,
        minimum=1.0,
        help="size of the host tier as a multiple of the device KV pool",
    )
    hicache_size: float = setting(
        0.0,
        minimum=0.0,
        help="size of the host tier in GB, overriding hicache_ratio; 0: use hicache_ratio",
    )
    hicache_write_policy: str = setting(
        "write_through",
        choices=WRITE_POLICIES,
        help="when device KV is copied to the host tier: write_through (as soon as it is "
        "cached), write_through_selective (once hicache_write_through_threshold admissions "
        "hit it) or write_back (when it is evicted from the device pool)",
    )
    hicache_write_through_threshold: int = setting(
        2,
        minimum=1,
        help="admissions that must hit a cached prefix before write_through_selective "
        "copies it to the host tier",
    )
    hicache_mem_layout: str = setting(
        "layer_first",
        choices=LAYOUTS,
        help="host tier layout: layer_first (each layer's slots contiguous) or page_first "
        "(each page's layers contiguous)",
    )
    hicache_storage_page_size: int = setting(
        64,
        minimum=1,
        help="tokens per storage-tier page, the unit written to and read from storage (a "
        "multiple of page_size)",
    )
    hicache_storage_prefetch_policy: str = setting(
        "timeout",
        choices=PREFETCH_POLICIES,
        help="how long a request whose prefix storage holds waits for it: best_effort (until "
        "it would run anyway: on an idle engine, not at all), wait_complete (until every "
        "page arrived) or timeout (the same, but no longer than "
        "hicache_storage_prefetch_timeout)",
    )
    hicache_storage_prefetch_timeout: float = setting(
        2.0,
        minimum=0.0,
        help="seconds a request waits for its storage pages under the timeout prefetch policy",
    )
    hicache_storage_prefetch_threshold: int = setting(
        256,
        minimum=1,
        help="tokens that storage must hold beyond a request's device and host hit before "
        "they are fetched rather than recomputed",
    )

    def cross_check(self) -> None:
        super().cross_check()
        page_size = getattr(self, "page_size", 1)
        if self.hicache_storage_page_size % page_size:
            raise ValueError(
                f"hicache_storage_page_size must be a multiple of page_size {page_size}, "
                f"got {self.hicache_storage_page_size}"
            )


@dataclass(frozen=True, kw_only=True)
class HiCacheStorageSettings(Settings):
    """The storage (L3) tier behind the host tier, which cachectl reads and writes."""

    TITLE: ClassVar[str] = "hierarchical cache storage"

    hicache_storage_backend: str | None = setting(
        None,
        choices=STORAGE_BACKENDS,
        help="storage tier behind the host tier, shared by every engine that uses the same "
        "one and kept across restarts: file, redis or nats (the mesh's JetStream object "
        "store); empty: none",
    )
    hicache_storage_backend_extra_config: str = setting(
        "",
        help='the storage backend\'s settings as JSON: {"path": DIR} for file (default: '
        'radixmesh/hicache in the user\'s cache directory), {"url": "redis://HOST:PORT/DB"} '
        'for redis, {"bucket": NAME} for nats (and "url" for a NATS server other than the '
        "mesh's)",
    )

    def cross_check(self) -> None:
        super().cross_check()
        storage_config(
            self.hicache_storage_backend or "", self.hicache_storage_backend_extra_config
        )

    @property
    def storage_config(self) -> dict[str, str]:
        """The backend's extra config, defaults filled in."""
        return storage_config(
            self.hicache_storage_backend or "", self.hicache_storage_backend_extra_config
        )


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
        "nats://token@host:port)",
    )


@dataclass(frozen=True, kw_only=True)
class EngineSettings(Settings):
    """What only the in-process Engine has."""

    TITLE: ClassVar[str] = "engine"

    random_seed: int | None = setting(
        None,
        help="seeds the sampling seed of every request that brings none, for reproducible "
        "runs; empty: a random one per run",
    )
    show_progress: bool = setting(True, help="show a progress bar while the weights load")


@dataclass(frozen=True, kw_only=True)
class MeshSettings(Settings):
    """What `radixmesh up` starts and how."""

    TITLE: ClassVar[str] = "mesh"

    tp_size: int = setting(
        1,
        minimum=1,
        aliases=("tp",),
        help="tensor-parallel ranks per engine, one worker process each",
    )
    dp_size: int = setting(
        1,
        minimum=1,
        aliases=("engines",),
        help="engine replicas (data parallel), each a scheduler and its workers",
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
        help="NATS server every service connects to; empty: start an embedded one on host",
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
class FrontDoorSettings(Settings):
    """Who may use the front doors, and how many requests may wait."""

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
class RunnerSettings(KVSettings, DeviceSettings, DecodingSettings, ModelSettings):
    """What a model runner is built from: the model, its device and its KV pool."""


@dataclass(frozen=True, kw_only=True)
class ReplicaSettings(HiCacheSettings, ScheduleSettings):
    """How an engine replica schedules requests and caches their KV."""


@dataclass(frozen=True, kw_only=True)
class EngineArgs(EngineSettings, ReplicaSettings, HiCacheStorageSettings, RunnerSettings):
    """Every knob of the in-process Engine (names follow SGLang's server args)."""


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(StatusSettings, NatsSettings, ServiceSettings, WorkerSettings,
                   RunnerSettings):
    """One worker rank: loads the model, holds the KV pool, runs Forward over gRPC."""


@dataclass(frozen=True, kw_only=True)
class SchedulerServiceConfig(
    StatusSettings,
    NatsSettings,
    ServiceSettings,
    SchedulerSettings,
    ReplicaSettings,
    PageSettings,
    ModelSettings,
):
    """One engine replica's scheduler: takes requests from NATS, drives its workers."""


@dataclass(frozen=True, kw_only=True)
class TokenizerServiceConfig(
    NatsSettings, ServiceSettings, RouterSettings, FrontDoorSettings, TokenizerSettings,
    GrammarSettings, ModelSettings,
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


# ---- flags and environment ------------------------------------------------------------


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _optional_str(text: str) -> str | None:
    return text or None


def _optional_int(text: str) -> int | None:
    return int(text) if text else None


_CONVERTERS: dict[Any, Callable[[str], Any]] = {
    bool: _parse_bool,
    int: int,
    float: float,
    str: str,
    str | None: _optional_str,
    int | None: _optional_int,
}


@dataclass(frozen=True)
class _Declared:
    """One setting of a config class, with what its type and its group say."""

    name: str
    spec: Setting
    kind: type  # bool, int, float or str
    optional: bool  # None allowed
    owner: type[Settings]  # the group that declares it
    default: Any  # MISSING when a factory makes it
    convert: Callable[[str], Any]

    @property
    def flags(self) -> list[str]:
        names = [self.spec.flag or self.name.replace("_", "-"), *self.spec.aliases]
        return ["--" + n for n in names]

    @property
    def env_names(self) -> list[str]:
        return [env_name(self.name), *self.spec.env]

    def validate(self, value: Any) -> None:
        if value is None and self.optional:
            return
        spec = self.spec
        if spec.choices and value not in spec.choices:
            raise ValueError(f"{self.name} must be one of {spec.choices}, got {value!r}")
        if spec.minimum is not None:
            number = not isinstance(value, bool) and isinstance(
                value, int if self.kind is int else (int, float)
            )
            if not number or value < spec.minimum:
                raise ValueError(f"{self.name} must be {self._at_least()}, got {value!r}")
        if spec.check is not None:
            spec.check(value)

    def _at_least(self) -> str:
        if self.kind is not int:
            return f"a number >= {self.spec.minimum:g}"
        if self.spec.minimum == 1:
            return "a positive integer"
        return f"an integer >= {self.spec.minimum:g}"


@cache
def _declared(cls: type[Settings]) -> tuple[_Declared, ...]:
    hints = get_type_hints(cls)
    declared = []
    for f in fields(cls):
        spec = f.metadata.get(METADATA_KEY)
        if spec is None:
            continue
        hint = hints[f.name]
        kinds = [k for k in get_args(hint) if k is not NoneType] or [hint]
        owner = next(  # the most basic class that has the field declares it
            k for k in reversed(cls.__mro__) if f.name in vars(k).get("__dataclass_fields__", {})
        )
        declared.append(
            _Declared(
                name=f.name,
                spec=spec,
                kind=kinds[0],
                optional=NoneType in get_args(hint),
                owner=owner,
                default=f.default,
                convert=_CONVERTERS[hint],
            )
        )
    return tuple(declared)


def _show(value: Any) -> str:
    """A value as a flag or an environment variable spells it."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _help(declared: _Declared, default: Any, source: str | None) -> str:
    text = declared.spec.help
    envs = " or ".join(declared.env_names)
    if default is MISSING:
        tail = f"env {envs}"
    elif source is not None:
        tail = f"default {_show(default) or 'empty'} from {source}"
    else:
        tail = f"default {_show(default) or 'empty'}; env {envs}"
    return f"{text} ({tail})".replace("%", "%%")


class _NegativeBool(argparse.Action):
    """--no-<flag>: sets its boolean setting to false."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, False)


def add_arguments(
    parser: argparse.ArgumentParser, cls: type[Settings], only: Iterable[str] | None = None
) -> None:
    """One flag per setting of `cls` (or the `only` ones), in a --help section per group,
    with the declaration's help; its default comes from the environment when set there.

    A boolean takes --<flag>, --<flag>=BOOL (true/false, yes/no, on/off, 1/0) and
    --no-<flag>; an optional value is none when empty."""
    wanted = None if only is None else set(only)
    sections: dict[str, Any] = {}
    for d in _declared(cls):
        if wanted is not None and d.name not in wanted:
            continue
        section = sections.get(d.owner.TITLE)
        if section is None:
            section = sections[d.owner.TITLE] = parser.add_argument_group(d.owner.TITLE)
        default, source = d.default, None
        for name in d.env_names:
            if name in os.environ:
                try:
                    default, source = d.convert(os.environ[name]), name
                except (ValueError, argparse.ArgumentTypeError) as exc:
                    parser.error(f"{name}={os.environ[name]!r}: {exc}")
                break
        help_text = _help(d, default, source)
        # A factory's value is made when the config is built unless a flag or variable sets it.
        argparse_default = argparse.SUPPRESS if default is MISSING else default
        metavar = "{" + ",".join(d.spec.choices) + "}" if d.spec.choices else None
        if d.kind is bool:
            section.add_argument(*d.flags, dest=d.name, type=d.convert, nargs="?", const=True,
                                 default=argparse_default, metavar="BOOL", help=help_text)
            section.add_argument(*["--no-" + f.removeprefix("--") for f in d.flags],
                                 dest=d.name, action=_NegativeBool, default=argparse_default,
                                 help=f"the same as {d.flags[0]}=false")
        else:
            section.add_argument(*d.flags, dest=d.name, type=d.convert, metavar=metavar,
                                 default=argparse_default, help=help_text)


def build_parser(cls: type[Settings], prog: str | None = None) -> argparse.ArgumentParser:
    """A parser of every setting of `cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_arguments(parser, cls)
    return parser


def from_args(cls: type[S], args: argparse.Namespace) -> S:
    """`cls` from parsed flags (what `add_arguments(parser, cls)` added); validated."""
    values = {d.name: getattr(args, d.name) for d in _declared(cls) if hasattr(args, d.name)}
    return cls(**values)


def parse_config(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None) -> S:
    """`cls` from argv (default sys.argv[1:]) and the environment; a bad value exits 2."""
    parser = build_parser(cls, prog)
    args = parser.parse_args(argv)
    try:
        return from_args(cls, args)
    except ValueError as exc:
        parser.error(str(exc))


def shared_values(config: Settings, target: type[Settings]) -> dict[str, Any]:
    """`config`'s values of the settings `target` takes from a group `config` has too: what a
    parent hands a child process so that both run with the same settings."""
    return {
        d.name: getattr(config, d.name) for d in _declared(target) if isinstance(config, d.owner)
    }


def shown(config: Settings) -> dict[str, Any]:
    """The config as logs and /server_info may show it: secrets only as set or not, and no
    credentials in URLs."""
    values = dataclasses.asdict(config)
    for d in _declared(type(config)):
        value = values[d.name]
        if isinstance(value, str) and "://" in value:
            values[d.name] = re.sub(r"//[^/@]*@", "//", value)
        elif d.spec.secret:
            values[d.name] = "<set>" if value else ""
    return values


def secrets_env(cls: type[Settings], values: Mapping[str, Any]) -> tuple[dict[str, Any],
                                                                          dict[str, str]]:
    """`values` without the secret settings, and those as environment variables: how a
    launcher hands them to a child without putting them on its command line."""
    secret = {d.name for d in _declared(cls) if d.spec.secret}
    rest = {name: value for name, value in values.items() if name not in secret}
    env = {env_name(name): _show(value) for name, value in values.items()
           if name in secret and value}
    return rest, env


def to_flags(cls: type[Settings], values: Mapping[str, Any]) -> list[str]:
    """`--flag=value` for each setting of `cls` named in `values`, as its parser reads it."""
    declared = {d.name: d for d in _declared(cls)}
    return [f"{declared[name].flags[0]}={_show(value)}" for name, value in values.items()]
