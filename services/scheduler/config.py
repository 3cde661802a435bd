"""The scheduler service's one config object."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerServiceConfig:
    """One engine replica's scheduler: takes requests from NATS, drives its workers."""

    nats_url: str = "nats://127.0.0.1:4222"
    engine_id: str = field(default="0", metadata={"help": "this engine replica's name"})
    worker_addrs: str = field(
        default="127.0.0.1:50051", metadata={"help": "comma-separated worker ranks (host:port)"}
    )
    model_path: str | None = field(
        default=None, metadata={"help": "for the tokenizer's end-of-sequence ids"}
    )
    page_size: int = 1
    max_running_requests: int = 64
    chunked_prefill_size: int = 1024
    schedule_policy: str = "lpm"
    eviction_policy: str = "lru"
    enable_overlap: bool = True
    context_length: int = field(default=0, metadata={"help": "0: the model's"})
    host: str = "127.0.0.1"
    metrics_port: int = field(default=0, metadata={"help": "/health and /metrics; 0: any"})
    worker_timeout: float = field(default=600.0, metadata={"help": "seconds to wait at start"})
    log_level: str = "INFO"

    @property
    def worker_list(self) -> list[str]:
        return [a.strip() for a in self.worker_addrs.split(",") if a.strip()]
