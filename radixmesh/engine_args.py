"""Every knob of an engine replica, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.services.scheduler.schedule_policy import POLICIES

EVICTION_POLICIES = ("lru", "lfu", "fifo", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
DEFAULT_CUDA_GRAPH_MAX_BS = 32


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


def check_gpu_options(device: str, attention_backend: str, cuda_graph_max_bs: int) -> None:
    """Raise ValueError on a bad device, attention backend or CUDA-graph batch cap."""
    check_device(device)
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}"
        )
    if attention_backend == "torch" and device.startswith("cuda"):
        raise ValueError(
            f"attention_backend='torch' runs on the CPU only; use 'triton' or 'auto' with "
            f"device={device!r}"
        )
    if not isinstance(cuda_graph_max_bs, int) or cuda_graph_max_bs < 0:
        raise ValueError(
            f"cuda_graph_max_bs must be an integer >= 0 (0: no CUDA graphs), "
            f"got {cuda_graph_max_bs!r}"
        )


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
    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu; or cpu, cuda, cuda:N
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on the CPU
    # Decode batches up to this size replay CUDA graphs (CUDA only); 0: never.
    cuda_graph_max_bs: int = DEFAULT_CUDA_GRAPH_MAX_BS

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
        check_gpu_options(self.device, self.attention_backend, self.cuda_graph_max_bs)
