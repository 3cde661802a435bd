"""Prometheus metrics of the scheduler service."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_P = "radixmesh_scheduler_"

RUNNING = Gauge(_P + "running_requests", "Requests prefilling or decoding")
WAITING = Gauge(_P + "waiting_requests", "Requests queued")
KV_USED = Gauge(_P + "kv_used_slots", "KV slots held by requests or the prefix cache")
KV_TOTAL = Gauge(_P + "kv_total_slots", "KV slots in the pool")
CACHED = Gauge(_P + "cached_tokens", "Tokens in the radix prefix cache")
PROMPT_TOKENS = Counter(_P + "prompt_tokens_total", "Prompt tokens of admitted requests")
CACHE_HIT_TOKENS = Counter(_P + "cache_hit_tokens_total", "Prompt tokens found in the cache")
GENERATED_TOKENS = Counter(_P + "generation_tokens_total", "Output tokens produced")
FINISHED = Counter(_P + "finished_requests_total", "Finished requests", ["reason"])
REFUSED = Counter(_P + "refused_requests_total", "Requests refused at admission")
STEP_TOKENS = Histogram(
    _P + "forward_batch_tokens",
    "Tokens per forward step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
)
STEP_SECONDS = Histogram(
    _P + "forward_seconds",
    "Forward round trip per step",
    buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
)
