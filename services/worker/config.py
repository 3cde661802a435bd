"""The worker service's one config object."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixmesh.engine_args import ATTENTION_BACKENDS, EngineArgs, check_gpu_options

DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker rank: loads the model, holds the KV pool, runs Forward over gRPC."""

    model_path: str | None = field(
        default=None, metadata={"help": "HF directory or .gguf; empty: bundled SmolLM2"}
    )
    dtype: str = field(default=EngineArgs.dtype, metadata={"help": "|".join(DTYPES)})
    max_total_tokens: int = field(
        default=EngineArgs.max_total_tokens, metadata={"help": "KV pool size in tokens"}
    )
    page_size: int = field(default=EngineArgs.page_size, metadata={"help": "KV page size"})
    host: str = "127.0.0.1"
    port: int = field(default=0, metadata={"help": "gRPC port; 0: any free one"})
    metrics_port: int = field(default=0, metadata={"help": "/health and /metrics; 0: any"})
    tp_size: int = field(default=1, metadata={"help": "tensor parallel ranks"})
    tp_rank: int = field(default=0, metadata={"help": "this process's rank"})
    dist_init_addr: str | None = field(
        default=None, metadata={"help": "tcp://host:port of the rank group (tp_size > 1)"}
    )
    num_threads: int = field(default=0, metadata={"help": "torch threads; 0: torch's default"})
    device: str = field(
        default=EngineArgs.device,
        metadata={"help": "auto (cuda if torch sees a GPU, else cpu) | cpu | cuda | cuda:N"},
    )
    attention_backend: str = field(
        default=EngineArgs.attention_backend,
        metadata={"help": "|".join(ATTENTION_BACKENDS) + "; auto: triton on CUDA, else torch"},
    )
    cuda_graph_max_bs: int = field(
        default=EngineArgs.cuda_graph_max_bs,
        metadata={"help": "decode batches up to this size replay CUDA graphs; 0: off"},
    )
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.page_size < 1 or self.max_total_tokens < 2 * self.page_size:
            raise ValueError("max_total_tokens must hold at least two pages of page_size >= 1")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got {self.tp_rank}/{self.tp_size}")
        if self.tp_size > 1 and not self.dist_init_addr:
            raise ValueError("tp_size > 1 needs dist_init_addr (e.g. tcp://127.0.0.1:29500)")
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0")
        check_gpu_options(self.device, self.attention_backend, self.cuda_graph_max_bs)

    @property
    def num_slots(self) -> int:
        """KV slots: max_total_tokens rounded down to whole pages."""
        return self.max_total_tokens - self.max_total_tokens % self.page_size
