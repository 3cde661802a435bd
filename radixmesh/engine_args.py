"""Every knob of an engine replica, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.services.scheduler.schedule_policy import POLICIES

EVICTION_POLICIES = ("lru", "lfu", "fifo", "priority")


@dataclass(frozen=True)
class EngineArgs:
    """Model, precision, KV pool and scheduling settings (names follow SGLang's server args)."""

    model_path: str | None = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    dtype: str = "bfloat16"
    page_size: int = 1
    max_total_tokens: int = 65536  # KV pool size in tokens
    max_running_requests: int = 64
    chunked_prefill_size: int = 1024
    schedule_policy: str = "lpm"
    eviction_policy: str = "lru"
    enable_overlap: bool = True
    context_length: int | None = None  # None: the model's
    random_seed: int | None = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        for name in (
            "page_size",
            "max_total_tokens",
            "max_running_requests",
            "chunked_prefill_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_total_tokens < 2 * self.page_size:
            raise ValueError("max_total_tokens must hold at least two pages")
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError("context_length must be at least 2")
