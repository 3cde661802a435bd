"""The engine's settings, each declared once (see `radixmesh.core.flags`): the model, its
device and KV pool, decoding, scheduling, and `EngineArgs`, every knob of the in-process
Engine. The host and storage tiers' groups are with their contract (`radixmesh.core.hicache`),
speculative decoding's in `radixmesh.core.speculative_settings`, the services' and the mesh's
own settings in `radixmesh.core.service_settings`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from radixmesh.core.flags import Settings, setting
from radixmesh.core.hicache import HiCacheSettings, HiCacheStorageSettings
from radixmesh.core.lora_paths import parse_lora_paths
from radixmesh.core.speculative_settings import SpeculativeSettings

DTYPES = ("bfloat16", "float32")
QUANTIZATIONS = ("auto", "gguf", "bf16", "q8_0")
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
EVICTION_POLICIES = ("lru", "lfu", "fifo", "priority", "slru")
# The largest CUDA-graph decode batch of a worker that does not know its engine's limit.
GRAPH_BATCH_DEFAULT = 256
# The tokens per running request an automatic KV pool on the CPU is sized for (a chat turn's
# prompt and answer; a prefix requests share is held once), or the context when shorter.
TYPICAL_REQUEST_TOKENS = 1024

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


def _check_protected_ratio(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ValueError(f"radix_slru_protected_ratio must be in (0, 1), got {value!r}")


def _check_lora_paths(value: tuple[str, ...]) -> None:
    parse_lora_paths(value)


def _check_mem_fraction(value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {value!r}")


def _check_context_length(value: int) -> None:
    if not isinstance(value, int) or value == 1 or value < 0:
        raise ValueError(
            f"context_length must be at least 2 (0 or none: the model's), got {value!r}"
        )# ---- the groups -----------------------------------------------------------------------


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
        help="GGUF file or Hugging Face model directory (weights and tokenizer), or a model "
        "on the Hugging Face Hub: ORG/NAME (its safetensors, or its only .gguf file), "
        "ORG/NAME:FILE.gguf or ORG/NAME:QUANT (the .gguf file of that quant, e.g. :Q4_K_M), "
        "fetched into the Hugging Face cache (HF_HOME, HF_HUB_OFFLINE, HF_TOKEN); empty: the "
        "bundled SmolLM2-135M-Instruct GGUF",
    )
    revision: str | None = setting(
        None,
        help="the branch, tag or commit of a Hugging Face Hub model_path to load; empty: main",
    )
    is_embedding: bool = setting(
        False,
        help="serve the model as an embedding model (/v1/embeddings, /encode): prompts pooled "
        "as its sentence-transformers config says, else by their last token, and not "
        "generated from; also chosen when the checkpoint declares a pooling",
    )
    rerank_tokens: str | None = setting(
        None,
        help="serve the model as a decoder reranker (/v1/rerank) scoring each document by "
        "these two answer tokens, YES,NO (Qwen3-Reranker: yes,no); empty: the checkpoint's "
        "config.json classifier_from_token, if any",
    )
    rerank_template: str | None = setting(
        None,
        help="a reranker's prompt, with {query} and {document} in it; empty: "
        "Qwen3-Reranker's",
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
    cuda_graph_max_bs: int | None = setting(
        None,
        minimum=0,
        help="decode batches of up to this many requests replay captured CUDA graphs (CUDA "
        "only; one per batch size 1, 2, 4, 8, then every 8, every 16 past 256); empty: the "
        f"engine's max_running_requests ({GRAPH_BATCH_DEFAULT} for a worker started alone); "
        "0: no CUDA graphs",
    )
    disable_cuda_graph: bool = setting(
        False, help="decode without CUDA graphs, whatever cuda_graph_max_bs says"
    )

    def graph_batch_limit(self, max_running_requests: int = 0) -> int:
        """The largest decode batch with a CUDA graph: none with disable_cuda_graph, the
        setting, else the engine's running-request limit where it is known."""
        if self.disable_cuda_graph:
            return 0
        if self.cuda_graph_max_bs is not None:
            return self.cuda_graph_max_bs
        return max_running_requests or GRAPH_BATCH_DEFAULT

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
class CapacitySettings(Settings):
    """How much an engine serves at once: its scheduler admits requests by these, and its
    workers size the KV pool for them."""

    TITLE: ClassVar[str] = "scheduling"

    max_running_requests: int = setting(
        64, minimum=1, help="most requests running at once in an engine; the others wait"
    )
    context_length: int | None = setting(
        None,
        check=_check_context_length,
        help="most tokens of a request, prompt and output together, never more than the "
        "model's; empty or 0: the model's (max_position_embeddings)",
    )

    def context_limit(self, model_context: int) -> int:
        """Most tokens of a request on a model of `model_context` positions."""
        return min(self.context_length or model_context, model_context)


@dataclass(frozen=True, kw_only=True)
class KVSettings(PageSettings, CapacitySettings):
    """The KV pool: its page and its size."""

    max_total_tokens: int | None = setting(
        None,
        minimum=1,
        help="size of the KV-cache pool in tokens (rounded down to whole pages): what all "
        "running and cached requests hold together; empty: sized by the worker once the "
        "weights are loaded, from the memory mem_fraction_static leaves free for it: all of "
        "it on a GPU; on the CPU, where the pool's memory is taken only as it fills, enough "
        f"for max_running_requests requests of {TYPICAL_REQUEST_TOKENS} tokens (or of the "
        "context, if shorter) within it; never less than one request of the whole context. "
        "The worker logs the size, the bytes per token and which bound won",
    )
    mem_fraction_static: float = setting(
        0.85,
        check=_check_mem_fraction,
        help="share of the device's memory (a GPU's, or the host's on the CPU) that the "
        "weights and the KV pool may take together, in (0, 1]; the rest stays for "
        "activations and everything else. It sizes the pool when max_total_tokens is empty",
    )

    def cross_check(self) -> None:
        super().cross_check()
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(
                f"max_total_tokens must hold at least two pages ({2 * self.page_size} tokens "
                f"at page_size {self.page_size}), got {self.max_total_tokens}"
            )


@dataclass(frozen=True, kw_only=True)
class ScheduleSettings(CapacitySettings):
    """How an engine's scheduler admits, batches and caches requests."""

    TITLE: ClassVar[str] = "scheduling"

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
        "least recently used, least frequently used, first inserted, lowest priority, or "
        "slru (segmented LRU: prefixes hit again are protected from one-off prompts)",
    )
    radix_slru_protected_ratio: float = setting(
        0.8,
        check=_check_protected_ratio,
        help="under the slru eviction policy, the share of the KV pool that its protected "
        "segment (prefixes hit again since they were cached) may hold, in (0, 1)",
    )
    disable_overlap_schedule: bool = setting(
        False,
        help="finish each step before scheduling the next; by default the next step is "
        "scheduled while the model runs the current one, hiding the scheduler's CPU time "
        "behind the forward pass (turn it off to debug)",
    )
    stream_interval: int = setting(
        1,
        minimum=1,
        help="output tokens between the chunks of a streamed request (after its first, "
        "sent at once): 1 streams every token; more sends fewer, larger chunks, which costs "
        "the services less per token. A request with stop strings streams every token",
    )
    enable_priority_scheduling: bool = setting(
        False,
        help="admit waiting requests by their priority class first (schedule_policy orders "
        "each class), and let a more important arrival preempt running requests when the "
        "running batch is full or the KV pool has no room",
    )
    schedule_low_priority_values_first: bool = setting(
        False,
        help="with priority scheduling, a smaller priority value is more important; by "
        "default a larger one is",
    )
    priority_scheduling_preemption_threshold: int = setting(
        10,
        minimum=0,
        help="with priority scheduling, how much more important than a running request an "
        "arrival must be to preempt it (equal importance never preempts)",
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
class LoraSettings(Settings):
    """LoRA adapters served over the base model (SGLang's flags)."""

    TITLE: ClassVar[str] = "LoRA adapters"

    enable_lora: bool = setting(
        False, help="serve LoRA adapters (lora_paths) over the base model, mixed in a batch"
    )
    lora_paths: tuple[str, ...] = setting(
        (),
        check=_check_lora_paths,
        help="the adapters, each a PEFT folder (adapter_config.json + "
        "adapter_model.safetensors) or a Hugging Face repo of one, requested by its name as "
        "lora_path: one or more of PATH (named by its path), NAME=PATH, NAME=PATH,NAME=PATH "
        'or {"lora_name": NAME, "lora_path": PATH, "pinned": BOOL} (a pinned adapter keeps a '
        "device slot of its own); as a variable, one of them or a JSON array of them",
    )
    max_loras_per_batch: int = setting(
        8, minimum=1, help="adapters one step may mix: device slots for them; requests for "
        "another adapter wait until one is free"
    )
    max_lora_rank: int = setting(
        0, minimum=0, help="the largest rank an adapter may have (its slots' size); 0: the "
        "largest of lora_paths'"
    )
    max_loaded_loras: int | None = setting(
        None, minimum=1, help="adapters held in host memory at once (loaded at start or by "
        "/load_lora_adapter); empty: no limit"
    )
    lora_target_modules: str | None = setting(
        None,
        help="the projections adapters may target, comma-separated among q_proj, k_proj, "
        "v_proj, o_proj, gate_proj, up_proj, down_proj (or all); empty: what lora_paths' "
        "target",
    )

    def cross_check(self) -> None:
        super().cross_check()
        pinned = sum(ref.pinned for ref in parse_lora_paths(self.lora_paths))
        if pinned >= self.max_loras_per_batch:
            raise ValueError(
                f"lora_paths pins {pinned} adapter(s): at most max_loras_per_batch - 1 "
                f"({self.max_loras_per_batch - 1}) may be, so that the others have a slot"
            )


@dataclass(frozen=True, kw_only=True)
class NativeKernelSettings(Settings):
    """The native CPU kernels, read from the environment by whatever process loads them
    (`radixmesh.kernels.native`)."""

    TITLE: ClassVar[str] = "native kernels"

    native_kernels: bool = setting(
        True, help="build the native CPU kernels on first use and run them; false: torch's paths"
    )
    native_march: str = setting(
        "native",
        help="the -march the native kernels are built for, optionally followed by further -m "
        "flags ('haswell -mavxvnni')",
    )
    cache: str | None = setting(
        None, help="directory the built kernels are kept in (kernels/ under it); empty: "
        "~/.cache/radixmesh"
    )


# ---- the configs: each composed of the groups it uses ----------------------------------
# Bases are listed last group first: a dataclass's fields, and so its flags in --help,
# follow the reversed MRO.


@dataclass(frozen=True, kw_only=True)
class RunnerSettings(KVSettings, DeviceSettings, DecodingSettings, ModelSettings):
    """What a model runner is built from: the model, its device and its KV pool."""


@dataclass(frozen=True, kw_only=True)
class ReplicaSettings(SpeculativeSettings, HiCacheSettings, ScheduleSettings):
    """How an engine replica schedules requests and caches their KV."""


@dataclass(frozen=True, kw_only=True)
class EngineArgs(EngineSettings, LoraSettings, ReplicaSettings, HiCacheStorageSettings,
                 RunnerSettings):
    """Every knob of the in-process Engine (names follow SGLang's server args)."""
