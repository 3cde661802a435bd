"""Prometheus metrics of the worker service: one rank's model steps and KV pool.

SGLang has no worker of its own, so every name carries `radixmesh:worker_`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from radixmesh.core.step import StepBatch

if TYPE_CHECKING:
    from radixmesh.engine.model.lora import LoraPool

_RANK = ("model_name", "tp_rank")
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

FORWARD_SECONDS = Histogram(
    "radixmesh:worker_forward_seconds",
    "Model time per step, every step counted",
    _RANK,
    buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
)
BATCH_TOKENS = Histogram(
    "radixmesh:worker_batch_tokens", "Tokens computed per model step", _RANK, buckets=_SIZE_BUCKETS
)
BATCH_REQS = Histogram(
    "radixmesh:worker_batch_reqs", "Requests per model step", _RANK, buckets=_SIZE_BUCKETS
)
KV_RECEIVED_BYTES = Counter(
    "radixmesh:worker_kv_received_bytes_total",
    "Bytes of prompt KV written into this rank's pool by prefill engines (disaggregation)",
    _RANK,
)
LORA_SLOT_LOADS = Counter(
    "radixmesh:worker_lora_slot_loads_total",
    "LoRA adapters copied from host memory into a device slot for a request",
    _RANK,
)
LORA_SLOT_EVICTIONS = Counter(
    "radixmesh:worker_lora_slot_evictions_total",
    "LoRA adapters put out of their device slot to make room for another (least recently "
    "used first)",
    _RANK,
)
KV_POOL_TOKENS = Gauge(
    "radixmesh:worker_kv_pool_tokens", "Token slots in this rank's KV pool", _RANK
)


def batch_tokens(batch: StepBatch) -> int:
    """Tokens a step computes: a decode carries no ids but computes one."""
    return len(batch.decode_rows) + sum(len(e.input_ids) or 1 for e in batch.entries)


class WorkerMetrics:
    """One rank's metrics; the model's name joins the labels once it is loaded."""

    def __init__(self, tp_rank: int) -> None:
        self._labels = {"model_name": "", "tp_rank": str(tp_rank)}
        self._lora_counted = (0, 0)  # slot loads and evictions counted so far
        # The step metrics' children for the model, looked up once it is loaded.
        self._steps: tuple[Histogram, Histogram, Histogram] | None = None

    def loaded(self, model_name: str, num_slots: int) -> None:
        """Bind the model's name and show the pool's size."""
        self._labels["model_name"] = model_name
        self._steps = (FORWARD_SECONDS.labels(**self._labels),
                       BATCH_TOKENS.labels(**self._labels), BATCH_REQS.labels(**self._labels))
        KV_POOL_TOKENS.labels(**self._labels).set(num_slots)

    def forward(self, batch: StepBatch, forward_ms: float) -> None:
        """One step run; steps that only release requests compute nothing and add no size."""
        assert self._steps is not None, "a step before the model loaded"
        seconds, tokens, reqs = self._steps
        seconds.observe(forward_ms / 1e3)
        if batch.num_requests:
            tokens.observe(batch_tokens(batch))
            reqs.observe(batch.num_requests)

    def lora(self, pool: LoraPool) -> None:
        """The LoRA pool's slot loads and evictions since the last call."""
        loads, evictions = self._lora_counted
        LORA_SLOT_LOADS.labels(**self._labels).inc(pool.slot_loads - loads)
        LORA_SLOT_EVICTIONS.labels(**self._labels).inc(pool.slot_evictions - evictions)
        self._lora_counted = (pool.slot_loads, pool.slot_evictions)

    def received(self, nbytes: int) -> None:
        """A prefill engine's KV written into this rank's pool."""
        KV_RECEIVED_BYTES.labels(**self._labels).inc(nbytes)
